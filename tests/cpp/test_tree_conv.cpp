// Tree causal depthwise conv kernels against a per-path reference and finite differences.
// Define TREE_RECURRENCE_WITH_CUDA (and link CUDA::cudart) to also check the CUDA kernels
// against the CPU ones; without a GPU those comparisons are skipped with a message.
#include <doctest/doctest.h>

#include "tree_recurrence/kernels/tree_conv.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

namespace {

using namespace tree_recurrence::kernels;

// A forest of segments laid out in DFS pre-order, as in a packed row.
struct Forest {
  std::vector<int64_t> seg_offsets{0};
  std::vector<int64_t> parents;
  std::vector<int64_t> prev;  // token one step back on its path, -1 at a root's start

  int64_t num_tokens() const { return seg_offsets.back(); }
  int64_t num_segments() const { return static_cast<int64_t>(parents.size()); }

  int64_t add_segment(int64_t parent, int64_t length) {
    const int64_t s = num_segments(), start = num_tokens();
    parents.push_back(parent);
    seg_offsets.push_back(start + length);
    for (int64_t i = 0; i < length; ++i)
      prev.push_back(i > 0 ? start + i - 1 : parent >= 0 ? seg_offsets[parent + 1] - 1 : -1);
    return s;
  }

  std::vector<int64_t> ancestors(int64_t width) const {
    const int64_t n = num_tokens(), k = width - 1;
    std::vector<int64_t> out(static_cast<size_t>(n * k));
    for (int64_t t = 0; t < n; ++t) {
      int64_t a = t;
      for (int64_t j = 0; j < k; ++j) out[t * k + j] = a = a >= 0 ? prev[a] : -1;
    }
    return out;
  }

  // Token lists of the root-to-leaf paths.
  std::vector<std::vector<int64_t>> paths() const {
    std::vector<bool> has_child(parents.size(), false);
    for (int64_t p : parents)
      if (p >= 0) has_child[p] = true;
    std::vector<std::vector<int64_t>> out;
    for (int64_t leaf = 0; leaf < num_segments(); ++leaf) {
      if (has_child[leaf]) continue;
      std::vector<int64_t> chain;
      for (int64_t s = leaf; s >= 0; s = parents[s]) chain.push_back(s);
      std::vector<int64_t> tokens;
      for (auto it = chain.rbegin(); it != chain.rend(); ++it)
        for (int64_t t = seg_offsets[*it]; t < seg_offsets[*it + 1]; ++t) tokens.push_back(t);
      out.push_back(tokens);
    }
    return out;
  }
};

void grow(Forest& f, std::mt19937& rng, int64_t parent, int depth, int max_len) {
  const int64_t s = f.add_segment(parent, std::uniform_int_distribution<int>(1, max_len)(rng));
  const int children = depth >= 3 ? 0 : std::uniform_int_distribution<int>(0, 3)(rng);
  for (int i = 0; i < children; ++i) grow(f, rng, s, depth + 1, max_len);
}

Forest random_forest(std::mt19937& rng, int roots, int max_len) {
  Forest f;
  for (int r = 0; r < roots; ++r) grow(f, rng, -1, 0, max_len);
  return f;
}

std::vector<double> random_vector(std::mt19937& rng, int64_t size) {
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> v(static_cast<size_t>(size));
  for (double& e : v) e = dist(rng);
  return v;
}

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// Ordinary causal conv over one path, zero left padding.
std::vector<double> path_conv(const std::vector<double>& x, const std::vector<double>& w,
                              const std::vector<double>* bias, bool act, int64_t ch,
                              int64_t width, const std::vector<int64_t>& path) {
  const int64_t len = static_cast<int64_t>(path.size());
  std::vector<double> y(static_cast<size_t>(len * ch));
  for (int64_t i = 0; i < len; ++i)
    for (int64_t c = 0; c < ch; ++c) {
      double acc = bias ? (*bias)[c] : 0.0;
      for (int64_t k = 0; k < width; ++k) {
        const int64_t pos = i - (width - 1 - k);
        if (pos >= 0) acc += w[c * width + k] * x[path[pos] * ch + c];
      }
      y[i * ch + c] = act ? silu(acc) : acc;
    }
  return y;
}

// Everything one forward/backward call needs, in double on the host.
struct Problem {
  Forest forest;
  int64_t ch = 0, width = 0;
  bool with_bias = true, act = false;
  std::vector<int64_t> anc;
  std::vector<double> x, w, b, gy;

