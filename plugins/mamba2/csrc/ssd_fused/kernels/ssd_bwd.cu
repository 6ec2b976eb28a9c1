// Fused SSD (Mamba2) backward on fp32 CUDA cores (params_bwd.h has the layouts, ssd_fused.h the math,
// tests/python/ssd_bwd_reference.py the same stages in float64): the CudaCore route (chunk 128 / 256, P / N beyond
// the tensor-core plan), one thread per output element or row, inputs widened on load from fp32 / bf16 / fp16;
// and the kernels every route shares: the gate (dy, dz), the reverse tree state pass (fp32 ds, or the 16-bit ds of
// the Half route by the ring kernel) and the ddecay sum. Every sum runs in a fixed order (no atomics), so two runs
// give identical bits. 64-bit indexing throughout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "bwd_tiles.cuh"
#include "params_bwd.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {

using bwd_tiles::exp_le0;
using bwd_tiles::ld;

inline unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

constexpr int kThreads = 256;

// ---- stage 1: the gate ---------------------------------------------------------------------
__global__ void gate_kernel(BwdParams p) {
  const int64_t n = p.tokens * p.heads * p.head_dim;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = ld(p.dout, p.dout_type, i);
  if (p.z == nullptr) {
    p.dy[i] = g;
    return;
  }
  const float z = ld(p.z, p.z_type, i);
  const float sg = 1.f / (1.f + expf(-z));
  p.dy[i] = g * z * sg;
  p.dz[i] = g * ld(p.y, p.y_type, i) * sg * (1.f + z * (1.f - sg));
}

// ---- per chunk, lower-triangle pair dot products ------------------------------------------------
// out[c, y, i, j] = sum_k a(row_i + k) b(row_j + k) for j <= i (0 above the diagonal or at a pad token), one
// thread per element of (NC, Y, L, L); row_i / row_j = ((token of i / j) Y + y) D: the rows of width D of the
// per-token (Y, D) tensors behind the accessors a, b (y: the group or the head)
template <typename A, typename B>
__device__ __forceinline__ void lower_pair_dots(const BwdParams& p, int64_t Y, int64_t D, float* out, A a, B b) {
  const int64_t L = p.chunk;
  const int64_t n_all = p.num_chunks * Y * L * L;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n_all) return;
  const int64_t j = e % L, i = (e / L) % L, y = (e / (L * L)) % Y, c = e / (L * L * Y);
  float acc = 0.f;
  const int64_t ti = p.gather[c * L + i], tj = p.gather[c * L + j];
  if (j <= i && ti >= 0 && tj >= 0) {
    const int64_t ri = (ti * Y + y) * D, rj = (tj * Y + y) * D;
    for (int64_t k = 0; k < D; ++k) acc += a(ri + k) * b(rj + k);
  }
  out[e] = acc;
}

// C B^T per chunk and group
__global__ void cb_kernel(BwdParams p) {
  lower_pair_dots(p, p.groups, p.state_dim, p.cb, [&](int64_t k) { return ld(p.C, p.bc_type, k); },
                  [&](int64_t k) { return ld(p.B, p.bc_type, k); });
}

// <dy_i, x_j> per chunk and head
__global__ void dyx_kernel(BwdParams p) {
  lower_pair_dots(p, p.heads, p.head_dim, p.dyx, [&](int64_t k) { return p.dy[k]; },
                  [&](int64_t k) { return ld(p.x, p.x_type, k); });
}

// ---- local entering-state gradient: sum_i exp(Lam_i) dy_i^T C_i (P x N) -------------------------
__global__ void local_kernel(BwdParams p) {
  const int64_t L = p.chunk, H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const int64_t n_all = p.num_chunks * H * P * N;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n_all) return;
  const int64_t n = e % N, pp = (e / N) % P, h = (e / (N * P)) % H, c = e / (N * P * H);
  const int64_t g = h / (H / G);
  const float* lam = p.Lam + (c * H + h) * L;
  float acc = 0.f;
  for (int64_t i = 0; i < L; ++i) {
    const int64_t t = p.gather[c * L + i];
    if (t < 0) continue;
    acc += expf(lam[i]) * p.dy[(t * H + h) * P + pp] * ld(p.C, p.bc_type, (t * G + g) * N + n);
  }
  p.ds[e] = acc;
}

