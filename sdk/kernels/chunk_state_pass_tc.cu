// Tensor-core tree state pass (math, tables and schedule: chunk_state_pass_tc.h).
//
// One launch per trie level and direction; a CTA of 4 warps owns (segment of the level, head, V tile
// of BV = 32 or 64 columns) and walks the segment's chunks. The fp32 state tile [KP, BV] (KP = K
// padded to 64 or 128) lives in registers as mma.sync accumulator fragments: warp wi owns state rows
// [wi*KP/4, (wi+1)*KP/4). Per chunk the state is rounded into shared memory (the MMA operand), the
// C x BV product (v_new forward, dv_total backward) is split by rows of C (16 per warp), and the
// state update K x BV (k over C) by the warps' own state rows.
//
// Forward, chunk c (phases separated by the CTA barriers A and B):
//   h_s = bf16(S)                                  | A: w(c), u(c) landed; h_s complete
//   issue kd(c); h[c] <- h_s; v = u - w h_s -> vn_s | B: kd(c) landed; vn_s complete
//   issue w(c+1), u(c+1); v_new[c] <- vn_s; S = decay S + kd^T vn_s
// Backward, chunk c (reverse):
//   dS_s = bf16(dS)                                | A: kd, q_g, grad_out, dv_local (c) landed
//   issue w(c); grad_state_out[c] <- dS_s; dv = dv_local + kd dS_s -> dv_s (stored negated);
//   dS = decay dS + q_g^T grad_out                 | B: w(c) landed; dv_s complete
//   issue kd.. (c-1); dv_total[c] <- -dv_s; dS += w^T (-dv)
// Every operand buffer is single-buffered but filled one phase ahead (cp.async, overlapping the
// other phase's MMAs); the small shared footprint (54-96 KB) leaves 2-4 CTAs per SM, whose phases
// interleave. Deterministic: fixed MMA order, no atomics. No host sync.
#include "tree_recurrence/kernels/chunk_state_pass_tc.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::kernels {
namespace {

namespace m = tree_recurrence::kernels::mma;

constexpr int kC = 64;         // chunk rows
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;

template <int KP, int BV>
struct Cfg {
  static constexpr int LDK = KP + 8;     // pitch of C x K tiles (w, kd, q_g)
  static constexpr int LDV = BV + 8;     // pitch of tiles BV wide (u, h, v_new, dS, dv, grad_out)
  static constexpr int MTS = KP / 64;    // 16-row tiles of state per warp
  static constexpr int RW = KP / kWarps; // state rows per warp
  static constexpr int NT = BV / 8;      // 8-column tiles
  static constexpr int KTK = KP / 16;    // k steps over K
  static constexpr int KTC = kC / 16;    // k steps over C
  static constexpr size_t fwd_elems = size_t(2) * kC * LDK + size_t(kC) * LDV + size_t(KP) * LDV + size_t(kC) * LDV;
  static constexpr size_t bwd_elems = size_t(3) * kC * LDK + size_t(2) * kC * LDV + size_t(KP) * LDV + size_t(kC) * LDV;
  static_assert(KP == 64 || KP == 128, "KP is 64 or 128");
  static_assert(BV == 32 || BV == 64, "BV is 32 or 64");
};

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}

// cp.async a ROWS x COLS tile (global row pitch gstride elements; columns >= valid_cols zero-filled)
// into shared memory of pitch LD. COLS and valid_cols are multiples of 8 (16-byte pieces).
template <typename T, int ROWS, int COLS, int LD>
__device__ __forceinline__ void load_tile(T* smem, const T* __restrict__ g, int64_t gstride, int valid_cols) {
  constexpr int PR = COLS / 8;
  constexpr int PIECES = ROWS * PR;
  static_assert(PIECES % kThreads == 0, "tile pieces split evenly over the CTA");
#pragma unroll
  for (int i = 0; i < PIECES / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / PR, col = (idx % PR) * 8;
    const bool ok = col < valid_cols;
    const T* src = ok ? g + r * gstride + col : g;
    m::cp_async_16(smem + r * LD + col, src, ok ? 16 : 0);
  }
}

