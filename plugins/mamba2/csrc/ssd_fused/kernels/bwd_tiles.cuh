// Device pieces shared by the fused SSD backward's post-state-pass kernels, post_tc (ssd_tc_bwd.cu, fp32
// operands split into bf16 hi + lo) and post_bf16 (ssd_post_bwd.cu, 16-bit operands): the quad sums and
// stores of the ddt_direct / v partials, the row-exclusive prefixes of W and the per-head row tail (q, v,
// ddt_direct, the d(dt A) scan, ddt, ddt_raw, the dA partial; its layout, row stores and ddt_raw step are shared with
// post_bf16's warp-0 tail, head_rows_warp). One definition, so both kernels do the same
// arithmetic in the same order; the 16-bit pair unpack (unpack2) of the 16-bit backward kernels; the typed load
// (ld) and e^min(v, 0) (exp_le0) of the fp32 kernels (ssd_bwd.cu) and the tensor-core ones (ssd_tc_bwd.cu).
// CUDA only; include from .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "params_bwd.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels::bwd_tiles {

constexpr int kChunk = 64;  // the chunk of both post kernels

// two packed 16-bit elements of T (the lower one first) -> fp32
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);
template <>
__device__ __forceinline__ float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
template <>
__device__ __forceinline__ float2 unpack2<__half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// v rounded up to a multiple of m (host and device: the kernels' shared-memory plans)
__host__ __device__ constexpr int ceil_to(int64_t v, int m) { return static_cast<int>((v + m - 1) / m * m); }

// the 16-bit types of the tensor-core backward kernels
inline bool half_type(BwdType t) { return t == BwdType::BFloat16 || t == BwdType::Float16; }

// 2 elements of a dy row scaled by sc (= e^Lam_i), from packed pairs of dout (g) and z: sc g z sigmoid(z) (the
// gate kernel's formula; sc g without z), rounded once to T and packed. The dy rows of local_bf16
// (ssd_local_bwd.cu) and of the fused reverse pass (ssd_state_pass_bwd.cu): one definition, so both round the
// same values. (Per pair: a helper over the whole 16-byte piece moves the callers' LDSM / HMMA schedule.)
template <typename T, bool HAS_Z>
__device__ __forceinline__ uint32_t scaled_dy2(uint32_t g, uint32_t z, float sc) {
  float2 d = unpack2<T>(g);
  if constexpr (HAS_Z) {
    const float2 zf = unpack2<T>(z);
    const float s0 = 1.f / (1.f + expf(-zf.x)), s1 = 1.f / (1.f + expf(-zf.y));
    d.x = d.x * zf.x * s0;
    d.y = d.y * zf.y * s1;
  }
  return tree_recurrence::kernels::mma::Elem<T>::pack(sc * d.x, sc * d.y);
}

// a, b, c, d summed over the 4 lanes of a quad (xor 1, then 2; the four interleaved, in that order)
__device__ __forceinline__ void quad_sum4(float& a, float& b, float& c, float& d) {
#pragma unroll
  for (int m = 1; m <= 2; m <<= 1) {
    a += __shfl_xor_sync(0xffffffffu, a, m);
    b += __shfl_xor_sync(0xffffffffu, b, m);
    c += __shfl_xor_sync(0xffffffffu, c, m);
    d += __shfl_xor_sync(0xffffffffu, d, m);
  }
}
// a summed over the 4 lanes of a quad
__device__ __forceinline__ void quad_sum(float& a) {
  a += __shfl_xor_sync(0xffffffffu, a, 1);
  a += __shfl_xor_sync(0xffffffffu, a, 2);
}

// the ddt_direct (d0 / d1) and v (v0 / v1) partials of accumulator rows row0 / row1 (c_row 0 / 8 of this
// lane), quad-summed, stored by the quad's first lane (tq == 0) into dpart / vpart (this column tile's slice)
__device__ __forceinline__ void store_dv_partials(float d0, float d1, float v0, float v1, float* dpart, float* vpart,
                                                  int row0, int row1, int tq) {
  quad_sum4(d0, d1, v0, v1);
  if (tq == 0) {
    dpart[row0] = d0;
    dpart[row1] = d1;
    vpart[row0] = v0;
    vpart[row1] = v1;
  }
}