  TreeConvParams params() const {
    TreeConvParams p;
    p.num_tokens = forest.num_tokens();
    p.channels = ch;
    p.width = width;
    p.ancestors = anc.empty() ? nullptr : anc.data();
    p.x = x.data();
    p.weight = w.data();
    p.bias = with_bias ? b.data() : nullptr;
    p.silu = act;
    p.grad_y = gy.data();
    return p;
  }
};

Problem make_problem(std::mt19937& rng, int64_t width, bool act, bool with_bias, int max_len) {
  Problem pb;
  pb.forest = random_forest(rng, 2, max_len);
  pb.ch = 3;
  pb.width = width;
  pb.act = act;
  pb.with_bias = with_bias;
  pb.anc = pb.forest.ancestors(width);
  const int64_t n = pb.forest.num_tokens();
  pb.x = random_vector(rng, n * pb.ch);
  pb.w = random_vector(rng, pb.ch * width);
  pb.b = random_vector(rng, pb.ch);
  pb.gy = random_vector(rng, n * pb.ch);
  return pb;
}

std::vector<double> forward_cpu(const Problem& pb) {
  std::vector<double> y(pb.x.size());
  TreeConvParams p = pb.params();
  p.y = y.data();
  tree_conv_forward_cpu(p, DType::Float64);
  return y;
}

struct Grads {
  std::vector<double> x;
  std::vector<float> w, b;
};

Grads backward_cpu(const Problem& pb) {
  Grads g{std::vector<double>(pb.x.size()), std::vector<float>(pb.w.size(), 0.f),
          std::vector<float>(pb.b.size(), 0.f)};
  TreeConvParams p = pb.params();
  p.grad_x = g.x.data();
  p.grad_weight = g.w.data();
  p.grad_bias = pb.with_bias ? g.b.data() : nullptr;
  tree_conv_backward_cpu(p, DType::Float64);
  return g;
}

double loss(const Problem& pb) {
  const std::vector<double> y = forward_cpu(pb);
  double s = 0.0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * pb.gy[i];
  return s;
}

// Central difference of loss() in each entry of `param`, compared with `analytic`.
template <typename G>
double max_fd_error(Problem& pb, std::vector<double>& param, const std::vector<G>& analytic) {
  const double eps = 1e-5;
  double worst = 0.0;
  for (size_t i = 0; i < param.size(); ++i) {
    const double saved = param[i];
    param[i] = saved + eps;
    const double up = loss(pb);
    param[i] = saved - eps;
    const double down = loss(pb);
    param[i] = saved;
    const double fd = (up - down) / (2 * eps);
    worst = std::max(worst, std::abs(fd - double(analytic[i])) / (1.0 + std::abs(fd)));
  }
  return worst;
}

std::vector<int64_t> conv_readers(const Problem& pb, std::vector<int64_t>& offsets) {
  const int64_t n = pb.forest.num_tokens();
  offsets.assign(static_cast<size_t>(n + 1), 0);
  std::vector<int64_t> readers(static_cast<size_t>(std::max<int64_t>(1, n * (pb.width - 1))));
  const int64_t count =
      build_conv_readers(pb.anc.data(), n, pb.width, offsets.data(), readers.data());
  readers.resize(static_cast<size_t>(count));
  return readers;
}

}  // namespace