// Stores rows < valid_rows, columns < valid_cols of a ROWS x COLS shared tile (pitch LD) to global
// memory (row pitch gstride) in 16-byte pieces; kNegate flips the sign bit of every element.
template <typename T, int ROWS, int COLS, int LD, bool kNegate>
__device__ __forceinline__ void store_tile(const T* smem, T* __restrict__ g, int64_t gstride, int valid_rows, int valid_cols) {
  constexpr int PR = COLS / 8;
  constexpr int PIECES = ROWS * PR;
  static_assert(PIECES % kThreads == 0, "tile pieces split evenly over the CTA");
#pragma unroll
  for (int i = 0; i < PIECES / kThreads; ++i) {
    const int idx = i * kThreads + static_cast<int>(threadIdx.x);
    const int r = idx / PR, col = (idx % PR) * 8;
    if (r < valid_rows && col < valid_cols) {
      uint4 v = *reinterpret_cast<const uint4*>(smem + r * LD + col);
      if (kNegate) {
        v.x ^= 0x80008000u;
        v.y ^= 0x80008000u;
        v.z ^= 0x80008000u;
        v.w ^= 0x80008000u;
      }
      *reinterpret_cast<uint4*>(g + r * gstride + col) = v;
    }
  }
}

// The warp's state fragments (rows wi*RW.., columns 0..BV-1 of the tile) rounded into shared memory.
template <typename T, int KP, int BV>
__device__ __forceinline__ void state_to_smem(const m::FragC (&S)[Cfg<KP, BV>::MTS][Cfg<KP, BV>::NT], T* dst, int wi, int l) {
  using G = Cfg<KP, BV>;
#pragma unroll
  for (int mt = 0; mt < G::MTS; ++mt)
#pragma unroll
    for (int nt = 0; nt < G::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int row = wi * G::RW + mt * 16 + m::c_row(l, e), col = nt * 8 + m::c_col(l, e);
        *reinterpret_cast<uint32_t*>(dst + row * G::LDV + col) = m::Elem<T>::pack(S[mt][nt].x[e], S[mt][nt].x[e + 1]);
      }
}

// fp32 global state (K x V, row pitch V, tile origin at column n0 already applied) <-> fragments.
template <int KP, int BV>
__device__ __forceinline__ void state_load(m::FragC (&S)[Cfg<KP, BV>::MTS][Cfg<KP, BV>::NT], const float* src, int64_t K,
                                           int64_t V, int vvalid, int wi, int l, bool accumulate) {
  using G = Cfg<KP, BV>;
#pragma unroll
  for (int mt = 0; mt < G::MTS; ++mt)
#pragma unroll
    for (int nt = 0; nt < G::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int row = wi * G::RW + mt * 16 + m::c_row(l, e), col = nt * 8 + m::c_col(l, e);
        float2 v = make_float2(0.f, 0.f);
        if (src && row < K && col < vvalid) v = *reinterpret_cast<const float2*>(src + row * V + col);
        if (accumulate) {
          S[mt][nt].x[e] += v.x;
          S[mt][nt].x[e + 1] += v.y;
        } else {
          S[mt][nt].x[e] = v.x;
          S[mt][nt].x[e + 1] = v.y;
        }
      }
}

template <int KP, int BV>
__device__ __forceinline__ void state_store(const m::FragC (&S)[Cfg<KP, BV>::MTS][Cfg<KP, BV>::NT], float* dst, int64_t K,
                                            int64_t V, int vvalid, int wi, int l) {
  using G = Cfg<KP, BV>;
#pragma unroll
  for (int mt = 0; mt < G::MTS; ++mt)
#pragma unroll
    for (int nt = 0; nt < G::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int row = wi * G::RW + mt * 16 + m::c_row(l, e), col = nt * 8 + m::c_col(l, e);
        if (row < K && col < vvalid)
          *reinterpret_cast<float2*>(dst + row * V + col) = make_float2(S[mt][nt].x[e], S[mt][nt].x[e + 1]);
      }
}

// out (rows 16*wi.., BV columns, in shared memory) = round(sign_out * (acc + base)), base from a
// shared tile of the same shape (or 0 when null), acc with sign_acc.
template <typename T, int BV>
__device__ __forceinline__ void rows_epilogue(const m::FragC (&acc)[1][BV / 8], const T* base, float sign_acc, float sign_out,
                                              T* out, int wi, int l) {
  constexpr int LDV = BV + 8;
#pragma unroll
  for (int nt = 0; nt < BV / 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int row = 16 * wi + m::c_row(l, e), col = nt * 8 + m::c_col(l, e);
      float2 b = make_float2(0.f, 0.f);
      if (base) b = unpack2<T>(*reinterpret_cast<const uint32_t*>(base + row * LDV + col));
      const float v0 = sign_out * (b.x + sign_acc * acc[0][nt].x[e]);
      const float v1 = sign_out * (b.y + sign_acc * acc[0][nt].x[e + 1]);
      *reinterpret_cast<uint32_t*>(out + row * LDV + col) = m::Elem<T>::pack(v0, v1);
    }
}

