#include "tree_recurrence/kernels/tree_conv.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

namespace tree_recurrence::kernels {

const char* dtype_name(DType dtype) { return element_type_name(dtype); }

namespace {

void require(bool ok, const std::string& what) { kernels::require(ok, "tree_conv", what); }

void check_ancestor_range(const int64_t* ancestors, int64_t n, int64_t width) {
  const int64_t count = n * (width - 1);
  for (int64_t r = 0; r < count; ++r) {
    const int64_t a = ancestors[r];
    require(a >= -1 && a < n, "ancestors[" + std::to_string(r) + "] = " + std::to_string(a) +
                                  " is outside [-1, " + std::to_string(n) + ")");
  }
}

template <typename T>
T silu_of(T v) {
  return v / (T(1) + std::exp(-v));
}

template <typename T>
T silu_grad(T v) {
  const T s = T(1) / (T(1) + std::exp(-v));
  return s * (T(1) + v * (T(1) - s));
}

// Source token of tap k (k = W-1 is the token itself), or -1.
inline int64_t tap_source(const TreeConvParams& p, int64_t t, int64_t k) {
  const int64_t back = p.width - 1 - k;
  return back == 0 ? t : p.ancestors[t * (p.width - 1) + back - 1];
}

// Bias first, then taps oldest to newest: the order causal_conv1d accumulates in.
template <typename T>
T pre_activation(const TreeConvParams& p, int64_t t, int64_t c) {
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight) + c * p.width;
  T acc = p.bias ? static_cast<const T*>(p.bias)[c] : T(0);
  for (int64_t k = 0; k < p.width; ++k) {
    const int64_t src = tap_source(p, t, k);
    if (src >= 0) acc += w[k] * x[src * p.channels + c];
  }
  return acc;
}

template <typename T>
void forward_impl(const TreeConvParams& p) {
  T* y = static_cast<T*>(p.y);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    for (int64_t c = 0; c < p.channels; ++c) {
      const T v = pre_activation<T>(p, t, c);
      y[t * p.channels + c] = p.silu ? silu_of(v) : v;
    }
  }
}

// Scatter form: each token pushes its gradient to the tokens it read. Sequential, so it is
// deterministic without the reader CSR the CUDA path needs.
template <typename T>
void backward_impl(const TreeConvParams& p) {
  const int64_t n = p.num_tokens, ch = p.channels, width = p.width;
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  const T* gy = static_cast<const T*>(p.grad_y);
  T* gx = static_cast<T*>(p.grad_x);
  std::fill(gx, gx + n * ch, T(0));
  // Double sums so that fp32 outputs carry a single rounding.
  std::vector<double> gw(static_cast<size_t>(ch * width), 0.0), gb(static_cast<size_t>(ch), 0.0);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t c = 0; c < ch; ++c) {
      T g = gy[t * ch + c];
      if (p.silu) g *= silu_grad(pre_activation<T>(p, t, c));
      gb[c] += g;
      for (int64_t k = 0; k < width; ++k) {
        const int64_t src = tap_source(p, t, k);
        if (src < 0) continue;
        gx[src * ch + c] += w[c * width + k] * g;
        gw[c * width + k] += g * x[src * ch + c];
      }
    }
  }
  for (int64_t i = 0; i < ch * width; ++i) p.grad_weight[i] += static_cast<float>(gw[i]);
  if (p.grad_bias)
    for (int64_t c = 0; c < ch; ++c) p.grad_bias[c] += static_cast<float>(gb[c]);
}

// Checks everything before the empty-input early return, so bad calls fail on any size.
template <typename Fn>
void run_cpu(const TreeConvParams& p, DType dtype, bool backward, const char* op, Fn&& fn) {
  check_tree_conv_params(p, backward);
  require(dtype == DType::Float32 || dtype == DType::Float64,
          std::string(op) + " on CPU supports float32 and float64, not " + dtype_name(dtype));
  if (p.num_tokens == 0 || p.channels == 0) return;
  if (p.width > 1) check_ancestor_range(p.ancestors, p.num_tokens, p.width);
  if (dtype == DType::Float32) fn(float{});
  else fn(double{});
}

}  // namespace

void check_tree_conv_params(const TreeConvParams& p, bool backward) {
  require(p.width >= 1 && p.width <= kTreeConvMaxWidth,
          "width " + std::to_string(p.width) + " is outside 1.." +
              std::to_string(kTreeConvMaxWidth));
  require(p.num_tokens >= 0 && p.channels >= 0, "negative num_tokens or channels");
  const bool empty = p.num_tokens == 0 || p.channels == 0;
  require(empty || (p.x && p.weight), "x and weight are required");
  require(empty || p.width == 1 || p.ancestors, "ancestors are required when width > 1");
  if (!backward) {
    require(empty || p.y, "y is required");
    return;
  }
  require(empty || (p.grad_y && p.grad_x), "grad_y and grad_x are required");
  require(p.channels == 0 || p.grad_weight, "grad_weight is required");
}

int64_t build_conv_readers(const int64_t* ancestors, int64_t n, int64_t width,
                           int64_t* reader_offsets, int64_t* readers) {
  require(width >= 1 && n >= 0, "build_conv_readers: bad width or num_tokens");
  std::fill(reader_offsets, reader_offsets + n + 1, int64_t{0});
  const int64_t count = n * (width - 1);
  if (count == 0) return 0;
  check_ancestor_range(ancestors, n, width);
  for (int64_t r = 0; r < count; ++r)
    if (ancestors[r] >= 0) ++reader_offsets[ancestors[r] + 1];
  for (int64_t u = 0; u < n; ++u) reader_offsets[u + 1] += reader_offsets[u];
  std::vector<int64_t> cursor(reader_offsets, reader_offsets + n);
  for (int64_t r = 0; r < count; ++r)
    if (ancestors[r] >= 0) readers[cursor[ancestors[r]]++] = r;
  return reader_offsets[n];
}

void tree_conv_forward_cpu(const TreeConvParams& params, DType dtype) {
  run_cpu(params, dtype, false, "tree_conv_forward",
          [&](auto tag) { forward_impl<decltype(tag)>(params); });
}

void tree_conv_backward_cpu(const TreeConvParams& params, DType dtype) {
  run_cpu(params, dtype, true, "tree_conv_backward",
          [&](auto tag) { backward_impl<decltype(tag)>(params); });
}

}  // namespace tree_recurrence::kernels