TEST_CASE("tree conv forward matches an ordinary causal conv on every path") {
  std::mt19937 rng(1234);
  for (int64_t width = 1; width <= kTreeConvMaxWidth; ++width)
    for (int trial = 0; trial < 8; ++trial) {
      const bool act = trial % 2 == 1, with_bias = trial % 4 < 2;
      const Problem pb = make_problem(rng, width, act, with_bias, 1 + trial % 5);
      const std::vector<double> y = forward_cpu(pb);
      double worst = 0.0;
      for (const auto& path : pb.forest.paths()) {
        const auto ref = path_conv(pb.x, pb.w, with_bias ? &pb.b : nullptr, act, pb.ch, width, path);
        for (size_t i = 0; i < path.size(); ++i)
          for (int64_t c = 0; c < pb.ch; ++c)
            worst = std::max(worst, std::abs(y[path[i] * pb.ch + c] - ref[i * pb.ch + c]));
      }
      INFO("width " << width << " trial " << trial);
      CHECK(worst < 1e-12);
    }
}

TEST_CASE("tree conv float32 forward and backward follow float64") {
  std::mt19937 rng(99);
  for (int64_t width : {1, 2, 4, 8}) {
    const Problem pb = make_problem(rng, width, true, true, 3);
    const int64_t n = pb.forest.num_tokens();
    auto to_f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
    const auto x = to_f(pb.x), w = to_f(pb.w), b = to_f(pb.b), gy = to_f(pb.gy);
    std::vector<float> y(x.size()), gx(x.size()), gw(w.size(), 0.f), gb(b.size(), 0.f);
    TreeConvParams p = pb.params();
    p.x = x.data(), p.weight = w.data(), p.bias = b.data(), p.grad_y = gy.data();
    p.y = y.data(), p.grad_x = gx.data(), p.grad_weight = gw.data(), p.grad_bias = gb.data();
    tree_conv_forward_cpu(p, DType::Float32);
    tree_conv_backward_cpu(p, DType::Float32);
    const std::vector<double> y64 = forward_cpu(pb);
    const Grads g64 = backward_cpu(pb);
    double worst = 0.0;
    for (int64_t i = 0; i < n * pb.ch; ++i) {
      worst = std::max(worst, std::abs(y[i] - y64[i]));
      worst = std::max(worst, std::abs(gx[i] - g64.x[i]));
    }
    for (size_t i = 0; i < gw.size(); ++i) worst = std::max(worst, double(std::abs(gw[i] - g64.w[i])));
    for (size_t i = 0; i < gb.size(); ++i) worst = std::max(worst, double(std::abs(gb[i] - g64.b[i])));
    INFO("width " << width);
    CHECK(worst < 1e-4);
  }
}

TEST_CASE("tree conv backward matches finite differences") {
  std::mt19937 rng(7);
  for (int64_t width = 1; width <= 4; ++width)
    for (int variant = 0; variant < 4; ++variant) {
      const bool act = variant & 1, with_bias = (variant & 2) == 0;
      // max_len 2 keeps most segments shorter than the kernel, so taps cross segment bounds.
      Problem pb = make_problem(rng, width, act, with_bias, variant < 2 ? 2 : 5);
      const Grads g = backward_cpu(pb);
      INFO("width " << width << " silu " << act << " bias " << with_bias);
      CHECK(max_fd_error(pb, pb.x, g.x) < 1e-7);
      CHECK(max_fd_error(pb, pb.w, g.w) < 1e-6);  // fp32 accumulators: one fp32 rounding
      if (with_bias) CHECK(max_fd_error(pb, pb.b, g.b) < 1e-6);
    }
}

