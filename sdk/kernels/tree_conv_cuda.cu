#include "tree_recurrence/kernels/tree_conv.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace tree_recurrence::kernels {
namespace {

// A warp spans 32 consecutive channels of one token, so every row access is coalesced and the
// token's ancestor row is a broadcast; 8 warps take 8 tokens at a time.
constexpr int kChannelsPerBlock = 32;
constexpr int kTokenLanes = 8;
constexpr int64_t kMaxGridY = 65535;
// Weight-gradient chunking: enough blocks to fill the GPU, but chunks long enough that the
// second (reduction) pass stays negligible. Depends on N and C only, so results do not depend
// on the device.
constexpr int64_t kTargetBlocks = 2048;
constexpr int64_t kMinChunkTokens = 512;

template <typename T>
struct TypeTag {
  using type = T;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

template <typename T, int W>
__device__ __forceinline__ float load_weights(const TreeConvParams& p, int64_t c, float (&w)[W]) {
  const T* weight = static_cast<const T*>(p.weight) + c * W;
#pragma unroll
  for (int k = 0; k < W; ++k) w[k] = to_float(weight[k]);
  return p.bias ? to_float(static_cast<const T*>(p.bias)[c]) : 0.f;
}

// Tap k of token t, oldest first; tap W-1 is t itself and missing ancestors read as zero.
template <typename T, int W>
__device__ __forceinline__ void load_taps(const TreeConvParams& p, int64_t t, int64_t c,
                                          float (&taps)[W]) {
  const T* x = static_cast<const T*>(p.x);
  taps[W - 1] = to_float(x[t * p.channels + c]);
#pragma unroll
  for (int k = 0; k < W - 1; ++k) {
    const int64_t src = p.ancestors[t * (W - 1) + (W - 2 - k)];
    taps[k] = src >= 0 ? to_float(x[src * p.channels + c]) : 0.f;
  }
}

// Bias first, then taps oldest to newest: the order causal_conv1d accumulates in.
template <int W>
__device__ __forceinline__ float dot_taps(float bias, const float (&w)[W], const float (&taps)[W]) {
  float acc = bias;
#pragma unroll
  for (int k = 0; k < W; ++k) acc += w[k] * taps[k];
  return acc;
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

__device__ __forceinline__ float silu_grad(float v) {
  const float s = 1.f / (1.f + expf(-v));
  return s * (1.f + v * (1.f - s));
}

// dLoss/d(pre-activation) of token t; taps must be t's taps (only read with SiLU).
template <typename T, int W>
__device__ __forceinline__ float grad_pre(const TreeConvParams& p, int64_t t, int64_t c,
                                          float bias, const float (&w)[W],
                                          const float (&taps)[W]) {
  const float g = to_float(static_cast<const T*>(p.grad_y)[t * p.channels + c]);
  return p.silu ? g * silu_grad(dot_taps<W>(bias, w, taps)) : g;
}

template <typename T, int W>
__global__ void __launch_bounds__(kChannelsPerBlock* kTokenLanes)
    forward_kernel(TreeConvParams p) {
  const int64_t c = int64_t(blockIdx.x) * kChannelsPerBlock + threadIdx.x;
  if (c >= p.channels) return;
  float w[W];
  const float bias = load_weights<T, W>(p, c, w);
  T* y = static_cast<T*>(p.y);
  const int64_t stride = int64_t(gridDim.y) * kTokenLanes;
  for (int64_t t = int64_t(blockIdx.y) * kTokenLanes + threadIdx.y; t < p.num_tokens; t += stride) {
    float taps[W];
    load_taps<T, W>(p, t, c, taps);
    float v = dot_taps<W>(bias, w, taps);
    if (p.silu) v = silu(v);
    y[t * p.channels + c] = from_float<T>(v);
  }
}

template <typename T, int W>
__device__ __forceinline__ float grad_pre_at(const TreeConvParams& p, int64_t t, int64_t c,
                                             float bias, const float (&w)[W]) {
  float taps[W] = {};
  if (p.silu) load_taps<T, W>(p, t, c, taps);
  return grad_pre<T, W>(p, t, c, bias, w, taps);
}

// Gather form of grad_x: token u sums what every reader (from the CSR) sends back to it, so
// each output has one writer and a fixed summation order.
template <typename T, int W>
__global__ void __launch_bounds__(kChannelsPerBlock* kTokenLanes)
    grad_x_kernel(TreeConvParams p) {
  const int64_t c = int64_t(blockIdx.x) * kChannelsPerBlock + threadIdx.x;
  if (c >= p.channels) return;
  float w[W];
  const float bias = load_weights<T, W>(p, c, w);
  const T* weight = static_cast<const T*>(p.weight) + c * W;
  T* grad_x = static_cast<T*>(p.grad_x);
  const int64_t stride = int64_t(gridDim.y) * kTokenLanes;
  for (int64_t u = int64_t(blockIdx.y) * kTokenLanes + threadIdx.y; u < p.num_tokens; u += stride) {
    float acc = w[W - 1] * grad_pre_at<T, W>(p, u, c, bias, w);
    if constexpr (W > 1) {
      for (int64_t i = p.reader_offsets[u]; i < p.reader_offsets[u + 1]; ++i) {
        const int64_t r = p.readers[i];
        const int64_t reader = r / (W - 1);
        const int back = int(r - reader * (W - 1)) + 1;
        // Weight from memory (L1-resident): a run-time index into w[] would spill it.
        acc += to_float(weight[W - 1 - back]) * grad_pre_at<T, W>(p, reader, c, bias, w);
      }
    }
    grad_x[u * p.channels + c] = from_float<T>(acc);
  }
}

// Per-channel sums over one token chunk: W weight taps and the bias. Each warp row (token lane)
// sums privately, then lane sums are added in a fixed order through shared memory.
template <typename T, int W>
__global__ void __launch_bounds__(kChannelsPerBlock* kTokenLanes)
    weight_grad_kernel(TreeConvParams p, int64_t tokens_per_chunk, float* partial) {
  __shared__ float lane_sums[kTokenLanes][W + 1][kChannelsPerBlock];
  const int64_t c = int64_t(blockIdx.x) * kChannelsPerBlock + threadIdx.x;
  const bool active = c < p.channels;
  float acc[W + 1] = {};
  if (active) {
    float w[W];
    const float bias = load_weights<T, W>(p, c, w);
    const int64_t begin = int64_t(blockIdx.y) * tokens_per_chunk;
    const int64_t end = min(p.num_tokens, begin + tokens_per_chunk);
    for (int64_t t = begin + threadIdx.y; t < end; t += kTokenLanes) {
      float taps[W];
      load_taps<T, W>(p, t, c, taps);
      const float g = grad_pre<T, W>(p, t, c, bias, w, taps);
#pragma unroll
      for (int k = 0; k < W; ++k) acc[k] += g * taps[k];
      acc[W] += g;
    }
  }
#pragma unroll
  for (int k = 0; k <= W; ++k) lane_sums[threadIdx.y][k][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y != 0 || !active) return;
#pragma unroll
  for (int k = 0; k <= W; ++k) {
    float s = 0.f;
    for (int lane = 0; lane < kTokenLanes; ++lane) s += lane_sums[lane][k][threadIdx.x];
    if (partial) partial[(int64_t(blockIdx.y) * p.channels + c) * (W + 1) + k] = s;
    else if (k < W) p.grad_weight[c * W + k] += s;
    else if (p.grad_bias) p.grad_bias[c] += s;
  }
}

// Second pass over the chunk partials, chunk order fixed.
__global__ void reduce_chunks_kernel(const float* partial, int64_t chunks, int64_t channels,
                                     int width, float* grad_weight, float* grad_bias) {
  const int64_t per_chunk = channels * (width + 1);
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= per_chunk) return;
  float s = 0.f;
  for (int64_t chunk = 0; chunk < chunks; ++chunk) s += partial[chunk * per_chunk + i];
  const int64_t c = i / (width + 1), k = i % (width + 1);
  if (k < width) grad_weight[c * width + k] += s;
  else if (grad_bias) grad_bias[c] += s;
}


// ------------------------------------------------------------------------------------------------
// Vectorised kernels (the fast path): each thread owns V = 16 / sizeof(T) consecutive channels and
// moves them with one 16-byte load/store per row; a warp spans 32 V channels of one token (a
// 512-byte contiguous run for bf16), 8 warps take 8 tokens. Needs C % V == 0 and 16-byte aligned
// rows; otherwise the scalar kernels above run. Ancestors' rows are re-read from cache (they are
// the neighbouring tokens other warps just read), so DRAM sees each row once.
// ------------------------------------------------------------------------------------------------

constexpr int kVecThreads = 32;  // vector lanes (channel groups) per block
constexpr int kVecTokenLanes = 8;
// Backward: token chunks per channel-block column, so the fused grad_x + weight-gradient kernel
// fills the GPU (~8 blocks per SM on a 132-SM part); chunks stay >= kMinChunkTokens long.
constexpr int64_t kVecTargetBlocks = 1056;

template <typename T>
struct VecOf {
  static constexpr int V = 16 / int(sizeof(T));
};

// The backward keeps more per-channel state (W+1 sums, reader taps): 8-byte vectors for 16-bit
// types there (V = 4), so it stays out of local memory and two blocks fit an SM.
template <typename T>
struct BwdVecOf {
  static constexpr int V = 4;
};

template <int Bytes>
struct RawVec;
template <>
struct RawVec<16> {
  using type = uint4;
};
template <>
struct RawVec<8> {
  using type = uint2;
};

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* ptr, float (&out)[V]) {
  using Raw = typename RawVec<V * int(sizeof(T))>::type;
  union {
    Raw raw;
    T e[V];
  } u;
  u.raw = __ldg(reinterpret_cast<const Raw*>(ptr));
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(u.e[i]);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* ptr, const float (&in)[V]) {
  using Raw = typename RawVec<V * int(sizeof(T))>::type;
  union {
    Raw raw;
    T e[V];
  } u;
#pragma unroll
  for (int i = 0; i < V; ++i) u.e[i] = from_float<T>(in[i]);
  *reinterpret_cast<Raw*>(ptr) = u.raw;
}

template <typename T, int W, int V>
__device__ __forceinline__ void load_weights_vec(const TreeConvParams& p, int64_t c0, float (&w)[W][V],
                                                 float (&bias)[V]) {
  const T* weight = static_cast<const T*>(p.weight);
#pragma unroll
  for (int i = 0; i < V; ++i) {
#pragma unroll
    for (int k = 0; k < W; ++k) w[k][i] = to_float(weight[(c0 + i) * W + k]);
    bias[i] = p.bias ? to_float(static_cast<const T*>(p.bias)[c0 + i]) : 0.f;
  }
}

// Taps 0..W-2 of token t for channels c0..c0+V-1 (its ancestors' rows, oldest first); a missing
// ancestor reads as zero.
template <typename T, int W, int V>
__device__ __forceinline__ void load_ancestor_taps_vec(const TreeConvParams& p, const T* x, int64_t t, int64_t c0,
                                                       float (&taps)[W][V]) {
#pragma unroll
  for (int k = 0; k < W - 1; ++k) {
    const int64_t src = __ldg(p.ancestors + t * (W - 1) + (W - 2 - k));
    if (src >= 0) {
      load_vec<T, V>(x + src * p.channels + c0, taps[k]);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) taps[k][i] = 0.f;
    }
  }
}