// ---- reverse tree state pass (one level) ------------------------------------------------------
// ds holds local[c] on entry and ds_leave[c] on exit; a segment's last chunk starts from the sum of
// its children's entering gradients (ws, in children order), a leaf from zero:
//   ds_leave[c] = carry;  carry = exp(Lam_last[c]) carry + local[c]   (c from the last chunk down)
// Elementwise over the P N elements of a (segment, head): grid (level segments x H, ceil(PN / (V
// 256))), V consecutive elements per thread (V = 4: 16-byte loads / stores, coalesced across the
// warp; V = 1 when P N % 4 != 0 or a buffer is not 16-byte aligned). The loads of kAhead chunks
// (and their decays) are issued before the first of their updates, and the children's indices
// before their gradients, so each thread keeps kAhead x 16 bytes in flight instead of one
// dependent 4-byte load per chunk (children summed in children order from 0, then one fma per chunk).
constexpr int kAhead = 4;  // chunks loaded ahead of their updates
constexpr int kKids = 4;   // children's gradients loaded together

template <int V>
__device__ __forceinline__ void ld_vec(const float* src, float (&v)[V]) {
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(src);
    v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = src[i];
  }
}
template <int V>
__device__ __forceinline__ void st_vec(float* dst, const float (&v)[V]) {
  if constexpr (V == 4) {
    __stwb(reinterpret_cast<float4*>(dst), make_float4(v[0], v[1], v[2], v[3]));  // one 16-byte store
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = v[i];
  }
}