TEST_CASE("tree conv backward adds into grad_weight and grad_bias") {
  std::mt19937 rng(5);
  const Problem pb = make_problem(rng, 3, true, true, 4);
  const Grads once = backward_cpu(pb);
  Grads twice = once;
  TreeConvParams p = pb.params();
  p.grad_x = twice.x.data();
  p.grad_weight = twice.w.data();
  p.grad_bias = twice.b.data();
  tree_conv_backward_cpu(p, DType::Float64);
  for (size_t i = 0; i < once.w.size(); ++i) CHECK(twice.w[i] == doctest::Approx(2 * once.w[i]));
  for (size_t i = 0; i < once.b.size(); ++i) CHECK(twice.b[i] == doctest::Approx(2 * once.b[i]));
  for (size_t i = 0; i < once.x.size(); ++i) CHECK(twice.x[i] == once.x[i]);  // overwritten
}

TEST_CASE("conv readers invert ancestors and give grad_x by gathering") {
  std::mt19937 rng(42);
  for (int64_t width = 2; width <= 5; ++width) {
    const Problem pb = make_problem(rng, width, true, true, 2);
    const int64_t n = pb.forest.num_tokens(), k = width - 1, ch = pb.ch;
    std::vector<int64_t> offsets;
    const std::vector<int64_t> readers = conv_readers(pb, offsets);
    int64_t expected = 0;
    for (int64_t a : pb.anc) expected += a >= 0;
    CHECK(static_cast<int64_t>(readers.size()) == expected);
    for (int64_t u = 0; u < n; ++u)
      for (int64_t i = offsets[u]; i < offsets[u + 1]; ++i) {
        CHECK(pb.anc[readers[i]] == u);
        if (i > offsets[u]) CHECK(readers[i] > readers[i - 1]);
      }
    // The gather the CUDA grad_x kernel does, run on the host against the scatter.
    const Grads g = backward_cpu(pb);
    std::vector<double> pre_grad(static_cast<size_t>(n * ch));
    {
      Problem lin = pb;
      lin.act = false;
      const std::vector<double> pre = forward_cpu(lin);
      for (int64_t i = 0; i < n * ch; ++i) {
        const double s = 1.0 / (1.0 + std::exp(-pre[i]));
        pre_grad[i] = pb.gy[i] * s * (1.0 + pre[i] * (1.0 - s));
      }
    }
    double worst = 0.0;
    for (int64_t u = 0; u < n; ++u)
      for (int64_t c = 0; c < ch; ++c) {
        double acc = pb.w[c * width + width - 1] * pre_grad[u * ch + c];
        for (int64_t i = offsets[u]; i < offsets[u + 1]; ++i) {
          const int64_t t = readers[i] / k, back = readers[i] % k + 1;
          acc += pb.w[c * width + width - 1 - back] * pre_grad[t * ch + c];
        }
        worst = std::max(worst, std::abs(acc - g.x[u * ch + c]));
      }
    INFO("width " << width);
    CHECK(worst < 1e-12);
  }
}

