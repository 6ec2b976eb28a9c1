// Device helpers of prep_fwd.cu and out_fwd.cu (CUDA only, no ATen): the tile grid, the gathered
// and the contiguous row copies (cp.async), the in-place l2norm of the rows (8-element packs), the
// chunk-local cumsum of g and the per-row scalar loads, the launchers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::gdn::fused::kernels {

namespace mm = tree_recurrence::kernels::mma;

using mm::pack8;  // mma.cuh's: 8 floats -> 8 consecutive elements of T (one 16-byte word)

// 8 elements of T packed in a 16-byte word held in registers -> 8 floats, by bit operations on the
// words (the same values as Elem<T>::to_float: bf16 -> f32 is the 16-bit shift, exact; half ->
// f32 through __half2float, exact).
template <typename T>
__device__ __forceinline__ void unpack8_reg(const uint4 raw, float (&f)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
}
// 8 consecutive elements at p (16-byte aligned, shared or global) -> 8 floats: one 16-byte load
// into registers (one LDS.128 on a shared row; mma.cuh's unpack8 takes a reference, which compiles
// to eight 16-bit loads there).
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&f)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  unpack8_reg<T>(raw, f);
}

// The (chunk, value head) tiles' grid, value head fastest (blockIdx.x = hv; chunk = tile_chunk()):
// the blocks resident at once cover every head of a few consecutive chunks, so they read the
// gathered token rows (T, H, D) as whole contiguous rows, the value heads of one key head read its
// q / k rows at the same time (the second read hits L2), and the chunk-major tiles (NC, HV, ..) are
// written in sequence. Chunks past 65535 go to blockIdx.z; a block with tile_chunk() >= NC returns.
inline dim3 tile_grid(int64_t num_chunks, int heads) {
  const int64_t y = num_chunks < 65535 ? num_chunks : 65535;
  return dim3(static_cast<unsigned>(heads), static_cast<unsigned>(y), static_cast<unsigned>((num_chunks + 65534) / 65535));
}
__device__ __forceinline__ int64_t tile_chunk() { return static_cast<int64_t>(blockIdx.z) * 65535 + blockIdx.y; }

// The dynamic shared memory of prep_fwd_kernel and out_fwd_kernel (each views it as its layout).
extern __shared__ __align__(16) unsigned char smem_raw[];

// A block's tile numbers, index arithmetic only (the kernels keep their own shared-memory views and
// their early return `if (tile_chunk() >= p.num_chunks) return;` before this): chunk c = tile_chunk(),
// value head hv = blockIdx.x, its key head hk = hv / groups (groups = HV / HK), HV, HK, K, V from the
// parameter block (PrepParams, OutParams).
struct TileIds {
  int64_t c;
  int hv, HV, HK, groups, hk, K, V;
};
template <typename Params>
__device__ __forceinline__ TileIds tile_ids(const Params& p) {
  const int hv = blockIdx.x;
  const int HV = p.value_heads, HK = p.key_heads, groups = HV / HK;
  return {tile_chunk(), hv, HV, HK, groups, hv / groups, p.k_dim, p.v_dim};
}

// The chunk's gathered rows, as NT threads copy them: thread tid copies columns 8 (tid % 16).. of
// rows tid / 16 + n NT / 16 (n < kPer). load() reads those rows' token ids from the plan's gather
// row (global) into registers, so the row copies need no shared-memory table and no barrier first.
template <int NT>
struct ChunkRows {
  static constexpr int kPer = kChunk * (kMaxDim / 8) / NT;
  int64_t tok[kPer];

  __device__ __forceinline__ void load(const int64_t* __restrict__ gather_row) {
#pragma unroll
    for (int n = 0; n < kPer; ++n) tok[n] = gather_row[(threadIdx.x >> 4) + n * (NT / 16)];
  }
  // cp.async copies of the rows of head `head` of x (T, H, D) into sX (64 x ld, columns 0..127
  // written: zeros past D and for pad rows, token < 0), 16 bytes each; the caller commits and waits.
  template <typename T>
  __device__ __forceinline__ void copy(T* sX, int ld, const T* __restrict__ x, int H, int head, int D) const {
    const int c8 = threadIdx.x & 15;
#pragma unroll
    for (int n = 0; n < kPer; ++n) {
      const int row = (threadIdx.x >> 4) + n * (NT / 16);
      const bool ok = tok[n] >= 0 && c8 * 8 < D;
      const T* src = ok ? x + (tok[n] * H + head) * static_cast<int64_t>(D) + c8 * 8 : x;
      mm::cp_async_16(sX + row * ld + c8 * 8, src, ok ? 16 : 0);
    }
  }
};

// cp.async copies of rows r0..r0 + nrows - 1 of the row-major tile src (rows x D) into dst (pitch
// ld, columns 0..127 written: zeros past D and for rows >= rows), 16 bytes each, by the block's
// NT threads; the caller commits and waits.
template <int NT, typename T>
__device__ __forceinline__ void cp_tile_async(T* dst, int ld, const T* __restrict__ src, int r0, int nrows, int rows, int D) {
  for (int i = threadIdx.x; i < nrows * (kMaxDim / 8); i += NT) {
    const int r = i >> 4, c8 = i & 15;
    const bool ok = r0 + r < rows && c8 * 8 < D;
    const T* from = ok ? src + static_cast<int64_t>(r0 + r) * D + c8 * 8 : src;
    mm::cp_async_16(dst + r * ld + c8 * 8, from, ok ? 16 : 0);
  }
}