// states (in-type) widened: V consecutive elements (V = 4: one 8-byte load for 16-bit types, 16 for fp32)
template <int V>
__device__ __forceinline__ void ld_states(const void* base, BwdType t, int64_t i, float (&v)[V]) {
  if constexpr (V == 4) {
    if (t == BwdType::Float32) {
      ld_vec<4>(static_cast<const float*>(base) + i, v);
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
      float2 a, b;
      if (t == BwdType::BFloat16) {
        a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
        b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
      } else {
        a = __half22float2(*reinterpret_cast<const __half2*>(&w.x));
        b = __half22float2(*reinterpret_cast<const __half2*>(&w.y));
      }
      v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = ld(base, t, i + k);
  }
}
// the state gradient's element type DsT: float (p.ds) or the 16-bit input type (p.ds16); 16-bit values are
// widened exactly on load and rounded once (RN, mma.cuh's Elem: the post kernel's own rounding) on store
template <typename DsT>
__device__ __forceinline__ DsT* ds_base(const BwdParams& p) {
  if constexpr (std::is_same_v<DsT, float>)
    return p.ds;
  else
    return static_cast<DsT*>(p.ds16);
}
template <int V, typename DsT>
__device__ __forceinline__ void ld_ds(const DsT* src, float (&v)[V]) {
  if constexpr (std::is_same_v<DsT, float>) {
    ld_vec<V>(src, v);
  } else if constexpr (V == 4) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);  // one 8-byte load
    const DsT* e = reinterpret_cast<const DsT*>(&w);
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = tree_recurrence::kernels::mma::Elem<DsT>::to_float(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = tree_recurrence::kernels::mma::Elem<DsT>::to_float(src[i]);
  }
}
template <int V, typename DsT>
__device__ __forceinline__ void st_ds(DsT* dst, const float (&v)[V]) {
  namespace mm = tree_recurrence::kernels::mma;
  if constexpr (std::is_same_v<DsT, float>) {
    st_vec<V>(dst, v);
  } else if constexpr (V == 4) {
    __stwb(reinterpret_cast<uint2*>(dst), make_uint2(mm::Elem<DsT>::pack(v[0], v[1]), mm::Elem<DsT>::pack(v[2], v[3])));
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = mm::Elem<DsT>::from_float(v[i]);
  }
}
__device__ __forceinline__ float warp_sum(float v) {  // xor butterfly: fixed order, every lane the sum
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
constexpr int kWarpsPerBlock = kThreads / 32;

// the gradient entering a segment's last chunk: its children's entering gradients (ws) summed in children order from
// 0 (kKids loaded together), V elements from el of head h; zeros for a leaf or a thread past P N (on false)
template <int V>
__device__ __forceinline__ void children_carry(const BwdParams& p, bool on, int64_t q0, int64_t q1, int64_t H, int64_t h,
                                               int64_t PN, int64_t el, float (&carry)[V]) {
#pragma unroll
  for (int i = 0; i < V; ++i) carry[i] = 0.f;
  if (!on) return;
  for (int64_t q = q0; q < q1; q += kKids) {
    int64_t kid[kKids];
#pragma unroll
    for (int j = 0; j < kKids; ++j) kid[j] = q + j < q1 ? p.children[q + j] : 0;
    float w[kKids][V];
#pragma unroll
    for (int j = 0; j < kKids; ++j)
      if (q + j < q1) ld_vec<V>(p.ws + (kid[j] * H + h) * PN + el, w[j]);
#pragma unroll
    for (int j = 0; j < kKids; ++j)
      if (q + j < q1) {
#pragma unroll
        for (int i = 0; i < V; ++i) carry[i] += w[j][i];
      }
  }
}

// Folded ddecay (p.ddecay_part set): per chunk, each warp's partial of <s[c], ds_leave[c]> over its
// 32 V elements (fma in element order, then the xor butterfly) is written to
// ddecay_part[(c H + h) parts + blockIdx.y warps + warp]; ssd_bwd_ddecay_finish sums them in order.
// Lanes past PN then stay (with zeros) for the shuffles instead of returning.
// Instantiated for the fp32 ds (the TensorCore and CudaCore routes); the 16-bit ds of the Half route takes
// state_pass_ring_kernel, the same element mapping and arithmetic.
template <int V, typename DsT>
__global__ void __launch_bounds__(kThreads) state_pass_kernel(BwdParams p, int64_t begin) {
  const int64_t H = p.heads, PN = p.head_dim * p.state_dim, L = p.chunk;
  const unsigned bx = blockIdx.x, hu = static_cast<unsigned>(H);
  const int64_t k = bx / hu, h = bx % hu;
  const int64_t el = (static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x) * V;
  const bool fold = p.ddecay_part != nullptr;
  const bool on = el < PN;  // PN % V == 0: a thread's V elements are all in or all out
  if (!on && !fold) return;
  const int64_t s = p.level_segments[begin + k];
  const int64_t q0 = p.child_offsets[s], q1 = p.child_offsets[s + 1];
  const int64_t c0 = p.seg_chunk_offsets[s], c1 = p.seg_chunk_offsets[s + 1];
  const int64_t r = p.root_index[s];

  float carry[V];
  children_carry<V>(p, on, q0, q1, H, h, PN, el, carry);

  const int64_t cstride = H * PN, lstride = H * L;
  DsT* ds = ds_base<DsT>(p) + h * PN + el;     // + c * cstride: element el of (c, h)
  const float* lam = p.Lam + h * L + (L - 1);   // + c * lstride: Lam_last of (c, h)
  const int64_t sel = h * PN + el;              // + c * cstride: the state element
  const int64_t slot = static_cast<int64_t>(blockIdx.y) * kWarpsPerBlock + (threadIdx.x >> 5);
  for (int64_t c = c1 - 1; c >= c0; c -= kAhead) {
    float loc[kAhead][V], dec[kAhead], sv[kAhead][V];
#pragma unroll
    for (int u = 0; u < kAhead; ++u)
      if (c - u >= c0) {
        if (on) {
          ld_ds<V, DsT>(ds + (c - u) * cstride, loc[u]);
          if (fold) ld_states<V>(p.states, p.states_type, sel + (c - u) * cstride, sv[u]);
        }
        dec[u] = lam[(c - u) * lstride];
      }
#pragma unroll
    for (int u = 0; u < kAhead; ++u)
      if (c - u >= c0) {
        if (fold) {
          float part = 0.f;
          if (on) {
#pragma unroll
            for (int i = 0; i < V; ++i) part = fmaf(sv[u][i], carry[i], part);
          }
          part = warp_sum(part);
          if ((threadIdx.x & 31) == 0) p.ddecay_part[((c - u) * H + h) * p.ddecay_parts + slot] = part;
        }
        if (on) {
          st_ds<V, DsT>(ds + (c - u) * cstride, carry);
          const float d = expf(dec[u]);
#pragma unroll
          for (int i = 0; i < V; ++i) carry[i] = fmaf(d, carry[i], loc[u][i]);
        }
      }
  }
  if (!on) return;
  st_vec<V>(p.ws + (s * H + h) * PN + el, carry);
  if (r >= 0 && p.droots != nullptr) st_vec<V>(p.droots + (r * H + h) * PN + el, carry);
}

// The 16-bit state pass with the folded ddecay (the Half route's two-kernel reverse pass: long segments, e.g. one
// flat row) with its loads deepened: each thread streams its 4 elements of ds_local and of s (8 bytes each) and its
// warp's Lam_last (lane 0, 4 bytes) through a ring of kRing chunks in shared memory by cp.async, every slot read only
// by the thread that filled it (no block barrier), so kRing - 1 chunks of loads stay in flight through each chunk's
// arithmetic and stores (kAhead chunks in registers, waiting for them all each kAhead chunks, leaves the pass
// latency-bound). ds_local ds_leave rounded to DsT (RN), the carry, ws, d_roots and the ddecay partials in fp32;
// the element mapping, the fmaf chain and the per-warp partials are state_pass_kernel<4>'s.
// A slot is refilled only after the chunk read from it was consumed by the arithmetic (the reads completed: the
// refill follows in program order, after the values' uses).
constexpr int kRing = 8;
template <typename DsT>
__global__ void __launch_bounds__(kThreads, 6) state_pass_ring_kernel(BwdParams p, int64_t begin) {
  namespace mm = tree_recurrence::kernels::mma;
  __shared__ __align__(16) uint2 ring_ds[kRing][kThreads];
  __shared__ __align__(16) uint2 ring_s[kRing][kThreads];
  __shared__ float ring_lam[kRing][kWarpsPerBlock];
  const int64_t H = p.heads, PN = p.head_dim * p.state_dim, L = p.chunk;
  const unsigned bx = blockIdx.x, hu = static_cast<unsigned>(H);
  const int64_t k = bx / hu, h = bx % hu;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int64_t el = (static_cast<int64_t>(blockIdx.y) * kThreads + tid) * 4;
  const bool on = el < PN;  // (every lane stays for the shuffles)
  const int64_t s = p.level_segments[begin + k];
  const int64_t c0 = p.seg_chunk_offsets[s], c1 = p.seg_chunk_offsets[s + 1], n = c1 - c0;
  const int64_t r = p.root_index[s];

  float carry[4];
  children_carry<4>(p, on, p.child_offsets[s], p.child_offsets[s + 1], H, h, PN, el, carry);

  const int64_t cstride = H * PN, lstride = H * L;
  DsT* ds = static_cast<DsT*>(p.ds16) + h * PN + el;                          // + c * cstride
  const DsT* st = static_cast<const DsT*>(p.states) + h * PN + el;            // + c * cstride
  const float* lam = p.Lam + h * L + (L - 1);                                  // + c * lstride
  const int64_t slot = static_cast<int64_t>(blockIdx.y) * kWarpsPerBlock + warp;
  // chunk j from the segment's end (c = c1 - 1 - j) into stage j % kRing; one commit group per chunk (empty past n)
  const auto issue = [&](int64_t j) {
    if (j < n) {
      const int64_t c = c1 - 1 - j;
      const int stg = static_cast<int>(j % kRing);
      if (on) {
        mm::cp_async_ca<8>(&ring_ds[stg][tid], ds + c * cstride);
        mm::cp_async_ca<8>(&ring_s[stg][tid], st + c * cstride);
      }
      if (lane == 0) mm::cp_async_ca<4>(&ring_lam[stg][warp], lam + c * lstride);
    }
    mm::cp_async_commit();
  };
#pragma unroll
  for (int j = 0; j < kRing; ++j) issue(j);
  for (int64_t j = 0; j < n; ++j) {
    mm::cp_async_wait<kRing - 1>();  // groups 0..j complete: chunk j landed
    const int64_t c = c1 - 1 - j;
    const int stg = static_cast<int>(j % kRing);
    float loc[4] = {0.f, 0.f, 0.f, 0.f}, sv[4] = {0.f, 0.f, 0.f, 0.f};
    if (on) {
      const uint2 wd = ring_ds[stg][tid], ws2 = ring_s[stg][tid];
      const DsT* ed = reinterpret_cast<const DsT*>(&wd);
      const DsT* es = reinterpret_cast<const DsT*>(&ws2);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        loc[i] = mm::Elem<DsT>::to_float(ed[i]);
        sv[i] = mm::Elem<DsT>::to_float(es[i]);
      }
    }
    const float dec = __shfl_sync(0xffffffffu, lane == 0 ? ring_lam[stg][warp] : 0.f, 0);
    float part = 0.f;
    if (on) {
#pragma unroll
      for (int i = 0; i < 4; ++i) part = fmaf(sv[i], carry[i], part);
    }
    part = warp_sum(part);
    if (lane == 0) p.ddecay_part[(c * H + h) * p.ddecay_parts + slot] = part;
    if (on) {
      st_ds<4, DsT>(ds + c * cstride, carry);
      const float d = expf(dec);
#pragma unroll
      for (int i = 0; i < 4; ++i) carry[i] = fmaf(d, carry[i], loc[i]);
    }
    asm volatile("" ::: "memory");  // (the slot's shared loads stay before the refill: cp.async has no memory clobber)
    issue(j + kRing);  // into the stage just consumed
  }
  mm::cp_async_wait<0>();
  if (!on) return;
  st_vec<4>(p.ws + (s * H + h) * PN + el, carry);
  if (r >= 0 && p.droots != nullptr) st_vec<4>(p.droots + (r * H + h) * PN + el, carry);
}

