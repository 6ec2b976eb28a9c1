// Device helpers shared by the fused GDN backward kernels (*_bwd.cu): shared-memory tile loads
// with zero padding, a warp's 16x16 output tile on tensor cores, deterministic row dots.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "params_bwd.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::gdn::fused::kernels::bwd {

namespace mma = tree_recurrence::kernels::mma;
using mma::FragC;

constexpr int C = kBwdChunk;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kPitchC = C + 8;  // pitch of a C x C in-type tile

// (b) and (c): 16 warps per CTA, one 16 x 16 tile of a C x C product per warp.
constexpr int kTileWarps = (C / 16) * (C / 16);
constexpr int kTileThreads = kTileWarps * 32;

__host__ __device__ inline int round16(int x) { return (x + 15) / 16 * 16; }
__host__ __device__ inline int pitch_of(int padded) { return padded + 8; }

// Bump allocator over dynamic shared memory (16-byte aligned pieces).
struct Smem {
  char* base;
  size_t used = 0;
  template <typename U>
  __device__ U* take(size_t count) {
    U* p = reinterpret_cast<U*>(base + used);
    used += (count * sizeof(U) + 15) / 16 * 16;
    return p;
  }
};
template <typename U>
__host__ inline size_t smem_bytes(size_t count) {
  return (count * sizeof(U) + 15) / 16 * 16;
}

// rows x Dp tile (pitch ld) from token rows: row r is src[(tok(r) * heads + head) * D ...], times
// row_scale(tok) when SCALED, zero for tok < 0 and for columns D..Dp-1. D a multiple of 8.
template <typename T, bool SCALED>
__device__ inline void load_token_rows(T* dst, int ld, const T* src, const int64_t* tok_of_row, int64_t heads, int64_t head,
                                       int D, int Dp, const float* row_scale, int64_t scale_heads, int64_t scale_head,
                                       float extra_scale) {
  const int per_row = Dp / 8;
  for (int idx = threadIdx.x; idx < C * per_row; idx += blockDim.x) {
    const int r = idx / per_row, c8 = (idx % per_row) * 8;
    const int64_t t = tok_of_row[r];
    uint4 val = make_uint4(0, 0, 0, 0);
    if (t >= 0 && c8 < D) {
      val = *reinterpret_cast<const uint4*>(src + (t * heads + head) * static_cast<int64_t>(D) + c8);
      if (SCALED) {
        const float s = row_scale[t * scale_heads + scale_head] * extra_scale;
        T* e = reinterpret_cast<T*>(&val);
#pragma unroll
        for (int m = 0; m < 8; ++m) e[m] = mma::Elem<T>::from_float(mma::Elem<T>::to_float(e[m]) * s);
      }
    }
    *reinterpret_cast<uint4*>(dst + r * ld + c8) = val;
  }
}

// rows x Dp tile (pitch ld) from a contiguous rows x D matrix; columns D..Dp-1 and rows past
// `rows` up to `rows_p` zero.
template <typename T>
__device__ inline void load_matrix(T* dst, int ld, const T* src, int rows, int rows_p, int D, int Dp) {
  const int per_row = Dp / 8;
  for (int idx = threadIdx.x; idx < rows_p * per_row; idx += blockDim.x) {
    const int r = idx / per_row, c8 = (idx % per_row) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (r < rows && c8 < D) val = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * D + c8);
    *reinterpret_cast<uint4*>(dst + r * ld + c8) = val;
  }
}

