// Tensor-core tree state pass (math, tables and schedule: chunk_state_pass_tc.h).
//
// One launch per trie level and direction; a CTA of NW = 4 or 8 warps owns (segment of the level,
// head, V tile of BV = 32 or 64 columns) and walks the segment's chunks. The fp32 state tile
// [KP, BV] (KP = K padded to 64 or 128) lives in registers as mma.sync accumulator fragments. Warp
// wi has the row group rq = wi % 4 and the column group cq = wi / 4 (NW / 4 groups of WN = BV * 4 /
// NW columns): it owns state rows [rq*KP/4, (rq+1)*KP/4) x columns [cq*WN, (cq+1)*WN), and of the
// chunk's C x BV products (v_new forward, dv_total backward; k over K) rows [16 rq, 16 rq + 16) x
// the same columns; the state update K x BV (k over C) by the warp's own state block. Per chunk
// the state is rounded into shared memory (the MMA operand).
//
// Forward, chunk c (phases separated by the CTA barriers A and B):
//   h_s = bf16(S)                                  | A: w(c), u(c) landed; h_s complete
//   h[c] <- h_s; v = u - w h_s -> vn_s             | B: kd(c) landed; vn_s complete
//   v_new[c] <- vn_s; S = decay S + kd^T vn_s
// Backward, chunk c (reverse):
//   dS_s = bf16(dS)                                | A: kd, q_g, grad_out, dv_local (c) landed
//   grad_state_out[c] <- dS_s; dv = dv_local + kd dS_s -> dv_s (stored negated);
//   dS = decay dS + q_g^T grad_out                 | B: w(c) landed; dv_s complete
//   dv_total[c] <- -dv_s; dS += w^T (-dv)
// grad_out is read chunk-major, or token-major through grad_out_rows (the row tokens of each chunk
// loaded a chunk ahead, TokenRows): the same shared tile either way.
// (NW = 8: all of chunk c's tiles have landed at A.)
// Two instances of the one kernel (template NW), the same arithmetic in the same order: every
// output element's MMA k-loop runs over the same k steps in the same order whichever warp computes
// it, so they are bitwise equal at BV 32:
// * NW = 4, the 4-warp kernel (BV 32 or 64): a warp's products are 16 x BV (k over K) and its
//   state block KP/4 x BV. Every operand tile single-buffered and filled one phase ahead (forward:
//   kd(c) issued at A, w(c+1), u(c+1) at B; backward: w(c) at A, the rest of c-1 at B).
//   55,296 / 77,824 B of shared memory at BV 32, 71,680 / 98,304 B at BV 64 (forward / backward,
//   K = 128), 2-4 CTAs per SM, whose phases interleave.
// * NW = 8, the wide kernel (BV 32 only): a warp's products are 16 x 16, its state block KP/4 x 16,
//   so each warp issues half the MMAs, ldmatrix loads, epilogue and copy work per chunk, and two
//   warps per SM sub-partition hide each other's latencies on the chunk's critical path (dependent
//   MMAs, barriers, shared-memory round trips). Two stages of operand tiles, each all of one
//   chunk's: chunk c + 1's loads are issued at barrier A of chunk c (right after the first
//   product's MMAs) into the stage chunk c - 1 freed, waited for at A of c + 1, so a whole chunk
//   hides them and barrier B waits on no load; the decays are read a chunk ahead (DecayAhead).
//   95,232 / 140,288 B of shared memory at K = 128, 57,344 / 86,016 B at K <= 64. For levels with
//   at most one CTA per SM (a long flat row), where no other CTA's phases fill the gaps.
// The host picks one per level (plan_level).
// Deterministic: fixed MMA order, no atomics. No host sync.
#include "tree_recurrence/kernels/chunk_state_pass_tc.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <string>