template <typename T, int KP, int BV>
__global__ void __launch_bounds__(kThreads) tc_forward_kernel(ChunkStatePassTcParams p, int64_t level_begin) {
  using G = Cfg<KP, BV>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* w_s = reinterpret_cast<T*>(smem_raw);  // C x LDK
  T* kd_s = w_s + kC * G::LDK;              // C x LDK
  T* u_s = kd_s + kC * G::LDK;              // C x LDV
  T* h_s = u_s + kC * G::LDV;               // KP x LDV
  T* vn_s = h_s + KP * G::LDV;              // C x LDV

  const int wi = static_cast<int>(threadIdx.x >> 5), l = static_cast<int>(threadIdx.x & 31);
  const int64_t H = p.heads, K = p.k_dim, V = p.v_dim, KV = K * V;
  const int64_t s = p.level_segments[level_begin + blockIdx.x];
  const int64_t head = blockIdx.y;
  const int n0 = static_cast<int>(blockIdx.z) * BV;
  const int vvalid = static_cast<int>(V - n0 < BV ? V - n0 : BV);
  const int kvalid = static_cast<int>(K);
  const T* w = static_cast<const T*>(p.w);
  const T* u = static_cast<const T*>(p.u);
  const T* kd = static_cast<const T*>(p.kd);
  T* h = static_cast<T*>(p.h);
  T* v_new = static_cast<T*>(p.v_new);

  m::FragC S[G::MTS][G::NT];
  {
    const float* start = nullptr;
    const int64_t parent = p.parents[s];
    if (parent >= 0) start = p.final_state + (parent * H + head) * KV;
    else if (p.initial_state) start = p.initial_state + ((p.initial_per_root ? p.root_index[s] * H : 0) + head) * KV;
    state_load<KP, BV>(S, start ? start + n0 : nullptr, K, V, vvalid, wi, l, false);
  }
  const int64_t c_begin = p.seg_chunk_offsets[s], c_end = p.seg_chunk_offsets[s + 1];
  auto issue_wu = [&](int64_t c) {
    const int64_t ch = c * H + head;
    if (w) load_tile<T, kC, KP, G::LDK>(w_s, w + ch * kC * K, K, kvalid);
    load_tile<T, kC, BV, G::LDV>(u_s, u + ch * kC * V + n0, V, vvalid);
    m::cp_async_commit();
  };
  issue_wu(c_begin);
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t ch = c * H + head;
    const float d = p.decay[ch];
    state_to_smem<T, KP, BV>(S, h_s, wi, l);
    m::cp_async_wait<0>();
    __syncthreads();  // A: w(c), u(c) landed; h_s complete; kd_s free
    load_tile<T, kC, KP, G::LDK>(kd_s, kd + ch * kC * K, K, kvalid);
    m::cp_async_commit();
    store_tile<T, KP, BV, G::LDV, false>(h_s, h + ch * KV + n0, V, kvalid, vvalid);
    m::FragC acc[1][G::NT];
#pragma unroll
    for (int nt = 0; nt < G::NT; ++nt) acc[0][nt].zero();
    if (w) m::warp_gemm<T, 1, G::NT, G::KTK, true, true>(acc, w_s + 16 * wi * G::LDK, G::LDK, h_s, G::LDV);
    rows_epilogue<T, BV>(acc, u_s, -1.f, 1.f, vn_s, wi, l);  // v_new = u - w h
    m::cp_async_wait<0>();
    __syncthreads();  // B: kd(c) landed; vn_s complete; w_s, u_s, h_s free
    if (c + 1 < c_end) issue_wu(c + 1);
    store_tile<T, kC, BV, G::LDV, false>(vn_s, v_new + ch * kC * V + n0, V, kC, vvalid);
#pragma unroll
    for (int mt = 0; mt < G::MTS; ++mt)
#pragma unroll
      for (int nt = 0; nt < G::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) S[mt][nt].x[e] *= d;
    m::warp_gemm<T, G::MTS, G::NT, G::KTC, false, true>(S, kd_s + wi * G::RW, G::LDK, vn_s, G::LDV);
  }
  state_store<KP, BV>(S, p.final_state + (s * H + head) * KV + n0, K, V, vvalid, wi, l);
}