// A vector already loaded (`raw`, V elements of T) as floats.
template <typename T, int V, typename Raw>
__device__ __forceinline__ void unpack_vec(const Raw& raw, float (&out)[V]) {
  union {
    Raw raw;
    T e[V];
  } u;
  u.raw = raw;
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_float(u.e[i]);
}

// Taps of token t for channels c0..c0+V-1, oldest first; missing ancestors read as zero.
template <typename T, int W, int V>
__device__ __forceinline__ void load_taps_vec(const TreeConvParams& p, int64_t t, int64_t c0,
                                              float (&taps)[W][V]) {
  const T* x = static_cast<const T*>(p.x);
  load_vec<T, V>(x + t * p.channels + c0, taps[W - 1]);
  load_ancestor_taps_vec<T, W, V>(p, x, t, c0, taps);
}

template <int W, int V>
__device__ __forceinline__ float dot_vec(const float (&bias)[V], const float (&w)[W][V],
                                         const float (&taps)[W][V], int i) {
  float acc = bias[i];
#pragma unroll
  for (int k = 0; k < W; ++k) acc += w[k][i] * taps[k][i];
  return acc;
}

// Tokens per thread per step of the forward: their own rows (the only DRAM reads; ancestors' rows
// are cache hits) are all loaded before any is used, so 4 x 16 bytes per thread are in flight.
constexpr int kVecForwardTokens = 4;