#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::kernels {
namespace {

namespace m = tree_recurrence::kernels::mma;

constexpr int kC = 64;  // chunk rows

template <int KP, int BV, int NW>
struct Cfg {
  static constexpr int THREADS = 32 * NW;
  static constexpr int CQ = NW / 4;      // column groups
  static constexpr int WN = BV / CQ;     // columns per warp
  static constexpr int LDK = KP + 8;     // pitch of C x K tiles (w, kd, q_g)
  static constexpr int LDV = BV + 8;     // pitch of tiles BV wide (u, h, v_new, dS, dv, grad_out)
  static constexpr int MTS = KP / 64;    // 16-row tiles of state per warp
  static constexpr int RW = KP / 4;      // state rows per warp
  static constexpr int NT = WN / 8;      // 8-column tiles per warp
  static constexpr int KTK = KP / 16;    // k steps over K
  static constexpr int KTC = kC / 16;    // k steps over C
  static constexpr size_t KT = size_t(kC) * LDK;  // a C x K tile
  static constexpr size_t VT = size_t(kC) * LDV;  // a C x BV tile
  static constexpr size_t ST = size_t(KP) * LDV;  // the rounded state tile
  static constexpr int NB = NW == 8 ? 2 : 1;            // operand stages (the wide kernel: 2)
  static constexpr size_t fwd_stage = 2 * KT + VT;      // w, kd, u
  static constexpr size_t bwd_stage = 3 * KT + 2 * VT;  // kd, q_g, w, grad_out, dv_local
  static constexpr size_t fwd_elems = NB * fwd_stage + ST + VT;  // stages; h_s, vn_s
  static constexpr size_t bwd_elems = NB * bwd_stage + ST + VT;  // stages; ds_s, dv_s
  static_assert(KP == 64 || KP == 128, "KP is 64 or 128");
  static_assert(BV == 32 || BV == 64, "BV is 32 or 64");
  static_assert(NW == 4 || (NW == 8 && BV == 32), "4 warps, or 8 at BV 32");
  static_assert(NT % 2 == 0, "warp_gemm takes 16-column pairs");
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

// Calls f(r, col) for this thread's 16-byte pieces (8 elements, columns col..col+7 of row r) of a
// ROWS x COLS tile, the pieces split evenly over the CTA's THREADS threads.
template <int ROWS, int COLS, int THREADS, typename F>
__device__ __forceinline__ void for_pieces(F&& f) {
  constexpr int PR = COLS / 8;
  constexpr int PIECES = ROWS * PR;
  static_assert(PIECES % THREADS == 0, "tile pieces split evenly over the CTA");
#pragma unroll
  for (int i = 0; i < PIECES / THREADS; ++i) {
    const int idx = i * THREADS + static_cast<int>(threadIdx.x);
    f(idx / PR, (idx % PR) * 8);
  }
}

// cp.async a ROWS x COLS tile (global row pitch gstride elements; columns >= valid_cols zero-filled)
// into shared memory of pitch LD. COLS and valid_cols are multiples of 8 (16-byte pieces).
template <typename T, int ROWS, int COLS, int LD, int THREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* __restrict__ g, int64_t gstride, int valid_cols) {
  for_pieces<ROWS, COLS, THREADS>([&](int r, int col) {
    const bool ok = col < valid_cols;
    const T* src = ok ? g + r * gstride + col : g;
    m::cp_async_16(smem + r * LD + col, src, ok ? 16 : 0);
  });
}

// Stores rows < valid_rows, columns < valid_cols of a ROWS x COLS shared tile (pitch LD) to global
// memory (row pitch gstride) in 16-byte pieces; kNegate flips the sign bit of every element.
template <typename T, int ROWS, int COLS, int LD, int THREADS, bool kNegate>
__device__ __forceinline__ void store_tile(const T* smem, T* __restrict__ g, int64_t gstride, int valid_rows, int valid_cols) {
  for_pieces<ROWS, COLS, THREADS>([&](int r, int col) {
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
  });
}

// The tokens of the rows of this thread's 16-byte pieces of a C x BV tile (the pieces for_pieces
// gives it, in order) for a token-major operand (rows: the (NC, C) table, -1 = a padding row), loaded
// one chunk ahead: load(c) issues plain loads that land while the current chunk runs; the next
// issue reads tok.
template <int BV, int THREADS>
struct TokenRows {
  static constexpr int PR = BV / 8;
  static constexpr int N = kC * PR / THREADS;
  static_assert((kC * PR) % THREADS == 0, "tile pieces split evenly over the CTA");
  const int64_t* rows;
  int64_t tok[N];
  __device__ __forceinline__ void load(int64_t c) {
    if (!rows) return;
#pragma unroll
    for (int i = 0; i < N; ++i) tok[i] = rows[c * kC + (i * THREADS + static_cast<int>(threadIdx.x)) / PR];
  }
};

// cp.async a C x BV tile of a token-major operand (row i at g + tok(i) * row_pitch, g at the head and
// tile column already; rows of token -1 and columns >= valid_cols zero-filled) into shared memory of
// pitch LD. The same shared tile as load_tile of the chunk-major copy.
template <typename T, int BV, int LD, int THREADS>
__device__ __forceinline__ void load_token_tile(T* smem, const T* __restrict__ g, int64_t row_pitch,
                                                const TokenRows<BV, THREADS>& rows, int valid_cols) {
  constexpr int PR = TokenRows<BV, THREADS>::PR;
#pragma unroll
  for (int i = 0; i < TokenRows<BV, THREADS>::N; ++i) {
    const int idx = i * THREADS + static_cast<int>(threadIdx.x);
    const int r = idx / PR, col = (idx % PR) * 8;
    const int64_t tk = rows.tok[i];
    const bool ok = tk >= 0 && col < valid_cols;
    const T* src = ok ? g + tk * row_pitch + col : g;
    m::cp_async_16(smem + r * LD + col, src, ok ? 16 : 0);
  }
}

template <int KP, int BV, int NW>
using StateFrags = m::FragC[Cfg<KP, BV, NW>::MTS][Cfg<KP, BV, NW>::NT];

// Calls f(frag, e, row, col) for each pair (e, e + 1) of the warp's state fragments (rows rq*RW..,
// columns cq*WN.., tile columns col, col + 1).
template <int KP, int BV, int NW, typename Frags, typename F>
__device__ __forceinline__ void for_state_pairs(Frags& S, int rq, int cq, int l, F&& f) {
  using G = Cfg<KP, BV, NW>;
#pragma unroll
  for (int mt = 0; mt < G::MTS; ++mt)
#pragma unroll
    for (int nt = 0; nt < G::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2)
        f(S[mt][nt], e, rq * G::RW + mt * 16 + m::c_row(l, e), cq * G::WN + nt * 8 + m::c_col(l, e));
}

// The warp's state fragments rounded into shared memory.
template <typename T, int KP, int BV, int NW>
__device__ __forceinline__ void state_to_smem(const StateFrags<KP, BV, NW>& S, T* dst, int rq, int cq, int l) {
  for_state_pairs<KP, BV, NW>(S, rq, cq, l, [&](const m::FragC& f, int e, int row, int col) {
    *reinterpret_cast<uint32_t*>(dst + row * Cfg<KP, BV, NW>::LDV + col) = m::Elem<T>::pack(f.x[e], f.x[e + 1]);
  });
}

// fp32 global state (K x V, row pitch V, tile origin at column n0 already applied) <-> fragments.
template <int KP, int BV, int NW>
__device__ __forceinline__ void state_load(StateFrags<KP, BV, NW>& S, const float* src, int64_t K, int64_t V, int vvalid, int rq,
                                           int cq, int l, bool accumulate) {
  for_state_pairs<KP, BV, NW>(S, rq, cq, l, [&](m::FragC& f, int e, int row, int col) {
    float2 v = make_float2(0.f, 0.f);
    if (src && row < K && col < vvalid) v = *reinterpret_cast<const float2*>(src + row * V + col);
    if (accumulate) {
      f.x[e] += v.x;
      f.x[e + 1] += v.y;
    } else {  // not 0 + v: that would turn -0 into +0
      f.x[e] = v.x;
      f.x[e + 1] = v.y;
    }
  });
}

template <int KP, int BV, int NW>
__device__ __forceinline__ void state_store(const StateFrags<KP, BV, NW>& S, float* dst, int64_t K, int64_t V, int vvalid, int rq,
                                            int cq, int l) {
  for_state_pairs<KP, BV, NW>(S, rq, cq, l, [&](const m::FragC& f, int e, int row, int col) {
    if (row < K && col < vvalid) *reinterpret_cast<float2*>(dst + row * V + col) = make_float2(f.x[e], f.x[e + 1]);
  });
}

template <int KP, int BV, int NW>
__device__ __forceinline__ void state_scale(StateFrags<KP, BV, NW>& S, float d) {
#pragma unroll
  for (int mt = 0; mt < Cfg<KP, BV, NW>::MTS; ++mt)
#pragma unroll
    for (int nt = 0; nt < Cfg<KP, BV, NW>::NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) S[mt][nt].x[e] *= d;
}

// out (rows 16*rq.., the warp's columns cq*WN.., in shared memory) = round(sign_out * (acc + base)),
// base from a shared tile of the same shape (or 0 when null), acc with sign_acc.
template <typename T, int KP, int BV, int NW>
__device__ __forceinline__ void rows_epilogue(const m::FragC (&acc)[1][Cfg<KP, BV, NW>::NT], const T* base, float sign_acc,
                                              float sign_out, T* out, int rq, int cq, int l) {
  using G = Cfg<KP, BV, NW>;
#pragma unroll
  for (int nt = 0; nt < G::NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int row = 16 * rq + m::c_row(l, e), col = cq * G::WN + nt * 8 + m::c_col(l, e);
      float2 b = make_float2(0.f, 0.f);
      if (base) b = unpack2<T>(*reinterpret_cast<const uint32_t*>(base + row * G::LDV + col));
      const float v0 = sign_out * (b.x + sign_acc * acc[0][nt].x[e]);
      const float v1 = sign_out * (b.y + sign_acc * acc[0][nt].x[e + 1]);
      *reinterpret_cast<uint32_t*>(out + row * G::LDV + col) = m::Elem<T>::pack(v0, v1);
    }
}

// A warp's block of the C x BV rows product (rows 16*rq.., columns cq*WN.., k over K): A (rows,
// pitch LDK) times the state tile.
template <typename T, int KP, int BV, int NW>
__device__ __forceinline__ void rows_product(m::FragC (&acc)[1][Cfg<KP, BV, NW>::NT], const T* a_s, const T* state_s, int rq,
                                             int cq) {
  using G = Cfg<KP, BV, NW>;
#pragma unroll
  for (int nt = 0; nt < G::NT; ++nt) acc[0][nt].zero();
  m::warp_gemm<T, 1, G::NT, G::KTK, true, true>(acc, a_s + 16 * rq * G::LDK, G::LDK, state_s + cq * G::WN, G::LDV);
}

// S += A^T B over the chunk's rows: A a C x K tile (pitch LDK; the warp's state rows), B C x BV
// (the warp's columns).
template <typename T, int KP, int BV, int NW>
__device__ __forceinline__ void state_update(StateFrags<KP, BV, NW>& S, const T* a_s, const T* b_s, int rq, int cq) {
  using G = Cfg<KP, BV, NW>;
  m::warp_gemm<T, G::MTS, G::NT, G::KTC, false, true>(S, a_s + rq * G::RW, G::LDK, b_s + cq * G::WN, G::LDV);
}

// What a CTA works on.
template <int BV, int NW>
struct Cta {
  int rq, cq, l;
  int64_t H, K, V, KV, s, head;
  int n0, vvalid, kvalid;
  __device__ __forceinline__ Cta(const ChunkStatePassTcParams& p, int64_t level_begin)
      : rq(static_cast<int>(NW == 4 ? threadIdx.x >> 5 : (threadIdx.x >> 5) & 3)),
        cq(static_cast<int>(NW == 4 ? 0 : threadIdx.x >> 7)),
        l(static_cast<int>(threadIdx.x & 31)),
        H(p.heads),
        K(p.k_dim),
        V(p.v_dim),
        KV(p.k_dim * p.v_dim),
        s(p.level_segments[level_begin + blockIdx.x]),
        head(blockIdx.y),
        n0(static_cast<int>(blockIdx.z) * BV),
        vvalid(static_cast<int>(p.v_dim - n0 < BV ? p.v_dim - n0 : BV)),
        kvalid(static_cast<int>(p.k_dim)) {}
};

// The decay of each chunk, read one chunk ahead (first, first + step, ... up to last).
struct DecayAhead {
  const float* decay;
  int64_t H, head, last;
  int step;
  float next;
  __device__ __forceinline__ DecayAhead(const float* decay_, int64_t H_, int64_t head_, int64_t first, int64_t last_, int step_)
      : decay(decay_), H(H_), head(head_), last(last_), step(step_), next(at(first)) {}
  __device__ __forceinline__ float at(int64_t c) const {
    return (step > 0 ? c <= last : c >= last) ? decay[c * H + head] : 0.f;
  }
  // The decay of chunk c (visited in order), reading chunk c + step's.
  __device__ __forceinline__ float take(int64_t c) {
    const float d = next;
    next = at(c + step);
    return d;
  }
};

template <typename T, int KP, int BV, int NW>
__global__ void __launch_bounds__(32 * NW) tc_forward_kernel(ChunkStatePassTcParams p, int64_t level_begin) {
  using G = Cfg<KP, BV, NW>;
  constexpr int TH = G::THREADS, NB = G::NB;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* const stages = reinterpret_cast<T*>(smem_raw);  // NB x {w: C x LDK, kd: C x LDK, u: C x LDV}
  T* const h_s = stages + NB * G::fwd_stage;          // KP x LDV
  T* const vn_s = h_s + G::ST;                        // C x LDV

  const Cta<BV, NW> t(p, level_begin);
  const int rq = t.rq, cq = t.cq, l = t.l;
  const T* w = static_cast<const T*>(p.w);
  const T* u = static_cast<const T*>(p.u);
  const T* kd = static_cast<const T*>(p.kd);
  T* h = static_cast<T*>(p.h);
  T* v_new = static_cast<T*>(p.v_new);

  StateFrags<KP, BV, NW> S;
  {
    const float* start = nullptr;
    const int64_t parent = p.parents[t.s];
    if (parent >= 0) start = p.final_state + (parent * t.H + t.head) * t.KV;
    else if (p.initial_state) start = p.initial_state + ((p.initial_per_root ? p.root_index[t.s] * t.H : 0) + t.head) * t.KV;
    state_load<KP, BV, NW>(S, start ? start + t.n0 : nullptr, t.K, t.V, t.vvalid, rq, cq, l, false);
  }
  const int64_t c_begin = p.seg_chunk_offsets[t.s], c_end = p.seg_chunk_offsets[t.s + 1];
  // Issues chunk c's w, u (wu) and kd (kdd) into stage st as one cp.async group.
  auto issue = [&](int64_t c, T* st, bool wu, bool kdd) {
    if (c < c_end) {
      const int64_t ch = c * t.H + t.head;
      if (wu && w) load_tile<T, kC, KP, G::LDK, TH>(st, w + ch * kC * t.K, t.K, t.kvalid);
      if (kdd) load_tile<T, kC, KP, G::LDK, TH>(st + G::KT, kd + ch * kC * t.K, t.K, t.kvalid);
      if (wu) load_tile<T, kC, BV, G::LDV, TH>(st + 2 * G::KT, u + ch * kC * t.V + t.n0, t.V, t.vvalid);
    }
    m::cp_async_commit();
  };
  // NB 1 (the 4-warp kernel): w, u first, kd at A. NB 2: all of chunk c + 1 at A of chunk c.
  issue(c_begin, stages, true, NB == 2);
  int cur = 0;  // stage of chunk c
  DecayAhead ahead(p.decay, t.H, t.head, c_begin, c_end - 1, 1);
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t ch = c * t.H + t.head;
    const float d = NB == 2 ? ahead.take(c) : p.decay[ch];
    T* const st = stages + cur * G::fwd_stage;
    state_to_smem<T, KP, BV, NW>(S, h_s, rq, cq, l);
    m::cp_async_wait<0>();
    // A: w(c), u(c) (NB 2: and kd(c)) landed; h_s complete; vn_s (NB 1: kd; NB 2: the other stage) free
    __syncthreads();
    if constexpr (NB == 1) {
      issue(c, st, false, true);
      store_tile<T, KP, BV, G::LDV, TH, false>(h_s, h + ch * t.KV + t.n0, t.V, t.kvalid, t.vvalid);
    }
    m::FragC acc[1][G::NT];
    if (w) {
      rows_product<T, KP, BV, NW>(acc, st, h_s, rq, cq);
    } else {
#pragma unroll
      for (int nt = 0; nt < G::NT; ++nt) acc[0][nt].zero();
    }
    if constexpr (NB == 2) {  // issued while the MMAs run; a whole chunk to land
      if (c + 1 < c_end) issue(c + 1, stages + (cur ^ 1) * G::fwd_stage, true, true);
      store_tile<T, KP, BV, G::LDV, TH, false>(h_s, h + ch * t.KV + t.n0, t.V, t.kvalid, t.vvalid);
    }
    rows_epilogue<T, KP, BV, NW>(acc, st + 2 * G::KT, -1.f, 1.f, vn_s, rq, cq, l);  // v_new = u - w h
    if constexpr (NB == 1) m::cp_async_wait<0>();
    __syncthreads();  // B: (NB 1: kd(c) landed;) vn_s complete; h_s (NB 1: w, u) free
    if constexpr (NB == 1) {
      if (c + 1 < c_end) issue(c + 1, st, true, false);
      store_tile<T, kC, BV, G::LDV, TH, false>(vn_s, v_new + ch * kC * t.V + t.n0, t.V, kC, t.vvalid);
    }
    state_scale<KP, BV, NW>(S, d);
    state_update<T, KP, BV, NW>(S, st + G::KT, vn_s, rq, cq);
    if constexpr (NB == 2) store_tile<T, kC, BV, G::LDV, TH, false>(vn_s, v_new + ch * kC * t.V + t.n0, t.V, kC, t.vvalid);
    cur ^= NB - 1;
  }
  state_store<KP, BV, NW>(S, p.final_state + (t.s * t.H + t.head) * t.KV + t.n0, t.K, t.V, t.vvalid, rq, cq, l);
}

