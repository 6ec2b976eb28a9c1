// Device helpers shared by prep_fwd.cu and out_fwd.cu (CUDA only, no ATen).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::gdn::fused::kernels {

namespace mm = tree_recurrence::kernels::mma;

// 8 consecutive elements of type T (one 16-byte word) <-> 8 floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = mm::Elem<T>::to_float(e[i]);
}
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 r;
  r.x = mm::Elem<T>::pack(f[0], f[1]);
  r.y = mm::Elem<T>::pack(f[2], f[3]);
  r.z = mm::Elem<T>::pack(f[4], f[5]);
  r.w = mm::Elem<T>::pack(f[6], f[7]);
  return r;
}

// Loads the chunk's q (or k) rows of key head hk into shared memory sX (64 x ld, columns 0..127
// written: zeros past K and for pad rows), each row times its factor. Half a warp per row (16
// lanes x 8 elements = 128 >= K), 16-byte loads. With `norms` the factor is
// rsqrt(sum x^2 + 1e-6) * mult (else mult); the norm factor (1 without `norms`) is written to
// norm_out[token * HK + hk] when norm_out is set.
template <typename T>
__device__ __forceinline__ void load_rows_scaled(T* sX, int ld, const T* __restrict__ x, const int64_t* sTok, int HK, int hk,
                                                 int K, bool norms, float mult,
                                                 float* __restrict__ norm_out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, hl = lane & 15;
  const int nwarps = blockDim.x >> 5;
  for (int r0 = warp * 2; r0 < kChunk; r0 += nwarps * 2) {
    const int row = r0 + (lane >> 4);
    const int64_t tok = sTok[row];
    float f[8];
    const bool in_row = tok >= 0 && hl * 8 < K;
    if (in_row) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + (tok * HK + hk) * static_cast<int64_t>(K) + hl * 8);
      unpack8<T>(raw, f);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = 0.f;
    }
    float r = 1.f;
    if (norms) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
#pragma unroll
      for (int off = 8; off >= 1; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      r = rsqrtf(ss + 1e-6f);
    }
    if (norm_out != nullptr && hl == 0 && tok >= 0) norm_out[tok * HK + hk] = r;
    const float factor = r * mult;
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] *= factor;
    *reinterpret_cast<uint4*>(sX + row * ld + hl * 8) = pack8<T>(f);
  }
}

// Issues cp.async copies of the chunk's rows of head `head` of x (T, H, D) into sX (64 x ld,
// columns 0..127 written: zeros past D and for pad rows, sTok[row] < 0), 16 bytes per copy; the
// caller commits and waits. Every thread of the block takes part.
template <typename T>
__device__ __forceinline__ void cp_rows_async(T* sX, int ld, const T* __restrict__ x, const int64_t* sTok, int H, int head,
                                              int D) {
  for (int i = threadIdx.x; i < kChunk * (kMaxDim / 8); i += blockDim.x) {
    const int row = i >> 4, c8 = i & 15;
    const int64_t tok = sTok[row];
    const bool ok = tok >= 0 && c8 * 8 < D;
    const T* src = ok ? x + (tok * H + head) * static_cast<int64_t>(D) + c8 * 8 : x;
    mm::cp_async_16(sX + row * ld + c8 * 8, src, ok ? 16 : 0);
  }
}

// In place on rows already in shared memory (cp_rows_async): each row times its factor, with the
// same arithmetic as load_rows_scaled (so the results are bit for bit the same): half a warp per
// row, with `norms` the factor is rsqrt(sum x^2 + 1e-6) * mult (else mult); the norm factor is
// written to norm_out[token * HK + hk] when norm_out is set. With write_back false the rows are only
// read (for the norms). NWARPS = blockDim.x / 32.
template <typename T, int NWARPS>
__device__ __forceinline__ void scale_rows_smem(T* sX, int ld, const int64_t* sTok, int HK, int hk, bool norms, float mult,
                                                float* __restrict__ norm_out, bool write_back) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, hl = lane & 15;
#pragma unroll
  for (int r0 = warp * 2; r0 < kChunk; r0 += NWARPS * 2) {
    const int row = r0 + (lane >> 4);
    const int64_t tok = sTok[row];
    float f[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(sX + row * ld + hl * 8), f);
    float r = 1.f;
    if (norms) {
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
#pragma unroll
      for (int off = 8; off >= 1; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      r = rsqrtf(ss + 1e-6f);
    }
    if (norm_out != nullptr && hl == 0 && tok >= 0) norm_out[tok * HK + hk] = r;
    if (write_back) {
      const float factor = r * mult;
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] *= factor;
      *reinterpret_cast<uint4*>(sX + row * ld + hl * 8) = pack8<T>(f);
    }
  }
}

__device__ __forceinline__ float exp_nonpos(float x) { return expf(fminf(x, 0.f)); }

inline const char* launch_error(cudaError_t e) { return e == cudaSuccess ? "" : cudaGetErrorString(e); }

}  // namespace tree_recurrence::gdn::fused::kernels