// ---- folded ddecay: warp per (c, h), its partials summed lane-strided then by the butterfly -------
__global__ void __launch_bounds__(kThreads) ddecay_finish_kernel(BwdParams p) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (w >= p.num_chunks * p.heads) return;  // whole warps
  const int lane = static_cast<int>(threadIdx.x & 31);
  const float* part = p.ddecay_part + w * p.ddecay_parts;
  float acc = 0.f;
  for (int64_t j = lane; j < p.ddecay_parts; j += 32) acc += part[j];
  acc = warp_sum(acc);
  if (lane == 0) p.ddecay[w] = acc;
}

// ---- rows: per (c, h, j) the P-vector g_j, dx_j, ddt_direct_j, Q_j, V_j -----------------------
//   g_jp = sum_{i>=j} cb_ij exp(Lam_i - Lam_j) dy_ip + exp(Lam_last - Lam_j) (dS B_j)_p
//   dx_j = dt_j g_j + D dy_j, ddt_direct_j = <x_j, g_j>, Q_j = exp(Lam_j) <dy_j, C_j s^T>,
//   V_j = dt_j exp(Lam_last - Lam_j) <x_j, dS B_j>
__global__ void rows_kernel(BwdParams p) {
  const int64_t L = p.chunk, H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const int64_t n_all = p.num_chunks * H * L;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n_all) return;
  const int64_t j = e % L, h = (e / L) % H, c = e / (L * H);
  const int64_t g = h / (H / G);
  const int64_t tj = p.gather[c * L + j];
  const int64_t chl = (c * H + h) * L;
  if (tj < 0) {
    p.ddt_direct[e] = 0.f;
    p.q[e] = 0.f;
    p.v[e] = 0.f;
    return;
  }
  const float* lam = p.Lam + chl;
  const float lam_j = lam[j], dt_j = p.dt[chl + j];
  const float wlast = exp_le0(lam[L - 1] - lam_j);
  const float* cb = p.cb + ((c * G + g) * L) * L;
  const float* dS = p.ds + (c * H + h) * P * N;
  const int64_t sbase = (c * H + h) * P * N;
  const int64_t bj = (tj * G + g) * N;
  float ddt_direct = 0.f, q = 0.f, v = 0.f;
  for (int64_t pp = 0; pp < P; ++pp) {
    float intra = 0.f;
    for (int64_t i = j; i < L; ++i) {
      const int64_t ti = p.gather[c * L + i];
      if (ti < 0) continue;
      intra += cb[i * L + j] * exp_le0(lam[i] - lam_j) * p.dy[(ti * H + h) * P + pp];
    }
    float dsb = 0.f, cs = 0.f;
    for (int64_t n = 0; n < N; ++n) {
      dsb += dS[pp * N + n] * ld(p.B, p.bc_type, bj + n);
      cs += ld(p.C, p.bc_type, bj + n) * ld(p.states, p.states_type, sbase + pp * N + n);
    }
    const int64_t tok = (tj * H + h) * P + pp;
    const float x = ld(p.x, p.x_type, tok), dy = p.dy[tok];
    const float gv = intra + wlast * dsb;
    p.dx[tok] = dt_j * gv + (p.D != nullptr ? p.D[h * P + pp] * dy : 0.f);
    ddt_direct += x * gv;
    q += dy * cs;
    v += x * dsb;
  }
  p.ddt_direct[e] = ddt_direct;
  p.q[e] = expf(lam_j) * q;
  p.v[e] = dt_j * wlast * v;
}

