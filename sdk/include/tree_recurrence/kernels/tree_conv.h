// Tree causal depthwise conv: forward and backward, CPU and CUDA.
//
// Formula (docs/architecture.md):
//   y[t, c] = act(bias[c] + sum_{k=0}^{W-1} w[c, k] * x[tap(t, k), c])
//   tap(t, W-1) = t, tap(t, k) = ancestors[t, W-2-k] (the token W-1-k steps back), x[-1] = 0.
//
// Plain POD params and raw pointers, no ATen, so the sources compile fast and can be linked into
// several plugins. All arrays are contiguous, row-major, and live on the device the function runs
// on (host memory for *_cpu, device memory for *_cuda).
#pragma once

#include <cstdint>

#include "tree_recurrence/kernels/dtype.h"

namespace tree_recurrence::kernels {

constexpr int64_t kTreeConvMaxWidth = 8;

struct TreeConvParams {
  int64_t num_tokens = 0;              // N
  int64_t channels = 0;                // C
  int64_t width = 0;                   // W, 1..kTreeConvMaxWidth
  const int64_t* ancestors = nullptr;  // N x (W-1): column j is the token j+1 steps back, -1 = none.
                                       // May be null when W == 1.
  // x, weight, bias, y, grad_y and grad_x all have the dtype passed to the call.
  const void* x = nullptr;       // N x C
  const void* weight = nullptr;  // C x W; w[c, W-1] multiplies the token itself
  const void* bias = nullptr;    // C, or null for no bias
  void* y = nullptr;             // N x C, written by forward
  bool silu = false;             // SiLU after the bias

  // Backward. grad_x is overwritten; grad_weight and grad_bias are ADDED to (the caller zeroes
  // them), fp32 for every dtype, Float64 included.
  const void* grad_y = nullptr;   // N x C
  void* grad_x = nullptr;         // N x C
  float* grad_weight = nullptr;   // C x W
  float* grad_bias = nullptr;     // C, or null to skip

  // Reverse of `ancestors`, needed by the CUDA backward when W > 1 so that grad_x is a gather
  // (deterministic, no atomics) rather than a scatter. Build it with build_conv_readers().
  // reader_offsets: N+1, CSR over `readers`. readers[reader_offsets[u] .. reader_offsets[u+1])
  // are the flat indices r = t*(W-1) + (j-1) with ancestors[r] == u (token t reads u at j steps
  // back), in increasing order. The CPU backward ignores these fields.
  const int64_t* reader_offsets = nullptr;
  const int64_t* readers = nullptr;

  // Optional CUDA backward scratch of tree_conv_backward_cuda_workspace_floats(N, C, W) floats.
  // With it, grad_weight/grad_bias are reduced over token chunks in parallel (two passes, fixed
  // order); without it, one block per channel group walks all tokens. Both are deterministic.
  float* workspace = nullptr;
};

// DType: kernels/dtype.h.
const char* dtype_name(DType dtype);

// Throws std::invalid_argument on bad sizes or missing pointers. `backward` also checks the
// backward fields. Does not read the arrays (they may be device memory).
void check_tree_conv_params(const TreeConvParams& params, bool backward);

// Fills the reader CSR described above from host `ancestors` (N x (W-1)). reader_offsets holds
// N+1 entries, readers at least N*(W-1); returns the number of readers written
// (reader_offsets[N]). Throws std::invalid_argument if an ancestor is outside [-1, N).
int64_t build_conv_readers(const int64_t* ancestors, int64_t num_tokens, int64_t width,
                           int64_t* reader_offsets, int64_t* readers);

// CPU: Float32 and Float64 (computed in that type); others throw std::invalid_argument.
// Ancestors are range-checked.
void tree_conv_forward_cpu(const TreeConvParams& params, DType dtype);
void tree_conv_backward_cpu(const TreeConvParams& params, DType dtype);

// CUDA: Float32, BFloat16, Float16, accumulated in fp32 and rounded once; Float64 throws
// std::invalid_argument. `stream` is a cudaStream_t (null = legacy default stream). Asynchronous;
// launch failures throw std::runtime_error. Defined only when CUDA is enabled.
void tree_conv_forward_cuda(const TreeConvParams& params, DType dtype, void* stream);
void tree_conv_backward_cuda(const TreeConvParams& params, DType dtype, void* stream);
int64_t tree_conv_backward_cuda_workspace_floats(int64_t num_tokens, int64_t channels,
                                                 int64_t width);

}  // namespace tree_recurrence::kernels