template <typename T, int KP, int BV, int NW>
__global__ void __launch_bounds__(32 * NW) tc_backward_kernel(ChunkStatePassTcParams p, int64_t level_begin) {
  using G = Cfg<KP, BV, NW>;
  constexpr int TH = G::THREADS, NB = G::NB;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // NB x {kd, q_g, w: C x LDK each; grad_out, dv_local: C x LDV each}
  T* const stages = reinterpret_cast<T*>(smem_raw);
  T* const ds_s = stages + NB * G::bwd_stage;  // KP x LDV
  T* const dv_s = ds_s + G::ST;                // C x LDV, holds -dv_total

  const Cta<BV, NW> t(p, level_begin);
  const int rq = t.rq, cq = t.cq, l = t.l;
  const T* w = static_cast<const T*>(p.w);
  const T* kd = static_cast<const T*>(p.kd);
  const T* q_g = static_cast<const T*>(p.q_g);
  const T* grad_out = static_cast<const T*>(p.grad_out);
  const T* dv_local = static_cast<const T*>(p.dv_local);
  const bool has_q = q_g && grad_out;
  T* grad_state_out = static_cast<T*>(p.grad_state_out);
  T* dv_total = static_cast<T*>(p.dv_total);

  StateFrags<KP, BV, NW> dS;
  state_load<KP, BV, NW>(dS, nullptr, t.K, t.V, t.vvalid, rq, cq, l, false);  // zeros
  for (int64_t e = p.child_offsets[t.s]; e < p.child_offsets[t.s + 1]; ++e)
    state_load<KP, BV, NW>(dS, p.workspace + (p.children[e] * t.H + t.head) * t.KV + t.n0, t.K, t.V, t.vvalid, rq, cq, l, true);

  const int64_t c_begin = p.seg_chunk_offsets[t.s], c_last = p.seg_chunk_offsets[t.s + 1] - 1;
  // grad_out token-major (grad_out_rows): the rows' tokens of chunk c are read while chunk c + 1
  // runs (the chunks' grad_out tiles are issued in the order c_last, c_last - 1, ..., c_begin)
  TokenRows<BV, TH> go_rows{has_q ? p.grad_out_rows : nullptr, {}};
  if (c_last >= c_begin) go_rows.load(c_last);
  // Issues chunk c's kd, q_g, grad_out, dv_local (p1) and w (pw) into stage st as one cp.async group.
  auto issue = [&](int64_t c, T* st, bool p1, bool pw) {
    if (c >= c_begin) {
      const int64_t ch = c * t.H + t.head;
      const int64_t ok = ch * kC * t.K, ov = ch * kC * t.V + t.n0;
      if (p1) {
        load_tile<T, kC, KP, G::LDK, TH>(st, kd + ok, t.K, t.kvalid);
        if (has_q) {
          load_tile<T, kC, KP, G::LDK, TH>(st + G::KT, q_g + ok, t.K, t.kvalid);
          if (go_rows.rows) {
            load_token_tile<T, BV, G::LDV, TH>(st + 3 * G::KT, grad_out + t.head * t.V + t.n0, t.H * t.V, go_rows, t.vvalid);
            if (c > c_begin) go_rows.load(c - 1);
          } else {
            load_tile<T, kC, BV, G::LDV, TH>(st + 3 * G::KT, grad_out + ov, t.V, t.vvalid);
          }
        }
        if (dv_local) load_tile<T, kC, BV, G::LDV, TH>(st + 3 * G::KT + G::VT, dv_local + ov, t.V, t.vvalid);
      }
      if (pw && w) load_tile<T, kC, KP, G::LDK, TH>(st + 2 * G::KT, w + ok, t.K, t.kvalid);
    }
    m::cp_async_commit();
  };
  // NB 1 (the 4-warp kernel): w at A, the rest of chunk c - 1 at B. NB 2: all of c - 1 at A of c.
  issue(c_last, stages, true, NB == 2);
  int cur = 0;
  DecayAhead ahead(p.decay, t.H, t.head, c_last, c_begin, -1);
  for (int64_t c = c_last; c >= c_begin; --c) {
    const int64_t ch = c * t.H + t.head;
    const float d = NB == 2 ? ahead.take(c) : p.decay[ch];
    T* const st = stages + cur * G::bwd_stage;
    state_to_smem<T, KP, BV, NW>(dS, ds_s, rq, cq, l);
    m::cp_async_wait<0>();
    // A: kd, q_g, grad_out, dv_local (NB 2: and w) (c) landed; ds_s complete; dv_s (NB 1: w; NB 2:
    // the other stage) free
    __syncthreads();
    if constexpr (NB == 1) {
      if (w) issue(c, st, false, true);
      store_tile<T, KP, BV, G::LDV, TH, false>(ds_s, grad_state_out + ch * t.KV + t.n0, t.V, t.kvalid, t.vvalid);
    }
    m::FragC acc[1][G::NT];
    rows_product<T, KP, BV, NW>(acc, st, ds_s, rq, cq);
    if constexpr (NB == 2) {  // issued while the MMAs run; a whole chunk to land
      if (c > c_begin) issue(c - 1, stages + (cur ^ 1) * G::bwd_stage, true, true);
      store_tile<T, KP, BV, G::LDV, TH, false>(ds_s, grad_state_out + ch * t.KV + t.n0, t.V, t.kvalid, t.vvalid);
    }
    rows_epilogue<T, KP, BV, NW>(acc, dv_local ? st + 3 * G::KT + G::VT : nullptr, 1.f, -1.f, dv_s, rq, cq, l);  // -(dv_local + kd dS)
    state_scale<KP, BV, NW>(dS, d);
    if (has_q) state_update<T, KP, BV, NW>(dS, st + G::KT, st + 3 * G::KT, rq, cq);
    if constexpr (NB == 1) m::cp_async_wait<0>();
    __syncthreads();  // B: (NB 1: w(c) landed;) dv_s complete; ds_s (NB 1: kd, q_g, grad_out, dv_local) free
    if constexpr (NB == 1) {
      if (c > c_begin) issue(c - 1, st, true, false);
      store_tile<T, kC, BV, G::LDV, TH, true>(dv_s, dv_total + ch * kC * t.V + t.n0, t.V, kC, t.vvalid);
    }
    if (w) state_update<T, KP, BV, NW>(dS, st + 2 * G::KT, dv_s, rq, cq);
    if constexpr (NB == 2) store_tile<T, kC, BV, G::LDV, TH, true>(dv_s, dv_total + ch * kC * t.V + t.n0, t.V, kC, t.vvalid);
    cur ^= NB - 1;
  }
  float* out = p.parents[t.s] >= 0 ? p.workspace + (t.s * t.H + t.head) * t.KV
                                   : p.grad_initial + (p.root_index[t.s] * t.H + t.head) * t.KV;
  state_store<KP, BV, NW>(dS, out + t.n0, t.K, t.V, t.vvalid, rq, cq, l);
}