// ---- dB, dC per (c, g, r, n), the group's heads summed in order -------------------------------
//   dC_r += exp(Lam_r) (dy_r s)_n + sum_{j<=r} dCB_rj B_jn
//   dB_r += sum_{i>=r} dCB_ir C_in + exp(Lam_last - Lam_r) dt_r (x_r dS)_n
//   dCB_ij = exp(Lam_i - Lam_j) dt_j dyx_ij
__global__ void dbdc_kernel(BwdParams p) {
  const int64_t L = p.chunk, H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups, hpg = H / G;
  const int64_t n_all = p.num_chunks * G * L * N;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n_all) return;
  const int64_t n = e % N, r = (e / N) % L, g = (e / (N * L)) % G, c = e / (N * L * G);
  const int64_t tr = p.gather[c * L + r];
  if (tr < 0) return;
  float dC = 0.f, dB = 0.f;
  for (int64_t hh = 0; hh < hpg; ++hh) {
    const int64_t h = g * hpg + hh;
    const int64_t chl = (c * H + h) * L;
    const float* lam = p.Lam + chl;
    const float* dt = p.dt + chl;
    const float* dyx = p.dyx + chl * L;
    const int64_t sbase = (c * H + h) * P * N;
    float a = 0.f, b = 0.f;
    for (int64_t pp = 0; pp < P; ++pp) {
      const int64_t tok = (tr * H + h) * P + pp;
      a += p.dy[tok] * ld(p.states, p.states_type, sbase + pp * N + n);
      b += ld(p.x, p.x_type, tok) * p.ds[sbase + pp * N + n];
    }
    float cpart = expf(lam[r]) * a, bpart = exp_le0(lam[L - 1] - lam[r]) * dt[r] * b;
    for (int64_t j = 0; j <= r; ++j) {
      const int64_t tj = p.gather[c * L + j];
      if (tj < 0) continue;
      cpart += exp_le0(lam[r] - lam[j]) * dt[j] * dyx[r * L + j] * ld(p.B, p.bc_type, (tj * G + g) * N + n);
    }
    for (int64_t i = r; i < L; ++i) {
      const int64_t ti = p.gather[c * L + i];
      if (ti < 0) continue;
      bpart += exp_le0(lam[i] - lam[r]) * dt[r] * dyx[i * L + r] * ld(p.C, p.bc_type, (ti * G + g) * N + n);
    }
    dC += cpart;
    dB += bpart;
  }
  p.dC[(tr * G + g) * N + n] = dC;
  p.dB[(tr * G + g) * N + n] = dB;
}