// In place on rows already in shared memory (ChunkRows::copy): each row times its factor (prep_fwd
// and out_fwd compute q^, k^ with this one function, so bit for bit alike): half a warp per row,
// with `norms` the factor is rsqrt(sum x^2 + 1e-6) * mult (else mult); the norm factor is written
// to norm_out[token * HK + hk] when norm_out is set. With write_back false the rows are only read
// (for the norms). NWARPS = blockDim.x / 32.
template <typename T, int NWARPS>
__device__ __forceinline__ void scale_rows_smem(T* sX, int ld, const int64_t* sTok, int HK, int hk, bool norms, float mult,
                                                float* __restrict__ norm_out, bool write_back) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, hl = lane & 15;
#pragma unroll
  for (int r0 = warp * 2; r0 < kChunk; r0 += NWARPS * 2) {
    const int row = r0 + (lane >> 4);
    const int64_t tok = sTok[row];
    float f[8];
    load8<T>(sX + row * ld + hl * 8, f);
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

// acc (16 x 64, 8 tiles of 8 columns) = X[rows 16 rb..] Y^T on the column blocks np <= rb (the
// blocks at or left of the diagonal one; the others stay 0), X and Y 64 x 16 kb16 in shared memory
// (pitch ld): q^ k^T (out_fwd) and k^ k^T (prep_fwd), tensor cores, fp32 acc, k blocks in order.
template <typename T>
__device__ __forceinline__ void lower_nt(mm::FragC (&acc)[8], const T* X, const T* Y, int ld, int rb, int kb16) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) acc[nt].zero();
  for (int kt = 0; kt < kb16; ++kt) {
    const mm::FragA a = mm::load_a_row(X + rb * 16 * ld + kt * 16, ld);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (np <= rb) {
        mm::FragB b0, b1;
        mm::load_b_nk(b0, b1, Y + np * 16 * ld + kt * 16, ld);
        mm::mma<T>(acc[2 * np], a, b0);
        mm::mma<T>(acc[2 * np + 1], a, b1);
      }
    }
  }
}

__device__ __forceinline__ float exp_nonpos(float x) { return expf(fminf(x, 0.f)); }

// Thread 0: G = cumsum(g) over the chunk (sequential from registers: G is non-increasing exactly
// for g <= 0), from graw into G (may be the same buffer); returns decay = exp(G_63).
__device__ __forceinline__ float chunk_cumsum(const float* graw, float* G) {
  float gr[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; i += 4) {
    const float4 g4 = *reinterpret_cast<const float4*>(graw + i);
    gr[i] = g4.x;
    gr[i + 1] = g4.y;
    gr[i + 2] = g4.z;
    gr[i + 3] = g4.w;
  }
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    acc += gr[i];
    gr[i] = acc;
  }
#pragma unroll
  for (int i = 0; i < kChunk; i += 4) *reinterpret_cast<float4*>(G + i) = make_float4(gr[i], gr[i + 1], gr[i + 2], gr[i + 3]);
  return exp_nonpos(acc);
}

// Element i of a per-row scalar input (g, beta) of type t, widened to fp32 (exact).
__device__ __forceinline__ float row_scalar(const void* x, tree_recurrence::kernels::DType t, int64_t i) {
  using tree_recurrence::kernels::DType;
  if (t == DType::BFloat16) return __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
  if (t == DType::Float16) return __half2float(static_cast<const __half*>(x)[i]);
  return static_cast<const float*>(x)[i];
}

inline const char* launch_error(cudaError_t e) { return e == cudaSuccess ? "" : cudaGetErrorString(e); }

// Launches kernel(p) over tile_grid(p.num_chunks, p.value_heads) with `threads` threads and `smem`
// bytes of dynamic shared memory (the largest carveout asked for: several blocks per SM need it).
template <typename Params>
inline const char* launch_tiles(void (*kernel)(Params), int threads, int smem, const Params& p, cudaStream_t stream) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  kernel<<<tile_grid(p.num_chunks, p.value_heads), threads, smem, stream>>>(p);
  return launch_error(cudaGetLastError());
}

// A stage's entry (launch_prep_fwd, launch_out_fwd): checks the dims and the grid limits of p, then
// launch_tiles of the bf16 or the fp16 instance of the kernel (by p.in), nothing when there are no
// chunks; "" or why not (the caller names the stage).
template <typename Params>
inline const char* launch_checked(void (*bf16)(Params), void (*fp16)(Params), int threads, int smem, const Params& p,
                                  void* cuda_stream) {
  if (p.k_dim < 8 || p.k_dim > kMaxDim || p.k_dim % 8 || p.v_dim < 8 || p.v_dim > kMaxDim || p.v_dim % 8)
    return "gdn fused forward: K and V must be multiples of 8 in 8..128";
  if (p.num_chunks > 0x7fffffffLL || p.value_heads > 65535 || p.key_heads <= 0 || p.value_heads % p.key_heads)
    return "gdn fused forward: chunks must be < 2^31, value heads <= 65535 and a multiple of key heads";
  if (p.num_chunks == 0) return "";
  return launch_tiles(p.in == InType::BFloat16 ? bf16 : fp16, threads, smem, p, static_cast<cudaStream_t>(cuda_stream));
}

}  // namespace tree_recurrence::gdn::fused::kernels