// --- host side ---------------------------------------------------------------------------------

thread_local std::string g_error;

const char* fail(const std::string& what) {
  g_error = what;
  return g_error.c_str();
}


struct Ptr {
  const void* ptr;
  const char* name;
};

// The name of the first given pointer that is not 16-byte aligned, else null.
const char* misaligned(std::initializer_list<Ptr> ptrs) {
  for (const Ptr& x : ptrs)
    if (x.ptr && (reinterpret_cast<uintptr_t>(x.ptr) & 15u) != 0) return x.name;
  return nullptr;
}

std::string check_params(const ChunkStatePassTcParams& p, bool backward) {
  const std::string op = backward ? "chunk_state_pass_tc_backward: " : "chunk_state_pass_tc_forward: ";
  if (p.in != ChunkDType::BFloat16 && p.in != ChunkDType::Float16)
    return op + "inputs must be bfloat16 or float16, got " + element_type_name(p.in);
  if (p.num_chunks < 0 || p.heads < 0 || p.num_segments < 0 || p.num_roots < 0) return op + "negative sizes";
  if (p.k_dim < 1 || p.k_dim > kChunkStateTcMaxK || p.k_dim % 8 != 0)
    return op + "K = " + std::to_string(p.k_dim) + " must be a multiple of 8 in 8..128";
  if (p.v_dim < 1 || p.v_dim > kChunkStateTcMaxV || p.v_dim % 8 != 0)
    return op + "V = " + std::to_string(p.v_dim) + " must be a multiple of 8 in 8..128";
  if (p.heads > 65535) return op + "at most 65535 heads, got " + std::to_string(p.heads);
  if (p.v_tile != 0 && p.v_tile != 32 && p.v_tile != 64)
    return op + "v_tile must be 0 (automatic), 32 or 64, got " + std::to_string(p.v_tile);
  if (p.wide < -1 || p.wide > 1) return op + "wide must be -1 (automatic), 0 or 1, got " + std::to_string(p.wide);
  if (p.wide == 1 && p.v_tile == 64) return op + "the wide kernel (wide 1) runs V tiles of 32 only, not v_tile 64";
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
  const char* bad = misaligned({{p.w, "w"}, {p.kd, "kd"}, {p.decay, "decay"}});
  if (!backward) {
    if (!p.u || !p.h || !p.v_new || !p.final_state) return op + "u, h, v_new and final_state are required";
    if (!bad)
      bad = misaligned({{p.u, "u"}, {p.h, "h"}, {p.v_new, "v_new"}, {p.final_state, "final_state"},
                        {p.initial_state, "initial_state"}});
  } else {
    if (!p.grad_state_out || !p.dv_total || !p.grad_initial || !p.workspace)
      return op + "grad_state_out, dv_total, grad_initial and workspace are required";
    if ((p.q_g == nullptr) != (p.grad_out == nullptr)) return op + "q_g and grad_out are given together or not at all";
    if (p.grad_out_rows && !p.grad_out) return op + "grad_out_rows (token-major grad_out) needs grad_out";
    if (!bad)
      bad = misaligned({{p.dv_local, "dv_local"}, {p.q_g, "q_g"}, {p.grad_out, "grad_out"},
                        {p.grad_state_out, "grad_state_out"}, {p.dv_total, "dv_total"}, {p.grad_initial, "grad_initial"},
                        {p.workspace, "workspace"}});
  }
  if (bad) return op + bad + " must be 16-byte aligned";
  return "";
}