// Asynchronous (cp.async, 16 bytes per copy, all in flight at once) versions of the two loaders:
// the caller commits / waits (mma::cp_async_commit, cp_async_wait<N>) and __syncthreads() before
// reading. Zero rows / columns are zero-filled by the copy itself (src_bytes 0). The token-row
// scaling of load_token_rows<T, true> is a separate pass (scale_rows) after the wait, with the same
// rounding (from_float(to_float(x) * s)).
template <typename T>
__device__ inline void async_token_rows(T* dst, int ld, const T* src, const int64_t* tok_of_row, int64_t heads,
                                        int64_t head, int D, int Dp) {
  const int per_row = Dp / 8;
  for (int idx = threadIdx.x; idx < C * per_row; idx += blockDim.x) {
    const int r = idx / per_row, c8 = (idx % per_row) * 8;
    const int64_t t = tok_of_row[r];
    const bool ok = t >= 0 && c8 < D;
    const T* g = ok ? src + (t * heads + head) * static_cast<int64_t>(D) + c8 : src;
    mma::cp_async_16(dst + r * ld + c8, g, ok ? 16 : 0);
  }
}
template <typename T>
__device__ inline void async_matrix(T* dst, int ld, const T* src, int rows, int rows_p, int D, int Dp) {
  const int per_row = Dp / 8;
  for (int idx = threadIdx.x; idx < rows_p * per_row; idx += blockDim.x) {
    const int r = idx / per_row, c8 = (idx % per_row) * 8;
    const bool ok = r < rows && c8 < D;
    const T* g = ok ? src + static_cast<int64_t>(r) * D + c8 : src;
    mma::cp_async_16(dst + r * ld + c8, g, ok ? 16 : 0);
  }
}
// Row r of a C x Dp tile times row_scale[r] (in place, 8 elements per step).
template <typename T>
__device__ inline void scale_rows(T* dst, int ld, int Dp, const float* row_scale) {
  const int per_row = Dp / 8;
  for (int idx = threadIdx.x; idx < C * per_row; idx += blockDim.x) {
    const int r = idx / per_row, c8 = (idx % per_row) * 8;
    uint4 val = *reinterpret_cast<const uint4*>(dst + r * ld + c8);
    const float s = row_scale[r];
    T* e = reinterpret_cast<T*>(&val);
#pragma unroll
    for (int m = 0; m < 8; ++m) e[m] = mma::Elem<T>::from_float(mma::Elem<T>::to_float(e[m]) * s);
    *reinterpret_cast<uint4*>(dst + r * ld + c8) = val;
  }
}

// Per-row tables of chunk c (ch = c * HV + hv): G, the rows' tokens, rq * scale and rk of the rows'
// tokens (0 for padding rows). Ends with a __syncthreads (the tables are complete after it).
__device__ __forceinline__ void row_tables(const GdnBwdParams& p, int64_t c, int64_t ch, int64_t hk, float* G, int64_t* tok,
                                           float* rqs, float* rks) {
  const int64_t HK = p.hk;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    G[i] = p.G[ch * C + i];
    const int64_t t = p.gather[c * C + i];
    tok[i] = t;
    rqs[i] = t >= 0 ? p.rq[t * HK + hk] * p.scale : 0.f;
    rks[i] = t >= 0 ? p.rk[t * HK + hk] * 1.f : 0.f;
  }
  __syncthreads();
}
// Thread 0: *lastRow = the chunk's last row holding a token (C - 1 when none); tok complete.
__device__ __forceinline__ void last_token_row(const int64_t* tok, int* lastRow) {
  if (threadIdx.x == 0) {
    int L = C - 1;
    for (int i = C - 1; i >= 0; --i)
      if (tok[i] >= 0) {
        L = i;
        break;
      }
    *lastRow = L;
  }
}

// acc (one 16 x 16 output tile at (r0, c0), as two 16x8 blocks) += A(r0.., :) B(:, c0..) over
// `ksteps` steps of 16. A_ROW: A(r, k) at A[r * lda + k], else at A[k * lda + r]. B_KN: B(k, n) at
// B[k * ldb + n], else at B[n * ldb + k].
template <typename T, bool A_ROW, bool B_KN>
__device__ __forceinline__ void tile_mma(FragC (&acc)[1][2], const T* A, int lda, const T* B, int ldb, int r0, int c0,
                                         int ksteps) {
  for (int kt = 0; kt < ksteps; ++kt) {
    const T* a = A_ROW ? A + r0 * lda + kt * 16 : A + kt * 16 * lda + r0;
    const T* b = B_KN ? B + kt * 16 * ldb + c0 : B + c0 * ldb + kt * 16;
    mma::warp_gemm<T, 1, 2, 1, A_ROW, B_KN>(acc, a, lda, b, ldb);
  }
}