// ---- d(dt A), ddt, ddt_raw, dA partials: block per (c, h), thread per row (L <= 256) --------------
//   W_ij = cb_ij exp(Lam_i - Lam_j) dt_j dyx_ij (j <= i); row-exclusive prefixes in place in dyx:
//   Wex_ik = sum_{j<k} W_ij; d_dtA_k = sum_{i>=k} Wex_ik + sum_{m>=k} Q_m + sum_{j<k} V_j + exp(Lam_last) ddecay
__global__ void dtA_kernel(BwdParams p) {
  __shared__ float qs[kBwdMaxChunk], vs[kBwdMaxChunk], red[kBwdMaxChunk];
  const int64_t L = p.chunk, H = p.heads, G = p.groups;
  const int64_t ch = blockIdx.x, c = ch / H, h = ch % H, g = h / (H / G);
  const int64_t chl = ch * L;
  const int k = threadIdx.x;
  const float* lam = p.Lam + chl;
  const float* dt = p.dt + chl;
  const float* cb = p.cb + ((c * G + g) * L) * L;
  float* row = p.dyx + chl * L;
  if (k < L) {
    // row k of W, prefix in place
    float run = 0.f;
    const float lk = lam[k];
    for (int64_t j = 0; j < L; ++j) {
      const float w = j <= k ? cb[k * L + j] * exp_le0(lk - lam[j]) * dt[j] * row[k * L + j] : 0.f;
      row[k * L + j] = run;
      run += w;
    }
    qs[k] = p.q[chl + k];
    vs[k] = p.v[chl + k];
  }
  __syncthreads();
  float d = 0.f;
  if (k < L) {
    for (int64_t i = k; i < L; ++i) d += row[i * L + k];
    float qsum = 0.f, vsum = 0.f;
    for (int64_t m = L - 1; m >= k; --m) qsum += qs[m];
    for (int64_t j = 0; j < k; ++j) vsum += vs[j];
    d += qsum + vsum + expf(lam[L - 1]) * p.ddecay[ch];
    p.d_dtA[chl + k] = d;
    const float dtk = dt[k];
    red[k] = dtk * d;
    const int64_t t = p.gather[c * L + k];
    if (t >= 0) {
      const float ddt = p.ddt_direct[chl + k] + p.A[h] * d;
      p.ddt[t * H + h] = ddt;
      float v = p.dt_raw[t * H + h] + (p.dt_bias != nullptr ? p.dt_bias[h] : 0.f);
      float deriv = 1.f, pre = v;
      if (p.dt_softplus) {
        if (v <= 20.f) {
          pre = fmaxf(v, 0.f) + log1pf(expf(-fabsf(v)));
          deriv = 1.f / (1.f + expf(-v));
        }
      }
      const bool pass = pre >= p.dt_min && pre <= p.dt_max;
      p.ddt_raw[t * H + h] = pass ? ddt * deriv : 0.f;
    }
  } else {
    red[k] = 0.f;
  }
  __syncthreads();
  // fixed-order reduction over blockDim.x (a power of two >= L)
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (k < w) red[k] += red[k + w];
    __syncthreads();
  }
  if (k == 0) p.dA_part[ch] = red[0];
}

