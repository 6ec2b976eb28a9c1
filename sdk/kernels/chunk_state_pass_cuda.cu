// CUDA kernels of the chunked tree state pass (math and schedule: chunk_state_pass.h).
//
// One launch per trie level and direction. A block owns (segment of the level, head, V tile of 32
// columns) and walks the segment's chunks. Its 8 warps split the K rows of the state tile; lane j
// owns column j, so each thread keeps K/8 state values in registers and mirrors them into shared
// memory, where the whole block reads full columns for the C x K by K x 32 product. Per chunk:
//   forward:  h[c] = S;  v_new = u - w S  (w^T staged transposed);  S = decay S + kd^T v_new
//   backward: dS -> grad_state[c];  dv = dv_new + kd dS;  dS = dh + decay dS - w^T dv
// Inputs are widened to the accumulation type on load (fp32, or fp64 for fp64 inputs); every
// product is an FMA in that type, so fp32 inputs get plain fp32 math. No atomics, no host sync.
#include "tree_recurrence/kernels/chunk_state_pass.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace tree_recurrence::kernels {
namespace {

constexpr int kTile = 32;             // V columns per block (one per lane)
constexpr int kWarps = 8;             // warps per block; they split the K rows
constexpr int kThreads = kTile * kWarps;
constexpr int kMaxC = 64;             // padded chunk rows held in shared memory
constexpr int kTransposedStride = kMaxC + 4;  // row stride of a transposed (K x C) chunk operand

__device__ __forceinline__ float to_acc(float v, float) { return v; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v, float) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(__half v, float) { return __half2float(v); }
__device__ __forceinline__ double to_acc(double v, double) { return v; }

template <typename T>
__device__ __forceinline__ T from_acc(float v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <typename T>
__device__ __forceinline__ T from_acc(double v) { return v; }

// Four consecutive shared values (16-byte aligned for float, 32 for double).
__device__ __forceinline__ void load4(const float* p, float (&out)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
}
__device__ __forceinline__ void load4(const double* p, double (&out)[4]) {
  const double2 a = *reinterpret_cast<const double2*>(p);
  const double2 b = *reinterpret_cast<const double2*>(p + 2);
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}

template <int KMAX>
__host__ __device__ constexpr int buffer_elems() {
  return KMAX * kTransposedStride > kMaxC * KMAX ? KMAX * kTransposedStride : kMaxC * KMAX;
}

template <typename A, int KMAX>
constexpr size_t shared_bytes() {
  return sizeof(A) * (size_t(KMAX) * kTile + buffer_elems<KMAX>() + size_t(kMaxC) * kTile);
}

struct Shape {
  int64_t H, C, K, V;
};

// A thread's place in a level's launch: the sizes, its lane (V column of the tile) and warp (K rows),
// the block's segment, head and column, whether that column exists, and the state size K * V.
struct Place {
  Shape z;
  int lane, warp;
  int64_t s, head, col;
  bool col_ok;
  int64_t KV;
};

// The params' buffers typed: T the inputs' element type, A the accumulation type (chunk_state_pass.h).
template <typename T, typename A>
struct Buffers {
  const T *w, *u, *kd;
  const A* decay;
  A* h;
  T* v_new;
  const A* grad_h;
  const T* grad_v_new;
  A *grad_u, *grad_state, *decay_partial;
};

template <typename T, typename A>
__device__ __forceinline__ Buffers<T, A> buffers_of(const ChunkStatePassParams& p) {
  return {static_cast<const T*>(p.w),      static_cast<const T*>(p.u),          static_cast<const T*>(p.kd),
          static_cast<const A*>(p.decay),  static_cast<A*>(p.h),                static_cast<T*>(p.v_new),
          static_cast<const A*>(p.grad_h), static_cast<const T*>(p.grad_v_new), static_cast<A*>(p.grad_u),
          static_cast<A*>(p.grad_state),   static_cast<A*>(p.grad_decay_partial)};
}

__device__ __forceinline__ Place place_of(const ChunkStatePassParams& p, int64_t level_begin) {
  const Shape z{p.heads, p.chunk, p.k_dim, p.v_dim};
  const int lane = threadIdx.x % kTile, warp = threadIdx.x / kTile;
  const int64_t s = p.level_segments[level_begin + blockIdx.x];
  const int64_t head = blockIdx.y;
  const int64_t col = int64_t(blockIdx.z) * kTile + lane;
  return {z, lane, warp, s, head, col, col < z.V, z.K * z.V};
}

// Stages a chunk's (C x K) operand into shared memory, widened to the accumulation type and
// zero-padded to kMaxC x KMAX, transposed (dst[k * kTransposedStride + t]) or row-major
// (dst[t * KMAX + k]). For a full-size chunk (C == kMaxC, K == KMAX: the 64 x 64 and 64 x 128 cases)
// the thread issues all its global reads at once, into registers at constant offsets, then writes
// them; other shapes read element by element. The reads are issued here, right before the operand
// is needed, not a step ahead: that keeps the kernel at 128 registers for K = 128, two blocks per
// SM, whose steps interleave (faster on trees and chains than one block holding prefetched tiles).
template <bool kTransposed, typename T, typename A, int KMAX>
__device__ __forceinline__ void stage(A* dst, const T* __restrict__ src, const Shape& z) {
  static_assert(kThreads % KMAX == 0, "a thread stages one column k and every (kThreads/KMAX)-th row");
  constexpr int kPer = kMaxC * KMAX / kThreads;
  constexpr int kRowStep = kThreads / KMAX;
  const int k = threadIdx.x % KMAX, t0 = threadIdx.x / KMAX;
  if (z.C == kMaxC && z.K == KMAX) {
    T v[kPer];
    const T* p = src + threadIdx.x;  // = (t0 = tid / KMAX) * KMAX + (k = tid % KMAX)
#pragma unroll
    for (int r = 0; r < kPer; ++r) v[r] = p[r * kThreads];
#pragma unroll
    for (int r = 0; r < kPer; ++r) {
      const int t = t0 + r * kRowStep;
      const A x = to_acc(v[r], A());
      if (kTransposed) dst[k * kTransposedStride + t] = x;
      else dst[t * KMAX + k] = x;
    }
    return;
  }
  const bool k_ok = k < z.K;
  for (int t = t0; t < kMaxC; t += kRowStep) {
    const A x = (k_ok && t < z.C) ? to_acc(src[int64_t(t) * z.K + k], A()) : A(0);
    if (kTransposed) dst[k * kTransposedStride + t] = x;
    else dst[t * KMAX + k] = x;
  }
}

// out[i] (rows t = warp*8 + i, column lane) = sum_k opT[k][t] * col[k][lane]
template <typename A, int KMAX>
__device__ __forceinline__ void rows_times_state(const A* opT, const A* col, int lane, int warp, A (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = A(0);
#pragma unroll 4
  for (int k = 0; k < KMAX; ++k) {
    const A s = col[k * kTile + lane];
    A a[4], b[4];
    load4(opT + k * kTransposedStride + warp * 8, a);
    load4(opT + k * kTransposedStride + warp * 8 + 4, b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[i] = fma(a[i], s, out[i]);
      out[4 + i] = fma(b[i], s, out[4 + i]);
    }
  }
}

// acc[i] (state rows k = warp*RK + i, column lane) += sign * sum_t op[t][k] * vals[t][lane]
template <typename A, int KMAX, bool kSubtract>
__device__ __forceinline__ void state_update(const A* op, const A* vals, int C, int lane, int warp, A (&acc)[KMAX / kWarps]) {
  constexpr int RK = KMAX / kWarps;
  for (int t = 0; t < C; ++t) {
    const A v = kSubtract ? -vals[t * kTile + lane] : vals[t * kTile + lane];
#pragma unroll
    for (int i = 0; i < RK; i += 4) {
      A a[4];
      load4(op + t * KMAX + warp * RK + i, a);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[i + r] = fma(a[r], v, acc[i + r]);
    }
  }
}

template <typename T, typename A, int KMAX>
__global__ void __launch_bounds__(kThreads) forward_kernel(ChunkStatePassParams p, int64_t level_begin) {
  constexpr int RK = KMAX / kWarps;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* state_s = reinterpret_cast<A*>(smem_raw);   // KMAX x kTile
  A* buf = state_s + KMAX * kTile;               // staged w (transposed) or kd (row-major)
  A* vn_s = buf + buffer_elems<KMAX>();          // kMaxC x kTile
  const auto [z, lane, warp, s, head, col, col_ok, KV] = place_of(p, level_begin);

  // Starting state: parent's final state, the root's initial state, or zeros.
  const A* start = nullptr;
  const int64_t parent = p.parents[s];
  if (parent >= 0) start = static_cast<const A*>(p.workspace) + (parent * z.H + head) * KV;
  else if (p.initial_state)
    start = static_cast<const A*>(p.initial_state) + ((p.initial_per_root ? p.root_index[s] * z.H : 0) + head) * KV;
  A state[RK];
#pragma unroll
  for (int i = 0; i < RK; ++i) {
    const int k = warp * RK + i;
    state[i] = (start && col_ok && k < z.K) ? start[int64_t(k) * z.V + col] : A(0);
    state_s[k * kTile + lane] = state[i];
  }
  const auto [w, u, kd, decay, h, v_new, grad_h_, grad_v_new_, grad_u_, grad_state_, decay_partial_] = buffers_of<T, A>(p);
  const int64_t c_begin = p.seg_chunk_offsets[s], c_end = p.seg_chunk_offsets[s + 1];
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t ch = c * z.H + head;
    if (col_ok) {
#pragma unroll
      for (int i = 0; i < RK; ++i) {
        const int k = warp * RK + i;
        if (k < z.K) h[ch * KV + int64_t(k) * z.V + col] = state[i];
      }
    }
    if (w) {
      stage<true, T, A, KMAX>(buf, w + ch * z.C * z.K, z);
      __syncthreads();  // w(c) staged; state_s complete
    }
    A u_val[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = warp * 8 + i;
      u_val[i] = (t < z.C && col_ok) ? to_acc(u[(ch * z.C + t) * z.V + col], A()) : A(0);
    }
    // v_new = u - w @ S for rows t = warp*8 + i.
    A vn[8];
    if (w) {
      rows_times_state<A, KMAX>(buf, state_s, lane, warp, vn);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) vn[i] = A(0);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = warp * 8 + i;
      A v = A(0);
      if (t < z.C && col_ok) {
        v = u_val[i] - vn[i];
        v_new[(ch * z.C + t) * z.V + col] = from_acc<T>(v);
      }
      vn_s[t * kTile + lane] = v;
    }
    __syncthreads();  // v_new complete; buf free
    stage<false, T, A, KMAX>(buf, kd + ch * z.C * z.K, z);
    __syncthreads();
    const A d = decay[ch];
#pragma unroll
    for (int i = 0; i < RK; ++i) state[i] *= d;
    state_update<A, KMAX, false>(buf, vn_s, int(z.C), lane, warp, state);
#pragma unroll
    for (int i = 0; i < RK; ++i) state_s[(warp * RK + i) * kTile + lane] = state[i];
    __syncthreads();  // state_s and buf are read again by the next chunk
  }
  if (p.child_offsets[s + 1] > p.child_offsets[s] && col_ok) {
    A* out = static_cast<A*>(p.workspace) + (s * z.H + head) * KV;
#pragma unroll
    for (int i = 0; i < RK; ++i) {
      const int k = warp * RK + i;
      if (k < z.K) out[int64_t(k) * z.V + col] = state[i];
    }
  }
}

template <typename T, typename A, int KMAX>
__global__ void __launch_bounds__(kThreads) backward_kernel(ChunkStatePassParams p, int64_t level_begin) {
  constexpr int RK = KMAX / kWarps;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A* state_s = reinterpret_cast<A*>(smem_raw);   // dS, KMAX x kTile
  A* buf = state_s + KMAX * kTile;               // staged kd (transposed) or w (row-major)
  A* dv_s = buf + buffer_elems<KMAX>();          // kMaxC x kTile
  const auto [z, lane, warp, s, head, col, col_ok, KV] = place_of(p, level_begin);
  const A* state_grad_in = static_cast<const A*>(p.workspace);

  // dS of the segment's last chunk: the children's first-chunk state gradients, in CSR order.
  A state[RK];
#pragma unroll
  for (int i = 0; i < RK; ++i) state[i] = A(0);
  if (col_ok) {
    for (int64_t e = p.child_offsets[s]; e < p.child_offsets[s + 1]; ++e) {
      const A* src = state_grad_in + (p.children[e] * z.H + head) * KV;
#pragma unroll
      for (int i = 0; i < RK; ++i) {
        const int k = warp * RK + i;
        if (k < z.K) state[i] += src[int64_t(k) * z.V + col];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RK; ++i) state_s[(warp * RK + i) * kTile + lane] = state[i];
  const auto [w, u_, kd, decay, h, v_new_, grad_h, grad_v_new, grad_u, grad_state, decay_partial] = buffers_of<T, A>(p);
  __shared__ A red_s[kWarps];
  const int64_t c_begin = p.seg_chunk_offsets[s], c_last = p.seg_chunk_offsets[s + 1] - 1;
  for (int64_t c = c_last; c >= c_begin; --c) {
    const int64_t ch = c * z.H + head;
    // Reads issued early (their latency overlaps dv's product): h[c] for ddecay, grad_h[c].
    A h_val[RK], gh_val[RK];
#pragma unroll
    for (int i = 0; i < RK; ++i) {
      const int k = warp * RK + i;
      const bool ok = col_ok && k < z.K;
      const int64_t at = ch * KV + int64_t(k) * z.V + col;
      if (ok) grad_state[at] = state[i];
      h_val[i] = (ok && decay_partial) ? h[at] : A(0);
      gh_val[i] = (ok && grad_h) ? grad_h[at] : A(0);
    }
    stage<true, T, A, KMAX>(buf, kd + ch * z.C * z.K, z);  // buf is free (trailing barrier of the last step)
    __syncthreads();  // kd staged; state_s complete
    A g_val[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = warp * 8 + i;
      g_val[i] = (grad_v_new && t < z.C && col_ok) ? to_acc(grad_v_new[(ch * z.C + t) * z.V + col], A()) : A(0);
    }
    // dv = dv_new + kd @ dS for rows t = warp*8 + i.
    A dv[8];
    rows_times_state<A, KMAX>(buf, state_s, lane, warp, dv);
    if (decay_partial) {  // this thread's share of ddecay[c] = <h[c], dS>, then the warp's
      A hd = A(0);
#pragma unroll
      for (int i = 0; i < RK; ++i) hd = fma(h_val[i], state[i], hd);
#pragma unroll
      for (int off = kTile / 2; off > 0; off /= 2) hd += __shfl_xor_sync(0xffffffffu, hd, off);
      if (lane == 0) red_s[warp] = hd;  // read after the barrier below "dv complete"
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int t = warp * 8 + i;
      A v = A(0);
      if (t < z.C && col_ok) {
        v = dv[i] + g_val[i];
        grad_u[(ch * z.C + t) * z.V + col] = v;
      }
      dv_s[t * kTile + lane] = v;
    }
    __syncthreads();  // dv complete; buf free
    if (decay_partial && threadIdx.x == 0) {  // the 8 warp sums in a fixed order
      A sum = A(0);
#pragma unroll
      for (int i = 0; i < kWarps; ++i) sum += red_s[i];
      decay_partial[ch * gridDim.z + blockIdx.z] = sum;
    }
    const A d = decay[ch];
#pragma unroll
    for (int i = 0; i < RK; ++i) state[i] = fma(d, state[i], gh_val[i]);
    if (w) {
      stage<false, T, A, KMAX>(buf, w + ch * z.C * z.K, z);
      __syncthreads();
    }
    if (w) state_update<A, KMAX, true>(buf, dv_s, int(z.C), lane, warp, state);
    __syncthreads();  // everyone is done reading state_s, buf and dv_s of this chunk
#pragma unroll
    for (int i = 0; i < RK; ++i) state_s[(warp * RK + i) * kTile + lane] = state[i];
  }
  if (!col_ok) return;
  A* out = nullptr;
  if (p.parents[s] >= 0) out = static_cast<A*>(p.workspace) + (s * z.H + head) * KV;
  else if (p.grad_initial_roots) out = static_cast<A*>(p.grad_initial_roots) + (p.root_index[s] * z.H + head) * KV;
  if (!out) return;
#pragma unroll
  for (int i = 0; i < RK; ++i) {
    const int k = warp * RK + i;
    if (k < z.K) out[int64_t(k) * z.V + col] = state[i];
  }
}

void check_launch(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(op) + ": CUDA launch failed: " + cudaGetErrorString(err));
}

template <typename T, typename A, int KMAX, bool kBackward>
void launch_levels(const ChunkStatePassParams& p, cudaStream_t stream) {
  auto kernel = kBackward ? backward_kernel<T, A, KMAX> : forward_kernel<T, A, KMAX>;
  constexpr size_t bytes = shared_bytes<A, KMAX>();
  if (bytes > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("chunk_state_pass: cannot reserve ") + std::to_string(bytes) +
                               " bytes of shared memory: " + cudaGetErrorString(err));
  }
  const unsigned tiles = unsigned((p.v_dim + kTile - 1) / kTile);
  for (int64_t step = 0; step < p.num_levels; ++step) {
    const int64_t level = kBackward ? p.num_levels - 1 - step : step;
    const int64_t begin = p.level_offsets[level], count = p.level_offsets[level + 1] - begin;
    if (count == 0) continue;
    const dim3 grid(unsigned(count), unsigned(p.heads), tiles);
    kernel<<<grid, kThreads, bytes, stream>>>(p, begin);
    check_launch(kBackward ? "chunk_state_pass_backward" : "chunk_state_pass");
  }
}

template <typename T, typename A, bool kBackward>
void dispatch_k(const ChunkStatePassParams& p, cudaStream_t stream) {
  if (p.k_dim <= 32) return launch_levels<T, A, 32, kBackward>(p, stream);
  if (p.k_dim <= 64) return launch_levels<T, A, 64, kBackward>(p, stream);
  if (p.k_dim <= 128) return launch_levels<T, A, 128, kBackward>(p, stream);
  if constexpr (sizeof(A) == 4) {
    if (p.k_dim <= 256) return launch_levels<T, A, 256, kBackward>(p, stream);
  }
  throw std::invalid_argument("chunk_state_pass: K = " + std::to_string(p.k_dim) + " is too large for the CUDA kernel (at most " +
                              std::to_string(sizeof(A) == 4 ? kChunkStateCudaMaxK : 128) + " for " +
                              (sizeof(A) == 4 ? "float32 states" : "float64") + ")");
}

template <bool kBackward>
void run(const ChunkStatePassParams& p, void* stream_ptr) {
  check_chunk_state_params(p, kBackward);
  const bool fp64 = p.acc == ChunkDType::Float64;
  if (fp64 != (p.in == ChunkDType::Float64))
    throw std::invalid_argument(std::string("chunk_state_pass: CUDA takes float64 inputs with float64 states, or float32/"
                                            "bfloat16/float16 inputs with float32 states; got ") +
                                chunk_dtype_name(p.in) + " inputs with " + chunk_dtype_name(p.acc) + " states");
  if (p.num_chunks == 0 || p.heads == 0 || p.v_dim == 0) return;
  if (p.heads > 65535) throw std::invalid_argument("chunk_state_pass: at most 65535 heads on CUDA");
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (p.in) {
    case ChunkDType::Float32: return dispatch_k<float, float, kBackward>(p, stream);
    case ChunkDType::BFloat16: return dispatch_k<__nv_bfloat16, float, kBackward>(p, stream);
    case ChunkDType::Float16: return dispatch_k<__half, float, kBackward>(p, stream);
    case ChunkDType::Float64: return dispatch_k<double, double, kBackward>(p, stream);
  }
}

}  // namespace

void chunk_state_pass_forward_cuda(const ChunkStatePassParams& params, void* stream) { run<false>(params, stream); }
void chunk_state_pass_backward_cuda(const ChunkStatePassParams& params, void* stream) { run<true>(params, stream); }

}  // namespace tree_recurrence::kernels