template <typename T, int W>
__global__ void __launch_bounds__(kVecThreads* kVecTokenLanes) forward_vec_kernel(TreeConvParams p) {
  constexpr int V = VecOf<T>::V;
  constexpr int U = kVecForwardTokens;
  const int64_t c0 = (int64_t(blockIdx.x) * kVecThreads + threadIdx.x) * V;
  if (c0 >= p.channels) return;
  float w[W][V], bias[V];
  load_weights_vec<T, W, V>(p, c0, w, bias);
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int64_t step = int64_t(gridDim.y) * kVecTokenLanes * U;
  for (int64_t first = int64_t(blockIdx.y) * kVecTokenLanes * U + threadIdx.y; first < p.num_tokens; first += step) {
    uint4 own[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t t = first + int64_t(j) * kVecTokenLanes;
      if (t < p.num_tokens) own[j] = __ldg(reinterpret_cast<const uint4*>(x + t * p.channels + c0));
    }
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int64_t t = first + int64_t(j) * kVecTokenLanes;
      if (t >= p.num_tokens) break;
      float taps[W][V], out[V];
      unpack_vec<T, V>(own[j], taps[W - 1]);
      load_ancestor_taps_vec<T, W, V>(p, x, t, c0, taps);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float v = dot_vec<W, V>(bias, w, taps, i);
        out[i] = p.silu ? silu(v) : v;
      }
      store_vec<T, V>(y + t * p.channels + c0, out);
    }
  }
}