// The kernel plan of one level: the wide kernel (8 warps, BV 32) or the 4-warp one at BV 32 or 64.
struct LevelPlan {
  bool wide;
  int bv;
};

// Chosen once per level from the level's grid, the SM count and whether the wide kernel's shared
// memory fits the device (p.wide / p.v_tile force a choice: tests). The wide kernel when the
// level's grid at BV 32 has at most one CTA per SM (one long flat row: no other CTA on the SM fills
// the gaps of a chunk's critical path, and 8 warps halve each warp's share of it); else the 4-warp
// kernel, whose 2-4 CTAs per SM interleave their phases, at BV 64 when the level still gives every
// SM two CTAs at that width, else 32 (more CTAs). K <= 64 runs BV 32 only.
LevelPlan plan_level(const ChunkStatePassTcParams& p, int64_t count, int sms, bool wide_fits) {
  const int64_t ctas32 = count * p.heads * ((p.v_dim + 31) / 32);
  if (p.wide == 1 || (p.wide < 0 && wide_fits && p.v_tile != 64 && ctas32 <= sms)) return {true, 32};
  if (p.v_tile != 0) return {false, p.k_dim <= 64 ? 32 : p.v_tile};
  const bool bv64 = p.k_dim > 64 && p.v_dim > 32 && count * p.heads * ((p.v_dim + 63) / 64) >= 2LL * sms;
  return {false, bv64 ? 64 : 32};
}