template <typename T, int KP, int BV>
__global__ void __launch_bounds__(kThreads) tc_backward_kernel(ChunkStatePassTcParams p, int64_t level_begin) {
  using G = Cfg<KP, BV>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* kd_s = reinterpret_cast<T*>(smem_raw);  // C x LDK
  T* q_s = kd_s + kC * G::LDK;               // C x LDK
  T* w_s = q_s + kC * G::LDK;                // C x LDK
  T* go_s = w_s + kC * G::LDK;               // C x LDV
  T* dvl_s = go_s + kC * G::LDV;             // C x LDV
  T* ds_s = dvl_s + kC * G::LDV;             // KP x LDV
  T* dv_s = ds_s + KP * G::LDV;              // C x LDV, holds -dv_total

  const int wi = static_cast<int>(threadIdx.x >> 5), l = static_cast<int>(threadIdx.x & 31);
  const int64_t H = p.heads, K = p.k_dim, V = p.v_dim, KV = K * V;
  const int64_t s = p.level_segments[level_begin + blockIdx.x];
  const int64_t head = blockIdx.y;
  const int n0 = static_cast<int>(blockIdx.z) * BV;
  const int vvalid = static_cast<int>(V - n0 < BV ? V - n0 : BV);
  const int kvalid = static_cast<int>(K);
  const T* w = static_cast<const T*>(p.w);
  const T* kd = static_cast<const T*>(p.kd);
  const T* q_g = static_cast<const T*>(p.q_g);
  const T* grad_out = static_cast<const T*>(p.grad_out);
  const T* dv_local = static_cast<const T*>(p.dv_local);
  const bool has_q = q_g && grad_out;
  T* grad_state_out = static_cast<T*>(p.grad_state_out);
  T* dv_total = static_cast<T*>(p.dv_total);

  m::FragC dS[G::MTS][G::NT];
#pragma unroll
  for (int mt = 0; mt < G::MTS; ++mt)
#pragma unroll
    for (int nt = 0; nt < G::NT; ++nt) dS[mt][nt].zero();
  for (int64_t e = p.child_offsets[s]; e < p.child_offsets[s + 1]; ++e)
    state_load<KP, BV>(dS, p.workspace + (p.children[e] * H + head) * KV + n0, K, V, vvalid, wi, l, true);

  const int64_t c_begin = p.seg_chunk_offsets[s], c_last = p.seg_chunk_offsets[s + 1] - 1;
  auto issue_phase1 = [&](int64_t c) {
    const int64_t ch = c * H + head;
    load_tile<T, kC, KP, G::LDK>(kd_s, kd + ch * kC * K, K, kvalid);
    if (has_q) {
      load_tile<T, kC, KP, G::LDK>(q_s, q_g + ch * kC * K, K, kvalid);
      load_tile<T, kC, BV, G::LDV>(go_s, grad_out + ch * kC * V + n0, V, vvalid);
    }
    if (dv_local) load_tile<T, kC, BV, G::LDV>(dvl_s, dv_local + ch * kC * V + n0, V, vvalid);
    m::cp_async_commit();
  };
  issue_phase1(c_last);
  for (int64_t c = c_last; c >= c_begin; --c) {
    const int64_t ch = c * H + head;
    const float d = p.decay[ch];
    state_to_smem<T, KP, BV>(dS, ds_s, wi, l);
    m::cp_async_wait<0>();
    __syncthreads();  // A: kd, q_g, grad_out, dv_local (c) landed; ds_s complete; w_s, dv_s free
    if (w) {
      load_tile<T, kC, KP, G::LDK>(w_s, w + ch * kC * K, K, kvalid);
      m::cp_async_commit();
    }
    store_tile<T, KP, BV, G::LDV, false>(ds_s, grad_state_out + ch * KV + n0, V, kvalid, vvalid);
    m::FragC acc[1][G::NT];
#pragma unroll
    for (int nt = 0; nt < G::NT; ++nt) acc[0][nt].zero();
    m::warp_gemm<T, 1, G::NT, G::KTK, true, true>(acc, kd_s + 16 * wi * G::LDK, G::LDK, ds_s, G::LDV);
    rows_epilogue<T, BV>(acc, dv_local ? dvl_s : nullptr, 1.f, -1.f, dv_s, wi, l);  // -(dv_local + kd dS)
#pragma unroll
    for (int mt = 0; mt < G::MTS; ++mt)
#pragma unroll
      for (int nt = 0; nt < G::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dS[mt][nt].x[e] *= d;
    if (has_q) m::warp_gemm<T, G::MTS, G::NT, G::KTC, false, true>(dS, q_s + wi * G::RW, G::LDK, go_s, G::LDV);
    m::cp_async_wait<0>();
    __syncthreads();  // B: w(c) landed; dv_s complete; kd_s, q_s, go_s, dvl_s, ds_s free
    if (c > c_begin) issue_phase1(c - 1);
    store_tile<T, kC, BV, G::LDV, true>(dv_s, dv_total + ch * kC * V + n0, V, kC, vvalid);
    if (w) m::warp_gemm<T, G::MTS, G::NT, G::KTC, false, true>(dS, w_s + wi * G::RW, G::LDK, dv_s, G::LDV);
  }
  float* out = p.parents[s] >= 0 ? p.workspace + (s * H + head) * KV
                                 : p.grad_initial + (p.root_index[s] * H + head) * KV;
  state_store<KP, BV>(dS, out + n0, K, V, vvalid, wi, l);
}

// --- host side ---------------------------------------------------------------------------------

thread_local std::string g_error;

const char* fail(const std::string& what) {
  g_error = what;
  return g_error.c_str();
}

const char* dtype_name(ChunkDType t) {
  switch (t) {
    case ChunkDType::Float32: return "float32";
    case ChunkDType::Float64: return "float64";
    case ChunkDType::BFloat16: return "bfloat16";
    case ChunkDType::Float16: return "float16";
  }
  return "unknown";
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

std::string check_params(const ChunkStatePassTcParams& p, bool backward) {
  const std::string op = backward ? "chunk_state_pass_tc_backward: " : "chunk_state_pass_tc_forward: ";
  if (p.in != ChunkDType::BFloat16 && p.in != ChunkDType::Float16)
    return op + "inputs must be bfloat16 or float16, got " + dtype_name(p.in);
  if (p.num_chunks < 0 || p.heads < 0 || p.num_segments < 0 || p.num_roots < 0) return op + "negative sizes";
  if (p.k_dim < 1 || p.k_dim > kChunkStateTcMaxK || p.k_dim % 8 != 0)
    return op + "K = " + std::to_string(p.k_dim) + " must be a multiple of 8 in 8..128";
  if (p.v_dim < 1 || p.v_dim > kChunkStateTcMaxV || p.v_dim % 8 != 0)
    return op + "V = " + std::to_string(p.v_dim) + " must be a multiple of 8 in 8..128";
  if (p.heads > 65535) return op + "at most 65535 heads, got " + std::to_string(p.heads);
  if (p.v_tile != 0 && p.v_tile != 32 && p.v_tile != 64)
    return op + "v_tile must be 0 (automatic), 32 or 64, got " + std::to_string(p.v_tile);
  if (!p.level_offsets || p.num_levels < 0) return op + "level_offsets (host) are required";
  if (p.level_offsets[0] != 0 || p.level_offsets[p.num_levels] != p.num_segments)
    return op + "level_offsets must run from 0 to the number of segments " + std::to_string(p.num_segments);
  for (int64_t i = 0; i < p.num_levels; ++i)
    if (p.level_offsets[i + 1] < p.level_offsets[i]) return op + "level_offsets decrease at " + std::to_string(i + 1);
  if (p.num_levels > 0 && p.level_offsets[1] != p.num_roots)
    return op + "num_roots " + std::to_string(p.num_roots) + " differs from the size of level 0 (" +
           std::to_string(p.level_offsets[1]) + ")";
  if (p.num_chunks == 0 || p.heads == 0 || p.num_segments == 0) return "";
  if (!p.seg_chunk_offsets || !p.parents || !p.root_index || !p.level_segments || !p.child_offsets ||
      (!p.children && p.num_segments > p.num_roots))
    return op + "index tables are required";
  if (!p.kd || !p.decay) return op + "kd and decay are required";
  struct Ptr {
    const void* ptr;
    const char* name;
  };
  const Ptr common[] = {{p.w, "w"}, {p.kd, "kd"}, {p.decay, "decay"}};
  for (const Ptr& x : common)
    if (x.ptr && !aligned16(x.ptr)) return op + x.name + " must be 16-byte aligned";
  if (!backward) {
    if (!p.u || !p.h || !p.v_new || !p.final_state) return op + "u, h, v_new and final_state are required";
    const Ptr f[] = {{p.u, "u"}, {p.h, "h"}, {p.v_new, "v_new"}, {p.final_state, "final_state"},
                     {p.initial_state, "initial_state"}};
    for (const Ptr& x : f)
      if (x.ptr && !aligned16(x.ptr)) return op + x.name + " must be 16-byte aligned";
  } else {
    if (!p.grad_state_out || !p.dv_total || !p.grad_initial || !p.workspace)
      return op + "grad_state_out, dv_total, grad_initial and workspace are required";
    if ((p.q_g == nullptr) != (p.grad_out == nullptr)) return op + "q_g and grad_out are given together or not at all";
    const Ptr b[] = {{p.dv_local, "dv_local"},       {p.q_g, "q_g"},           {p.grad_out, "grad_out"},
                     {p.grad_state_out, "grad_state_out"}, {p.dv_total, "dv_total"}, {p.grad_initial, "grad_initial"},
                     {p.workspace, "workspace"}};
    for (const Ptr& x : b)
      if (x.ptr && !aligned16(x.ptr)) return op + x.name + " must be 16-byte aligned";
  }
  return "";
}

template <typename T, int KP, int BV, bool kBackward>
cudaError_t launch_level(const ChunkStatePassTcParams& p, int64_t begin, int64_t count, cudaStream_t stream) {
  using G = Cfg<KP, BV>;
  auto kernel = kBackward ? tc_backward_kernel<T, KP, BV> : tc_forward_kernel<T, KP, BV>;
  const size_t bytes = sizeof(T) * (kBackward ? G::bwd_elems : G::fwd_elems);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>((p.v_dim + BV - 1) / BV));
  kernel<<<grid, kThreads, bytes, stream>>>(p, begin);
  return cudaGetLastError();
}

template <typename T, bool kBackward>
const char* run_levels(const ChunkStatePassTcParams& p, cudaStream_t stream) {
  int device = 0, sms = 132;
  if (p.v_tile == 0) {
    if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      sms = 132;
  }
  const bool k64 = p.k_dim <= 64;
  for (int64_t step = 0; step < p.num_levels; ++step) {
    const int64_t level = kBackward ? p.num_levels - 1 - step : step;
    const int64_t begin = p.level_offsets[level], count = p.level_offsets[level + 1] - begin;
    if (count == 0) continue;
    if (count > 0x7fffffffLL) return fail("chunk_state_pass_tc: more than 2^31-1 segments in one level");
    // V tile: 64 when the level still gives every SM two CTAs at that width, else 32 (more CTAs).
    // K <= 64 always runs BV = 32.
    int bv = p.v_tile;
    if (bv == 0) bv = (p.v_dim > 32 && count * p.heads * ((p.v_dim + 63) / 64) >= 2LL * sms) ? 64 : 32;
    cudaError_t err;
    if (k64) err = launch_level<T, 64, 32, kBackward>(p, begin, count, stream);  // (KP 64, BV 64 spilled)
    else err = bv == 64 ? launch_level<T, 128, 64, kBackward>(p, begin, count, stream)
                        : launch_level<T, 128, 32, kBackward>(p, begin, count, stream);
    if (err != cudaSuccess)
      return fail(std::string(kBackward ? "chunk_state_pass_tc_backward" : "chunk_state_pass_tc_forward") +
                  ": launch of level " + std::to_string(level) + " failed: " + cudaGetErrorString(err));
  }
  return "";
}

template <bool kBackward>
const char* run(const ChunkStatePassTcParams& p, void* stream_ptr) {
  const std::string bad = check_params(p, kBackward);
  if (!bad.empty()) return fail(bad);
  if (p.num_chunks == 0 || p.heads == 0 || p.num_segments == 0) return "";
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  return p.in == ChunkDType::BFloat16 ? run_levels<__nv_bfloat16, kBackward>(p, stream) : run_levels<__half, kBackward>(p, stream);
}

}  // namespace

const char* chunk_state_pass_tc_forward(const ChunkStatePassTcParams& p, void* cuda_stream) { return run<false>(p, cuda_stream); }
const char* chunk_state_pass_tc_backward(const ChunkStatePassTcParams& p, void* cuda_stream) { return run<true>(p, cuda_stream); }

}  // namespace tree_recurrence::kernels