// dLoss/d(pre-activation) of token t (its taps loaded when SiLU needs them).
template <typename T, int W, int V>
__device__ __forceinline__ void grad_pre_vec(const TreeConvParams& p, int64_t t, int64_t c0,
                                             const float (&bias)[V], const float (&w)[W][V],
                                             float (&g)[V]) {
  load_vec<T, V>(static_cast<const T*>(p.grad_y) + t * p.channels + c0, g);
  if (!p.silu) return;
  float taps[W][V];
  load_taps_vec<T, W, V>(p, t, c0, taps);
#pragma unroll
  for (int i = 0; i < V; ++i) {
    g[i] *= silu_grad(dot_vec<W, V>(bias, w, taps, i));
  }
}

// Fused backward over one token chunk: grad_x in gather form (token u sums what its readers send
// back, fixed order, one writer) and the chunk's weight/bias sums (fixed-order reduction over the
// token lanes through shared memory, then over chunks by reduce_chunks_kernel).
// The chunk is walked in tiles of 16 tokens (each warp takes 2, their rows loaded before either is
// used); the dLoss/d(pre-activation) of the tile and of the W-1 tokens after it is computed once
// into shared memory, so readers inside a segment (the next W-1 tokens) are read from there; only
// readers elsewhere (first tokens of child segments at a branch) are recomputed.
constexpr int kBwdTokens = 2;