// element i of a buffer of type t (fp32 / bf16 / fp16), widened to fp32
__device__ __forceinline__ float ld(const void* p, BwdType t, int64_t i) {
  switch (t) {
    case BwdType::BFloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case BwdType::Float16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
// e^min(v, 0): the decay factors (v = Lam_i - Lam_j <= 0 inside a chunk; clamped against rounding)
__device__ __forceinline__ float exp_le0(float v) { return expf(fminf(v, 0.f)); }

// the row-exclusive prefixes of w[0 .. n) in place
__device__ __forceinline__ void row_exclusive_prefix(float* w, int n) {
  float run = 0.f;
  for (int j = 0; j < n; ++j) {
    const float v = w[j];
    w[j] = run;
    run += v;
  }
}

// head_rows's small arrays after lam (kChunk floats each, in this order): dts, el (e^Lam), wl (e^{Lam_last - Lam}),
// qs, vs, red; the layout of head_rows, head_rows_warp (ssd_post_bwd.cu) and store_row_qvd in one place
struct RowSmall {
  float* dts;
  float* el;
  float* wl;
  float* qs;
  float* vs;
  float* red;
};
__device__ __forceinline__ RowSmall row_small(float* small) {
  constexpr int L = kChunk;
  return {small + L, small + 2 * L, small + 3 * L, small + 4 * L, small + 5 * L, small + 6 * L};
}

// Row k's q, v and ddt_direct from its sums q, v, d over the column-tile partials: q e^Lam_k into qs[k] and p.q,
// v dt_k e^{Lam_last - Lam_k} into vs[k] and p.v, d into p.ddt_direct. small: head_rows's layout. The first step's
// end in head_rows and in post_bf16's head_rows_warp (ssd_post_bwd.cu): one definition. (The sums stay in the
// callers: declared there, in each caller's order, the register assignment and so the code of both is unchanged.)
__device__ __forceinline__ void store_row_qvd(const BwdParams& p, int k, float* small, int64_t chl, float q, float v,
                                              float d) {
  const auto [dts, el, wl, qs, vs, red] = row_small(small);
  q *= el[k];
  v *= dts[k] * wl[k];
  qs[k] = q;
  vs[k] = v;
  if (p.q != nullptr) {  // stage outputs (null on the bf16 post path outside the stage op: nothing reads them)
    p.q[chl + k] = q;
    p.v[chl + k] = v;
    p.ddt_direct[chl + k] = d;
  }
}

// ddt_raw's value at a token from its ddt and the pre-activation v = dt_raw + dt_bias: ddt softplus'(v) (softplus
// where p.dt_softplus and v <= 20, else the identity), 0 where dt = softplus(v) falls outside [dt_min, dt_max].
// head_rows's and head_rows_warp's (ssd_post_bwd.cu): one definition.
__device__ __forceinline__ float ddt_raw_of(const BwdParams& p, float ddt, float v) {
  float deriv = 1.f, pre = v;
  if (p.dt_softplus && v <= 20.f) {
    pre = fmaxf(v, 0.f) + log1pf(expf(-fabsf(v)));
    deriv = 1.f / (1.f + expf(-v));
  }
  const bool pass = pre >= p.dt_min && pre <= p.dt_max;
  return pass ? ddt * deriv : 0.f;
}

// The per-head row tail, after the barrier that publishes the partials and W's prefixes (LDW: W's pitch):
// q, v, ddt_direct per row from the column-tile partials (qpart / dpart / vpart, [col tile][row], ncolP
// tiles), the d(dt A) scan (d_dtA), ddt, ddt_raw at the rows' tokens (tok: -1 = pad) and dA_part[ch].
// small: lam, dts, el (e^Lam), wl (e^{Lam_last - Lam}), qs, vs, red (kChunk floats each, in that order).
// Two block barriers inside; ends before the barrier that frees the head's shared memory (the caller's).
template <int LDW, typename Tok>
__device__ __forceinline__ void head_rows(const BwdParams& p, int tid, float* small, const float* qpart,
                                          const float* dpart, const float* vpart, int ncolP, const float* Wm,
                                          const Tok* tok, int64_t ch, int64_t H, int64_t h) {
  constexpr int L = kChunk;
  const auto [dts, el, wl, qs, vs, red] = row_small(small);
  const int64_t chl = ch * L;
  float dpairs = 0.f, dd = 0.f;
  if (tid < L) {
    const int k = tid;
    float q = 0.f, v = 0.f;
    for (int ct = 0; ct < ncolP; ++ct) {
      q += qpart[ct * L + k];
      dd += dpart[ct * L + k];
      v += vpart[ct * L + k];
    }
    store_row_qvd(p, k, small, chl, q, v, dd);
    for (int i = k; i < L; ++i) dpairs += Wm[i * LDW + k];
  }
  __syncthreads();
  if (tid < L) {
    const int k = tid;
    float qsum = 0.f, vsum = 0.f;
    for (int m = L - 1; m >= k; --m) qsum += qs[m];
    for (int j = 0; j < k; ++j) vsum += vs[j];
    const float d = dpairs + qsum + vsum + el[L - 1] * p.ddecay[ch];
    if (p.d_dtA != nullptr) p.d_dtA[chl + k] = d;
    red[k] = dts[k] * d;
    const Tok t = tok[k];
    if (t >= 0) {
      const int64_t th = static_cast<int64_t>(t) * H + h;
      const float ddt = dd + p.A[h] * d;
      p.ddt[th] = ddt;
      p.ddt_raw[th] = ddt_raw_of(p, ddt, p.dt_raw[th] + (p.dt_bias != nullptr ? p.dt_bias[h] : 0.f));
    }
  }
  __syncthreads();
  if (tid == 0) {
    float s = 0.f;
    for (int k = 0; k < L; ++k) s += red[k];
    p.dA_part[ch] = s;
  }
}

}  // namespace tree_recurrence::ssd::fused::kernels::bwd_tiles