int launched() { return static_cast<int>(cudaGetLastError()); }

}  // namespace

int ssd_bwd_gate(const BwdParams& p, void* stream) {
  const int64_t n = p.tokens * p.heads * p.head_dim;
  if (n == 0) return 0;
  gate_kernel<<<blocks_for(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launched();
}
int ssd_bwd_cb(const BwdParams& p, void* stream) {
  const int64_t n = p.num_chunks * p.groups * p.chunk * p.chunk;
  if (n == 0) return 0;
  cb_kernel<<<blocks_for(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launched();
}
int ssd_bwd_dyx(const BwdParams& p, void* stream) {
  const int64_t n = p.num_chunks * p.heads * p.chunk * p.chunk;
  if (n == 0) return 0;
  dyx_kernel<<<blocks_for(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launched();
}
int ssd_bwd_local(const BwdParams& p, void* stream) {
  if (p.ds16 != nullptr) return static_cast<int>(cudaErrorInvalidValue);  // reads the fp32 ds
  const int64_t n = p.num_chunks * p.heads * p.head_dim * p.state_dim;
  if (n == 0) return 0;
  local_kernel<<<blocks_for(n, kThreads), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launched();
}
// V = 4 (16-byte) variant when PN % 4 == 0 and the buffers (states included: the folded ddecay reads
// them) are 16-byte aligned, else V = 1
static bool state_pass_vec(const BwdParams& p) {
  const auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const int64_t PN = p.head_dim * p.state_dim;
  return PN % 4 == 0 && aligned(p.ds16 != nullptr ? p.ds16 : static_cast<const void*>(p.ds)) && aligned(p.ws) &&
         (p.droots == nullptr || aligned(p.droots)) && aligned(p.states);
}
static int64_t state_pass_blocks_y(const BwdParams& p) {
  const int V = state_pass_vec(p) ? 4 : 1;
  return (p.head_dim * p.state_dim / V + kThreads - 1) / kThreads;
}
int ssd_bwd_state_pass(const BwdParams& p, int64_t begin, int64_t count, void* stream) {
  const int64_t PN = p.head_dim * p.state_dim;
  if (count * p.heads * PN == 0) return 0;
  const bool vec = state_pass_vec(p);
  const int64_t ys = state_pass_blocks_y(p), xs = count * p.heads;
  if (xs > 0x7fffffffLL || ys > 65535 || p.heads > 0xffffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  if (p.ddecay_part != nullptr && p.ddecay_parts != ys * kWarpsPerBlock) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(xs), static_cast<unsigned>(ys));
  const auto st = static_cast<cudaStream_t>(stream);
  if (p.ds16 != nullptr) {
    // the 16-bit ds (the Half route): the ring kernel, which needs 16-byte-aligned buffers, the folded ddecay and
    // states in ds's type (the plan's checks and fresh workspaces guarantee them)
    if (!vec || p.ddecay_part == nullptr || p.states_type != p.ds16_type) return static_cast<int>(cudaErrorInvalidValue);
    if (p.ds16_type == BwdType::BFloat16)
      state_pass_ring_kernel<__nv_bfloat16><<<grid, kThreads, 0, st>>>(p, begin);
    else if (p.ds16_type == BwdType::Float16)
      state_pass_ring_kernel<__half><<<grid, kThreads, 0, st>>>(p, begin);
    else
      return static_cast<int>(cudaErrorInvalidValue);
    return launched();
  }
  if (vec)
    state_pass_kernel<4, float><<<grid, kThreads, 0, st>>>(p, begin);
  else
    state_pass_kernel<1, float><<<grid, kThreads, 0, st>>>(p, begin);
  return launched();
}
// the pointers the V choice looks at must be set before this is asked (ds, ws, droots, states)
int64_t ssd_bwd_ddecay_parts(const BwdParams& p) { return state_pass_blocks_y(p) * kWarpsPerBlock; }
int ssd_bwd_ddecay_finish(const BwdParams& p, void* stream) {
  const int64_t n = p.num_chunks * p.heads;
  if (n == 0) return 0;
  if (p.ddecay_part == nullptr || p.ddecay_parts < 1) return static_cast<int>(cudaErrorInvalidValue);
  ddecay_finish_kernel<<<blocks_for(n, kWarpsPerBlock), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launched();
}
int ssd_bwd_rows(const BwdParams& p, void* stream) {
  if (p.ds16 != nullptr) return static_cast<int>(cudaErrorInvalidValue);  // reads the fp32 ds
  const int64_t n = p.num_chunks * p.heads * p.chunk;
  if (n == 0) return 0;
  rows_kernel<<<blocks_for(n, 128), 128, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launched();
}
int ssd_bwd_dbdc(const BwdParams& p, void* stream) {
  if (p.ds16 != nullptr) return static_cast<int>(cudaErrorInvalidValue);  // reads the fp32 ds
  const int64_t n = p.num_chunks * p.groups * p.chunk * p.state_dim;
  if (n == 0) return 0;
  dbdc_kernel<<<blocks_for(n, 128), 128, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launched();
}
int ssd_bwd_dtA(const BwdParams& p, void* stream) {
  const int64_t n = p.num_chunks * p.heads;
  if (n == 0) return 0;
  if (p.chunk > kBwdMaxChunk) return static_cast<int>(cudaErrorInvalidValue);
  int threads = 32;
  while (threads < p.chunk) threads <<= 1;
  dtA_kernel<<<static_cast<unsigned>(n), threads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launched();
}
const char* ssd_bwd_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace tree_recurrence::ssd::fused::kernels