template <typename T, int W>
__global__ void __launch_bounds__(kVecThreads* kVecTokenLanes, 2)
    backward_vec_kernel(TreeConvParams p, int64_t tokens_per_chunk, float* partial) {
  constexpr int V = BwdVecOf<T>::V;
  using Raw = typename RawVec<V * int(sizeof(T))>::type;
  constexpr int kTileTokens = kVecTokenLanes * kBwdTokens;
  constexpr int kTile = kTileTokens + W - 1;
  __shared__ float lane_sums[kVecTokenLanes][kVecThreads * V];
  __shared__ float g_tile[kTile][kVecThreads * V];
  const int64_t c0 = (int64_t(blockIdx.x) * kVecThreads + threadIdx.x) * V;
  const bool active = c0 < p.channels;
  float acc_w[W + 1][V];
#pragma unroll
  for (int k = 0; k <= W; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc_w[k][i] = 0.f;
  float w[W][V], bias[V];
  if (active) load_weights_vec<T, W, V>(p, c0, w, bias);
  const T* x = static_cast<const T*>(p.x);
  T* grad_x = static_cast<T*>(p.grad_x);
  const T* grad_y = static_cast<const T*>(p.grad_y);
  float* my_g = &g_tile[0][threadIdx.x * V];
  const int64_t begin = int64_t(blockIdx.y) * tokens_per_chunk;
  const int64_t end = min(p.num_tokens, begin + tokens_per_chunk);
  for (int64_t base = begin; base < end; base += kTileTokens) {
    // phase 1: g of the tile's tokens (and the weight sums of those inside the chunk)
    if (active) {
      Raw own_x[kBwdTokens], own_g[kBwdTokens];
#pragma unroll
      for (int j = 0; j < kBwdTokens; ++j) {
        const int64_t u = base + j * kVecTokenLanes + threadIdx.y;
        if (u < p.num_tokens) {
          own_x[j] = __ldg(reinterpret_cast<const Raw*>(x + u * p.channels + c0));
          own_g[j] = __ldg(reinterpret_cast<const Raw*>(grad_y + u * p.channels + c0));
        }
      }
#pragma unroll
      for (int j = 0; j < kBwdTokens; ++j) {
        const int64_t u = base + j * kVecTokenLanes + threadIdx.y;
        if (u >= p.num_tokens) break;
        float taps[W][V], g[V];
        unpack_vec<T, V>(own_x[j], taps[W - 1]);
        unpack_vec<T, V>(own_g[j], g);
        load_ancestor_taps_vec<T, W, V>(p, x, u, c0, taps);
        const int slot = j * kVecTokenLanes + threadIdx.y;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          if (p.silu) g[i] *= silu_grad(dot_vec<W, V>(bias, w, taps, i));
          my_g[slot * kVecThreads * V + i] = g[i];
        }
        if (u < end) {
#pragma unroll
          for (int i = 0; i < V; ++i) {
#pragma unroll
            for (int k = 0; k < W; ++k) acc_w[k][i] += g[i] * taps[k][i];
            acc_w[W][i] += g[i];
          }
        }
      }
    }
    // the W-1 tokens after the tile (halo): warps 0..W-2
    if (W > 1 && active && threadIdx.y < W - 1) {
      const int64_t h = base + kTileTokens + threadIdx.y;
      if (h < p.num_tokens) {
        float g[V];
        grad_pre_vec<T, W, V>(p, h, c0, bias, w, g);
#pragma unroll
        for (int i = 0; i < V; ++i) my_g[(kTileTokens + threadIdx.y) * kVecThreads * V + i] = g[i];
      }
    }
    __syncthreads();
    // phase 2: grad_x of the tile's tokens
    if (active) {
#pragma unroll
      for (int j = 0; j < kBwdTokens; ++j) {
        const int64_t u = base + j * kVecTokenLanes + threadIdx.y;
        if (u >= end) break;
        float acc[V];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] = w[W - 1][i] * my_g[(j * kVecTokenLanes + threadIdx.y) * kVecThreads * V + i];
        if constexpr (W > 1) {
          for (int64_t r_i = __ldg(p.reader_offsets + u); r_i < __ldg(p.reader_offsets + u + 1); ++r_i) {
            const int64_t r = __ldg(p.readers + r_i);
            const int64_t reader = r / (W - 1);
            const int back = int(r - reader * (W - 1)) + 1;
            float gr[V];
            const int64_t slot = reader - base;
            if (slot >= 0 && slot < kTile) {
#pragma unroll
              for (int i = 0; i < V; ++i) gr[i] = my_g[slot * kVecThreads * V + i];
            } else {
              grad_pre_vec<T, W, V>(p, reader, c0, bias, w, gr);
            }
#pragma unroll
            for (int k = 0; k < W - 1; ++k) {  // compile-time indices: w stays in registers
              if (k == W - 1 - back) {
#pragma unroll
                for (int i = 0; i < V; ++i) acc[i] += w[k][i] * gr[i];
              }
            }
          }
        }
        store_vec<T, V>(grad_x + u * p.channels + c0, acc);
      }
    }
    __syncthreads();
  }
  // weight/bias sums: lanes (threadIdx.y) reduced in a fixed order, one tap at a time