TEST_CASE("tree conv rejects bad arguments") {
  std::mt19937 rng(3);
  Problem pb = make_problem(rng, 3, false, true, 3);
  std::vector<double> y(pb.x.size());
  TreeConvParams p = pb.params();
  p.y = y.data();
  CHECK_NOTHROW(tree_conv_forward_cpu(p, DType::Float64));
  CHECK_THROWS_AS(tree_conv_forward_cpu(p, DType::BFloat16), std::invalid_argument);
  CHECK_THROWS_AS(tree_conv_backward_cpu(p, DType::Float16), std::invalid_argument);
  TreeConvParams bad = p;
  bad.width = 9;
  CHECK_THROWS_AS(tree_conv_forward_cpu(bad, DType::Float64), std::invalid_argument);
  bad.width = 0;
  CHECK_THROWS_AS(tree_conv_forward_cpu(bad, DType::Float64), std::invalid_argument);
  bad = p;
  bad.ancestors = nullptr;
  CHECK_THROWS_AS(tree_conv_forward_cpu(bad, DType::Float64), std::invalid_argument);
  pb.anc[1] = pb.forest.num_tokens();
  CHECK_THROWS_AS(tree_conv_forward_cpu(p, DType::Float64), std::invalid_argument);
  std::vector<int64_t> offsets;
  CHECK_THROWS_AS(conv_readers(pb, offsets), std::invalid_argument);
}

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace {

template <typename T>
struct DeviceArray {
  T* ptr = nullptr;
  size_t size = 0;
  explicit DeviceArray(const std::vector<T>& host) : size(host.size()) {
    REQUIRE(cudaMalloc(&ptr, std::max<size_t>(1, size) * sizeof(T)) == cudaSuccess);
    REQUIRE(cudaMemcpy(ptr, host.data(), size * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { cudaFree(ptr); }
  std::vector<T> download() const {
    std::vector<T> host(size);
    REQUIRE(cudaMemcpy(host.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
    return host;
  }
};

template <typename T>
T to_dtype(double v) {
  if constexpr (std::is_same_v<T, float>) return static_cast<float>(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16(static_cast<float>(v));
  else return __float2half(static_cast<float>(v));
}

template <typename T>
double from_dtype(T v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return __half2float(v);
}

// Rounds the problem's inputs to T so the double reference sees exactly what the GPU sees.
template <typename T>
std::vector<T> quantize(std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    out[i] = to_dtype<T>(v[i]);
    v[i] = from_dtype(out[i]);
  }
  return out;
}

double rel_error(double got, double ref) { return std::abs(got - ref) / (1.0 + std::abs(ref)); }

struct CudaResult {
  std::vector<double> y, gx;
  std::vector<float> gw, gb;
};

template <typename T>
CudaResult run_cuda(Problem& pb, DType dtype, bool use_workspace) {
  const int64_t n = pb.forest.num_tokens();
  DeviceArray<T> x(quantize<T>(pb.x)), w(quantize<T>(pb.w)), b(quantize<T>(pb.b)),
      gy(quantize<T>(pb.gy)), y(std::vector<T>(pb.x.size())), gx(std::vector<T>(pb.x.size()));
  DeviceArray<float> gw(std::vector<float>(pb.w.size(), 0.f)), gb(std::vector<float>(pb.b.size(), 0.f));
  std::vector<int64_t> offsets;
  const std::vector<int64_t> readers = conv_readers(pb, offsets);
  DeviceArray<int64_t> anc(pb.anc), off(offsets), rd(readers);
  const int64_t ws = tree_conv_backward_cuda_workspace_floats(n, pb.ch, pb.width);
  DeviceArray<float> workspace(std::vector<float>(static_cast<size_t>(ws)));
  TreeConvParams p;
  p.num_tokens = n;
  p.channels = pb.ch;
  p.width = pb.width;
  p.ancestors = pb.width > 1 ? anc.ptr : nullptr;
  p.x = x.ptr, p.weight = w.ptr, p.bias = pb.with_bias ? b.ptr : nullptr, p.y = y.ptr;
  p.silu = pb.act;
  p.grad_y = gy.ptr, p.grad_x = gx.ptr, p.grad_weight = gw.ptr;
  p.grad_bias = pb.with_bias ? gb.ptr : nullptr;
  p.reader_offsets = off.ptr, p.readers = rd.ptr;
  p.workspace = use_workspace && ws > 0 ? workspace.ptr : nullptr;
  tree_conv_forward_cuda(p, dtype, nullptr);
  tree_conv_backward_cuda(p, dtype, nullptr);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CudaResult r;
  for (T v : y.download()) r.y.push_back(from_dtype(v));
  for (T v : gx.download()) r.gx.push_back(from_dtype(v));
  r.gw = gw.download();
  r.gb = gb.download();
  return r;
}

Problem big_problem(std::mt19937& rng, int64_t width, bool act, int64_t ch, int roots) {
  Problem pb;
  pb.forest = random_forest(rng, roots, 40);
  pb.ch = ch;
  pb.width = width;
  pb.act = act;
  pb.anc = pb.forest.ancestors(width);
  const int64_t n = pb.forest.num_tokens();
  pb.x = random_vector(rng, n * ch);
  pb.w = random_vector(rng, ch * width);
  pb.b = random_vector(rng, ch);
  pb.gy = random_vector(rng, n * ch);
  return pb;
}

// CUDA builds also run where there is no GPU (CI); the comparisons are skipped there.
bool cuda_device_present() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

template <typename T>
void check_cuda_against_cpu(DType dtype, double out_tol) {
  std::mt19937 rng(2024);
  for (int64_t width : {1, 2, 3, 4, 8})
    for (int variant = 0; variant < 3; ++variant) {
      const bool act = variant != 1;
      // Variant 2 is long enough (and narrow enough) to take the chunked weight reduction.
      Problem pb = variant < 2 ? big_problem(rng, width, act, 70, 3) : big_problem(rng, width, act, 5, 40);
      pb.with_bias = variant != 0;
      const CudaResult got = run_cuda<T>(pb, dtype, true);  // quantizes pb's inputs
      const std::vector<double> y = forward_cpu(pb);
      const Grads g = backward_cpu(pb);
      double worst_y = 0, worst_gx = 0, worst_gw = 0;
      for (size_t i = 0; i < y.size(); ++i) {
        worst_y = std::max(worst_y, rel_error(got.y[i], y[i]));
        worst_gx = std::max(worst_gx, rel_error(got.gx[i], g.x[i]));
      }
      for (size_t i = 0; i < g.w.size(); ++i) worst_gw = std::max(worst_gw, rel_error(got.gw[i], g.w[i]));
      if (pb.with_bias)
        for (size_t i = 0; i < g.b.size(); ++i) worst_gw = std::max(worst_gw, rel_error(got.gb[i], g.b[i]));
      INFO("dtype " << dtype_name(dtype) << " width " << width << " variant " << variant
                    << " tokens " << pb.forest.num_tokens());
      CHECK(worst_y < out_tol);
      CHECK(worst_gx < out_tol);
      CHECK(worst_gw < 1e-4);  // fp32 sums of exactly-representable inputs
      // Same problem again, with and without workspace: bitwise repeatable, and close.
      const CudaResult again = run_cuda<T>(pb, dtype, true);
      const CudaResult serial = run_cuda<T>(pb, dtype, false);
      CHECK(again.gx == got.gx);
      CHECK(again.gw == got.gw);
      CHECK(again.gb == got.gb);
      double drift = 0;
      for (size_t i = 0; i < got.gw.size(); ++i) drift = std::max(drift, rel_error(serial.gw[i], got.gw[i]));
      CHECK(drift < 1e-4);
    }
}

}  // namespace

TEST_CASE("tree conv CUDA float32 matches CPU" * doctest::skip(!cuda_device_present())) { check_cuda_against_cpu<float>(DType::Float32, 1e-5); }
TEST_CASE("tree conv CUDA bfloat16 matches CPU" * doctest::skip(!cuda_device_present())) { check_cuda_against_cpu<__nv_bfloat16>(DType::BFloat16, 8e-3); }
TEST_CASE("tree conv CUDA float16 matches CPU" * doctest::skip(!cuda_device_present())) { check_cuda_against_cpu<__half>(DType::Float16, 1e-3); }

TEST_CASE("tree conv CUDA rejects float64 and a missing reader CSR" * doctest::skip(!cuda_device_present())) {
  TreeConvParams p;
  p.num_tokens = 1, p.channels = 1, p.width = 2;
  int64_t dummy = 0;
  p.ancestors = &dummy, p.x = &dummy, p.weight = &dummy, p.y = &dummy;
  CHECK_THROWS_AS(tree_conv_forward_cuda(p, DType::Float64, nullptr), std::invalid_argument);
  p.grad_y = &dummy, p.grad_x = &dummy;
  float gw = 0;
  p.grad_weight = &gw;
  CHECK_THROWS_AS(tree_conv_backward_cuda(p, DType::Float32, nullptr), std::invalid_argument);
}
#endif