__device__ __forceinline__ void zero(FragC (&acc)[1][2]) {
  acc[0][0].zero();
  acc[0][1].zero();
}
// A warp's share of a grid of 16 x 16 tiles (cols16 tile columns, ntiles tiles): tiles
// t = warp + n * WARPS for n < PER (unrolled), f(n, r0, c0) on each t < ntiles at (r0, c0).
template <int PER, int WARPS, typename F>
__device__ __forceinline__ void for_warp_tiles(int warp, int ntiles, int cols16, F&& f) {
#pragma unroll
  for (int n = 0; n < PER; ++n) {
    const int t = warp + n * WARPS;
    if (t < ntiles) f(n, (t / cols16) * 16, (t % cols16) * 16);
  }
}

// Coordinates of element (nt, e) of a tile at (r0, c0) held by this lane.
__device__ __forceinline__ int el_row(int r0, int e) { return r0 + mma::c_row(mma::lane_id(), e); }
__device__ __forceinline__ int el_col(int c0, int nt, int e) { return c0 + nt * 8 + mma::c_col(mma::lane_id(), e); }

// Row dot of one tile: the lane's two rows' partial sums (index 0: row g, 1: row g + 8) reduced
// over the quad (fixed butterfly) and written by lane t == 0 to part[row * 8 + c0 / 16].
__device__ __forceinline__ void tile_rowdot_store(float s0, float s1, float* part, int r0, int c0) {
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  const int l = mma::lane_id();
  if ((l & 3) == 0) {
    part[(r0 + (l >> 2)) * 8 + c0 / 16] = s0;
    part[(r0 + (l >> 2) + 8) * 8 + c0 / 16] = s1;
  }
}
// Sum of a row's parts over its column tiles, in order.
__device__ __forceinline__ float row_parts(const float* part, int r, int ntiles) {
  float s = 0.f;
  for (int t = 0; t < ntiles; ++t) s += part[r * 8 + t];
  return s;
}

// Block sum of one float per thread, fixed order (a butterfly inside each warp, then thread 0 adds
// the warps' sums in order); result for all threads. red: NT / 32 + 1 floats at least.
template <int NT = kThreads>
__device__ inline float block_sum(float x, float* red) {
  constexpr int NW = NT / 32;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < NW; ++i) s += red[i];
    red[NW] = s;
  }
  __syncthreads();
  const float s = red[NW];
  __syncthreads();
  return s;
}

inline const char* launch_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? "" : cudaGetErrorString(e);
}

// kernel<<<grid, threads, bytes, stream>>>(p) with `bytes` of dynamic shared memory allowed and the
// largest shared-memory carveout preferred; "" or the CUDA error string (no host sync).
inline const char* launch_cta(void (*kernel)(GdnBwdParams), dim3 grid, int threads, size_t bytes, const GdnBwdParams& p,
                              void* stream) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           static_cast<int>(cudaSharedmemCarveoutMaxShared));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  kernel<<<grid, threads, bytes, static_cast<cudaStream_t>(stream)>>>(p);
  return launch_error();
}
// launch_cta of the bf16 or the fp16 instance of a kernel (by p.in) over `grid`, by default the
// (NC, HV) grid of the per-(chunk, value head) kernels; nothing when there are no chunks.
inline const char* launch_chunks(void (*bf16)(GdnBwdParams), void (*fp16)(GdnBwdParams), int threads, size_t bytes,
                                 const GdnBwdParams& p, void* stream, dim3 grid) {
  if (p.num_chunks == 0) return "";
  return launch_cta(p.in == BwdDType::BFloat16 ? bf16 : fp16, grid, threads, bytes, p, stream);
}
inline const char* launch_chunks(void (*bf16)(GdnBwdParams), void (*fp16)(GdnBwdParams), int threads, size_t bytes,
                                 const GdnBwdParams& p, void* stream) {
  return launch_chunks(bf16, fp16, threads, bytes, p, stream,
                       dim3(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.hv)));
}

}  // namespace tree_recurrence::gdn::fused::kernels::bwd