#pragma unroll
  for (int k = 0; k <= W; ++k) {
#pragma unroll
    for (int i = 0; i < V; ++i) lane_sums[threadIdx.y][threadIdx.x * V + i] = acc_w[k][i];
    __syncthreads();
    if (threadIdx.y == 0 && active) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float s = 0.f;
        for (int lane = 0; lane < kVecTokenLanes; ++lane) s += lane_sums[lane][threadIdx.x * V + i];
        const int64_t c = c0 + i;
        if (partial) partial[(int64_t(blockIdx.y) * p.channels + c) * (W + 1) + k] = s;
        else if (k < W) p.grad_weight[c * W + k] += s;
        else if (p.grad_bias) p.grad_bias[c] += s;
      }
    }
    __syncthreads();
  }
}

template <typename T>
bool use_vec(const TreeConvParams& p, bool backward) {
  constexpr int V = VecOf<T>::V;  // a multiple of BwdVecOf<T>::V
  const auto aligned = [](const void* ptr) { return ptr == nullptr || (reinterpret_cast<uintptr_t>(ptr) % 16) == 0; };
  if (p.channels % V != 0 || p.width < 1 || !aligned(p.x)) return false;
  if (p.width > 1 && !p.ancestors) return false;
  if (!backward) return aligned(p.y);
  return aligned(p.grad_y) && aligned(p.grad_x) && (p.width == 1 || (p.reader_offsets && p.readers));
}

dim3 vec_grid_x(int64_t channels, int v) { return dim3(unsigned(ceil_div(ceil_div(channels, v), kVecThreads))); }

const dim3 kVecBlock(kVecThreads, kVecTokenLanes);

int64_t weight_grad_chunks(int64_t num_tokens, int64_t channels) {
  if (num_tokens == 0 || channels == 0) return 1;
  const int64_t wanted = std::max(ceil_div(kTargetBlocks, ceil_div(channels, kChannelsPerBlock)),
                                  ceil_div(kVecTargetBlocks, ceil_div(channels, int64_t(kVecThreads) * 4)));
  const int64_t by_tokens = ceil_div(num_tokens, kMinChunkTokens);
  return std::max<int64_t>(1, std::min({wanted, by_tokens, kMaxGridY}));
}

dim3 token_grid(const TreeConvParams& p) {
  return dim3(unsigned(ceil_div(p.channels, kChannelsPerBlock)),
              unsigned(std::min(ceil_div(p.num_tokens, kTokenLanes), kMaxGridY)));
}

const dim3 kBlock(kChannelsPerBlock, kTokenLanes);

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(op) + ": CUDA launch failed: " + cudaGetErrorString(err));
}

// A weight-gradient pass over token chunks (host side): `launch(grid, tokens_per_chunk, partial)` runs its
// kernel over `grid_x` channel blocks and one block row per chunk; with more than one chunk (a workspace
// given) the chunks' partial sums are then reduced in a fixed order.
template <int W, typename Launch>
void over_token_chunks(const TreeConvParams& p, unsigned grid_x, cudaStream_t stream, Launch&& launch) {
  const int64_t chunks = p.workspace ? weight_grad_chunks(p.num_tokens, p.channels) : 1;
  const int64_t tokens_per_chunk = ceil_div(p.num_tokens, chunks);
  const int64_t used = ceil_div(p.num_tokens, tokens_per_chunk);
  float* partial = used > 1 ? p.workspace : nullptr;
  launch(dim3(grid_x, unsigned(used)), tokens_per_chunk, partial);
  if (!partial) return;
  const int64_t per_chunk = p.channels * (W + 1);
  reduce_chunks_kernel<<<unsigned(ceil_div(per_chunk, 256)), 256, 0, stream>>>(
      partial, used, p.channels, W, p.grad_weight, p.grad_bias);
}

template <typename T, int W>
void launch_weight_grad(const TreeConvParams& p, cudaStream_t stream) {
  over_token_chunks<W>(p, unsigned(ceil_div(p.channels, kChannelsPerBlock)), stream,
                       [&](dim3 grid, int64_t tokens_per_chunk, float* partial) {
                         weight_grad_kernel<T, W><<<grid, kBlock, 0, stream>>>(p, tokens_per_chunk, partial);
                       });
}