template <typename T, int KP, int BV, int NW, bool kBackward>
cudaError_t launch_level(const ChunkStatePassTcParams& p, int64_t begin, int64_t count, cudaStream_t stream) {
  using G = Cfg<KP, BV, NW>;
  auto kernel = [] {  // only the direction's kernel is instantiated
    if constexpr (kBackward) return tc_backward_kernel<T, KP, BV, NW>;
    else return tc_forward_kernel<T, KP, BV, NW>;
  }();
  const size_t bytes = sizeof(T) * (kBackward ? G::bwd_elems : G::fwd_elems);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>((p.v_dim + BV - 1) / BV));
  kernel<<<grid, G::THREADS, bytes, stream>>>(p, begin);
  return cudaGetLastError();
}

template <typename T, bool kBackward>
const char* run_levels(const ChunkStatePassTcParams& p, cudaStream_t stream) {
  int device = 0, sms = 132, optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    sms = 132;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) optin = 0;
  const bool k64 = p.k_dim <= 64;
  // The wide kernel's two stages only where they fit the device's opt-in shared memory (57-140 KB;
  // H100 / H200 / A100 yes).
  const size_t wide_bytes = sizeof(T) * (kBackward ? (k64 ? Cfg<64, 32, 8>::bwd_elems : Cfg<128, 32, 8>::bwd_elems)
                                                   : (k64 ? Cfg<64, 32, 8>::fwd_elems : Cfg<128, 32, 8>::fwd_elems));
  const bool wide_fits = wide_bytes <= static_cast<size_t>(optin);
  if (p.wide == 1 && !wide_fits)
    return fail(std::string(kBackward ? "chunk_state_pass_tc_backward" : "chunk_state_pass_tc_forward") +
                ": the wide kernel (wide 1) needs " + std::to_string(wide_bytes) +
                " bytes of shared memory per block, the device allows " + std::to_string(optin));
  for (int64_t step = 0; step < p.num_levels; ++step) {
    const int64_t level = kBackward ? p.num_levels - 1 - step : step;
    const int64_t begin = p.level_offsets[level], count = p.level_offsets[level + 1] - begin;
    if (count == 0) continue;
    if (count > 0x7fffffffLL) return fail("chunk_state_pass_tc: more than 2^31-1 segments in one level");
    const LevelPlan plan = plan_level(p, count, sms, wide_fits);
    cudaError_t err;
    if (plan.wide) err = k64 ? launch_level<T, 64, 32, 8, kBackward>(p, begin, count, stream)
                             : launch_level<T, 128, 32, 8, kBackward>(p, begin, count, stream);
    else if (k64) err = launch_level<T, 64, 32, 4, kBackward>(p, begin, count, stream);  // (KP 64, BV 64 spilled)
    else err = plan.bv == 64 ? launch_level<T, 128, 64, 4, kBackward>(p, begin, count, stream)
                             : launch_level<T, 128, 32, 4, kBackward>(p, begin, count, stream);
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