template <typename T, int W>
void launch_backward_vec(const TreeConvParams& p, cudaStream_t stream) {
  over_token_chunks<W>(p, vec_grid_x(p.channels, BwdVecOf<T>::V).x, stream,
                       [&](dim3 grid, int64_t tokens_per_chunk, float* partial) {
                         backward_vec_kernel<T, W><<<grid, kVecBlock, 0, stream>>>(p, tokens_per_chunk, partial);
                       });
}

template <typename T, typename Fn>
void dispatch_width(int64_t width, Fn&& fn) {
  switch (width) {
    case 1: return fn(TypeTag<T>{}, std::integral_constant<int, 1>{});
    case 2: return fn(TypeTag<T>{}, std::integral_constant<int, 2>{});
    case 3: return fn(TypeTag<T>{}, std::integral_constant<int, 3>{});
    case 4: return fn(TypeTag<T>{}, std::integral_constant<int, 4>{});
    case 5: return fn(TypeTag<T>{}, std::integral_constant<int, 5>{});
    case 6: return fn(TypeTag<T>{}, std::integral_constant<int, 6>{});
    case 7: return fn(TypeTag<T>{}, std::integral_constant<int, 7>{});
    case 8: return fn(TypeTag<T>{}, std::integral_constant<int, 8>{});
    default: throw std::invalid_argument("tree_conv: unsupported width");
  }
}

static_assert(kTreeConvMaxWidth == 8, "dispatch_width covers widths 1..8");

// Validates, skips empty inputs, then calls fn(TypeTag<T>, integral_constant<int, W>).
template <typename Fn>
void run_cuda(const TreeConvParams& p, DType dtype, bool backward, const char* op, Fn&& fn) {
  check_tree_conv_params(p, backward);
  if (dtype == DType::Float64)
    throw std::invalid_argument(std::string("tree_conv: ") + op +
                                " on CUDA supports float32, bfloat16 and float16, not float64");
  if (backward && p.width > 1 && (!p.reader_offsets || !p.readers))
    throw std::invalid_argument(std::string("tree_conv: ") + op +
                                " on CUDA needs reader_offsets and readers when width > 1 "
                                "(see build_conv_readers)");
  if (p.num_tokens == 0 || p.channels == 0) return;
  switch (dtype) {
    case DType::Float32: dispatch_width<float>(p.width, fn); break;
    case DType::BFloat16: dispatch_width<__nv_bfloat16>(p.width, fn); break;
    case DType::Float16: dispatch_width<__half>(p.width, fn); break;
    case DType::Float64: break;
  }
  check_launch(op);
}

}  // namespace

int64_t tree_conv_backward_cuda_workspace_floats(int64_t num_tokens, int64_t channels,
                                                 int64_t width) {
  const int64_t chunks = weight_grad_chunks(num_tokens, channels);
  return chunks > 1 ? chunks * channels * (width + 1) : 0;
}

void tree_conv_forward_cuda(const TreeConvParams& params, DType dtype, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  run_cuda(params, dtype, false, "tree_conv_forward", [&](auto type, auto width) {
    using T = typename decltype(type)::type;
    constexpr int W = decltype(width)::value;
    if (use_vec<T>(params, false)) {
      const dim3 grid(vec_grid_x(params.channels, VecOf<T>::V).x,
                      unsigned(std::min(ceil_div(params.num_tokens, int64_t(kVecTokenLanes) * kVecForwardTokens),
                                        kMaxGridY)));
      forward_vec_kernel<T, W><<<grid, kVecBlock, 0, s>>>(params);
      return;
    }
    forward_kernel<T, W><<<token_grid(params), kBlock, 0, s>>>(params);
  });
}

void tree_conv_backward_cuda(const TreeConvParams& params, DType dtype, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  run_cuda(params, dtype, true, "tree_conv_backward", [&](auto type, auto width) {
    using T = typename decltype(type)::type;
    constexpr int W = decltype(width)::value;
    if (use_vec<T>(params, true)) {
      launch_backward_vec<T, W>(params, s);
      return;
    }
    grad_x_kernel<T, W><<<token_grid(params), kBlock, 0, s>>>(params);
    launch_weight_grad<T, W>(params, s);
  });
}

}  // namespace tree_recurrence::kernels
