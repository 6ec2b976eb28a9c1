// The chunked tree state pass as torch ops of the shared ops library (libtree_recurrence_ops.so):
// tree_recurrence::chunk_state_pass and ::chunk_state_pass_backward, defined once for every family (CPU, CUDA,
// Meta, Autograd), and the C++ entry point tree_recurrence::chunk_state_pass (sdk/chunk_state_op.h).
// Schema, math and tables: sdk/include/tree_recurrence/sdk/chunk_state_op.h.
#include "shared_ops_internal.h"

#include <ATen/Parallel.h>
#include "tree_recurrence/sdk/check.h"
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <stdexcept>
#include <tuple>
#include <vector>

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "tree_recurrence/kernels/chunk_state_pass.h"
#include "tree_recurrence/sdk/element_type.h"
#include "tree_recurrence/sdk/chunk_state_op.h"

namespace tree_recurrence {
namespace chunk_state {

using OptTensor = std::optional<at::Tensor>;

struct Tables {
  const at::Tensor& seg_chunk_offsets;
  const at::Tensor& parents;
  const at::Tensor& root_index;
  const at::Tensor& level_segments;
  at::IntArrayRef level_offsets;
  const at::Tensor& child_offsets;
  const at::Tensor& children;
};

struct Sizes {
  int64_t NC, H, C, K, V, S, R;
  bool per_root;
};

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

at::ScalarType state_dtype(at::ScalarType in) { return in == at::kDouble ? at::kDouble : at::kFloat; }

// Shapes, dtypes, devices and the host level_offsets. `what` is "chunk_state_pass" or "..._backward".
Sizes check_args(const char* what, const OptTensor& w, const at::Tensor& u, const at::Tensor& kd,
                        const at::Tensor& decay, const OptTensor& initial_state, const Tables& t) {
  TR_CHECK_VALUE(u.dim() == 4, what, ": u must be (chunks, heads, chunk_len, V), got ", u.sizes());
  const int64_t NC = u.size(0), H = u.size(1), C = u.size(2), V = u.size(3);
  TR_CHECK_TYPE(is_float(u.scalar_type()), what, ": u has dtype ", u.scalar_type(),
                   ", expected float32, float64, bfloat16 or float16");
  TR_CHECK_VALUE(C >= 1 && C <= kernels::kChunkStateMaxChunk, what, ": chunk_len (u.size(2)) is ", C, ", expected 1..",
                    kernels::kChunkStateMaxChunk);
  TR_CHECK_VALUE(kd.dim() == 4 && kd.size(0) == NC && kd.size(1) == H && kd.size(2) == C, what,
                    ": kd must be (chunks=", NC, ", heads=", H, ", chunk_len=", C, ", K), got ", kd.sizes());
  const int64_t K = kd.size(3);
  TR_CHECK_TYPE(kd.scalar_type() == u.scalar_type(), what, ": kd has dtype ", kd.scalar_type(), " but u has ",
                   u.scalar_type(), " (w, u and kd must share one dtype)");
  if (w) {
    TR_CHECK_VALUE(w->sizes() == kd.sizes(), what, ": w must be (chunks=", NC, ", heads=", H, ", chunk_len=", C,
                      ", K=", K, ") like kd, got ", w->sizes());
    TR_CHECK_TYPE(w->scalar_type() == u.scalar_type(), what, ": w has dtype ", w->scalar_type(), " but u has ",
                     u.scalar_type(), " (w, u and kd must share one dtype)");
  }
  TR_CHECK_VALUE(decay.dim() == 2 && decay.size(0) == NC && decay.size(1) == H, what, ": decay must be (chunks=", NC,
                    ", heads=", H, "), got ", decay.sizes());
  TR_CHECK_TYPE(decay.scalar_type() == at::kFloat || decay.scalar_type() == at::kDouble, what, ": decay has dtype ",
                   decay.scalar_type(), ", expected float32 or float64");
  // Tables.
  const std::pair<const char*, const at::Tensor*> tables[] = {
      {"seg_chunk_offsets", &t.seg_chunk_offsets}, {"parents", &t.parents},           {"root_index", &t.root_index},
      {"level_segments", &t.level_segments},       {"child_offsets", &t.child_offsets}, {"children", &t.children}};
  for (const auto& [name, tab] : tables) {
    TR_CHECK_TYPE(tab->scalar_type() == at::kLong, what, ": ", name, " must be int64, got ", tab->scalar_type());
    TR_CHECK_VALUE(tab->dim() == 1, what, ": ", name, " must be 1-D, got ", tab->sizes());
    TR_CHECK_VALUE(tab->device() == u.device(), what, ": ", name, " is on ", tab->device(), " but u is on ", u.device(),
                      " (the plan's tables must be on the inputs' device)");
  }
  const int64_t S = t.parents.numel();
  TR_CHECK_VALUE(t.seg_chunk_offsets.numel() == S + 1, what, ": seg_chunk_offsets must have segments+1 = ", S + 1,
                    " entries, got ", t.seg_chunk_offsets.numel());
  TR_CHECK_VALUE(t.root_index.numel() == S, what, ": root_index must have segments = ", S, " entries, got ",
                    t.root_index.numel());
  TR_CHECK_VALUE(t.level_segments.numel() == S, what, ": level_segments must have segments = ", S, " entries, got ",
                    t.level_segments.numel());
  TR_CHECK_VALUE(t.child_offsets.numel() == S + 1, what, ": child_offsets must have segments+1 = ", S + 1,
                    " entries, got ", t.child_offsets.numel());
  const auto& lo = t.level_offsets;
  TR_CHECK_VALUE(lo.size() >= 1 && lo.front() == 0 && lo.back() == S, what,
                    ": level_offsets must run from 0 to the number of segments ", S, ", got ", lo);
  for (size_t l = 1; l < lo.size(); ++l)
    TR_CHECK_VALUE(lo[l] >= lo[l - 1], what, ": level_offsets decrease at index ", l, ": ", lo);
  const int64_t R = lo.size() >= 2 ? lo[1] : 0;
  TR_CHECK_VALUE(S == 0 || R >= 1, what, ": level 0 (the roots) is empty in level_offsets ", lo);
  TR_CHECK_VALUE(t.children.numel() == S - R, what, ": children must have one entry per non-root segment (", S - R,
                    "), got ", t.children.numel());
  TR_CHECK_VALUE(NC >= S, what, ": ", NC, " chunks for ", S, " segments (every segment has at least one chunk)");
  TR_CHECK_VALUE(S > 0 || NC == 0, what, ": ", NC, " chunks but no segments");
  bool per_root = false;
  if (initial_state) {
    const auto& h0 = *initial_state;
    TR_CHECK_TYPE(is_float(h0.scalar_type()), what, ": initial_state has dtype ", h0.scalar_type(), ", expected a float type");
    const bool shared = h0.dim() == 3 && h0.size(0) == H && h0.size(1) == K && h0.size(2) == V;
    per_root = h0.dim() == 4 && h0.size(0) == R && h0.size(1) == H && h0.size(2) == K && h0.size(3) == V;
    TR_CHECK_VALUE(shared || per_root, what, ": initial_state must be (heads=", H, ", K=", K, ", V=", V,
                      ") or (roots=", R, ", ", H, ", ", K, ", ", V, "), got ", h0.sizes());
  }
  const std::pair<const char*, const at::Tensor*> data[] = {{"kd", &kd}, {"decay", &decay}};
  for (const auto& [name, x] : data)
    TR_CHECK_VALUE(x->device() == u.device(), what, ": ", name, " is on ", x->device(), " but u is on ", u.device());
  if (w) TR_CHECK_VALUE(w->device() == u.device(), what, ": w is on ", w->device(), " but u is on ", u.device());
  if (initial_state)
    TR_CHECK_VALUE(initial_state->device() == u.device(), what, ": initial_state is on ", initial_state->device(),
                      " but u is on ", u.device());
  return {NC, H, C, K, V, S, R, per_root};
}

// The callers have checked the dtypes (floating ones): anything else would be float16, as before.
kernels::ChunkDType kernel_dtype(at::ScalarType t) {
  return sdk::kernel_dtype<kernels::ChunkDType>(t).value_or(kernels::ChunkDType::Float16);
}

kernels::ChunkStatePassParams params(const Sizes& z, const Tables& t, at::ScalarType in, at::ScalarType acc) {
  kernels::ChunkStatePassParams p;
  p.num_chunks = z.NC;
  p.heads = z.H;
  p.chunk = z.C;
  p.k_dim = z.K;
  p.v_dim = z.V;
  p.num_segments = z.S;
  p.num_roots = z.R;
  p.in = kernel_dtype(in);
  p.acc = kernel_dtype(acc);
  p.seg_chunk_offsets = t.seg_chunk_offsets.data_ptr<int64_t>();
  p.parents = t.parents.data_ptr<int64_t>();
  p.root_index = t.root_index.data_ptr<int64_t>();
  p.level_segments = t.level_segments.data_ptr<int64_t>();
  p.level_offsets = t.level_offsets.data();
  p.num_levels = static_cast<int64_t>(t.level_offsets.size()) - 1;
  p.child_offsets = t.child_offsets.data_ptr<int64_t>();
  p.children = t.children.numel() ? t.children.data_ptr<int64_t>() : nullptr;
  p.initial_per_root = z.per_root;
  return p;
}

// Runs a CPU kernel over head ranges in parallel (heads are independent; results do not depend on
// the split). Tables are validated once first, so no worker throws.
template <class Kernel>
void run_cpu(kernels::ChunkStatePassParams p, bool backward, Kernel kernel) {
  try {
    kernels::check_chunk_state_params(p, backward);
    kernels::check_chunk_state_tables_cpu(p);
  } catch (const std::invalid_argument& e) {
    TR_CHECK_VALUE(false, e.what());
  }
  at::parallel_for(0, p.heads, 1, [&](int64_t begin, int64_t end) {
    kernels::ChunkStatePassParams q = p;
    q.head_begin = begin;
    q.head_end = end;
    kernel(q);
  });
}

const void* ptr_or_null(const OptTensor& t) { return t ? t->data_ptr() : nullptr; }

// x in `type`, contiguous (an absent optional stays absent).
at::Tensor as(const at::Tensor& x, at::ScalarType type) { return x.to(type).contiguous(); }
OptTensor as(const OptTensor& x, at::ScalarType type) { return x ? OptTensor(as(*x, type)) : std::nullopt; }

// The current device set to t's while it lives, when t is a CUDA tensor.
struct DeviceGuard {
  explicit DeviceGuard(const at::Tensor& t) {
#ifdef TREE_RECURRENCE_WITH_CUDA
    if (t.is_cuda()) guard.emplace(t.device());
#else
    (void)t;
#endif
  }
#ifdef TREE_RECURRENCE_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
#endif
};

std::tuple<at::Tensor, at::Tensor> forward_impl(const OptTensor& w_in, const at::Tensor& u_in, const at::Tensor& kd_in,
                                                       const at::Tensor& decay_in, const OptTensor& h0_in,
                                                       const at::Tensor& seg_chunk_offsets, const at::Tensor& parents,
                                                       const at::Tensor& root_index, const at::Tensor& level_segments,
                                                       at::IntArrayRef level_offsets, const at::Tensor& child_offsets,
                                                       const at::Tensor& children) {
  const Tables t{seg_chunk_offsets, parents, root_index, level_segments, level_offsets, child_offsets, children};
  const Sizes z = check_args("chunk_state_pass", w_in, u_in, kd_in, decay_in, h0_in, t);
  const at::ScalarType acc = state_dtype(u_in.scalar_type());
  const bool cpu = u_in.is_cpu();
  const DeviceGuard guard(u_in);
  TR_CHECK_VALUE(cpu || u_in.is_cuda(), "chunk_state_pass: no kernel for device ", u_in.device());
  // CPU computes in the state type (half inputs widened); CUDA reads the inputs as they are.
  const at::ScalarType in = cpu ? acc : u_in.scalar_type();
  const OptTensor w = as(w_in, in), h0 = as(h0_in, acc);
  const at::Tensor u = as(u_in, in), kd = as(kd_in, in), decay = as(decay_in, acc);
  at::Tensor h = at::empty({z.NC, z.H, z.K, z.V}, u.options().dtype(acc));
  at::Tensor v_new = at::empty({z.NC, z.H, z.C, z.V}, u.options());
  at::Tensor workspace = at::empty({std::max<int64_t>(z.S * z.H * z.K * z.V, 1)}, u.options().dtype(acc));
  auto p = params(z, t, in, acc);
  p.w = ptr_or_null(w);
  p.u = u.data_ptr();
  p.kd = kd.data_ptr();
  p.decay = decay.data_ptr();
  p.initial_state = ptr_or_null(h0);
  p.h = h.data_ptr();
  p.v_new = v_new.data_ptr();
  p.workspace = workspace.data_ptr();
  if (cpu) {
    run_cpu(p, false, [](const kernels::ChunkStatePassParams& q) { kernels::chunk_state_pass_forward_cpu(q); });
    return {h, v_new.to(u_in.scalar_type())};
  }
#ifdef TREE_RECURRENCE_WITH_CUDA
  try {
    kernels::chunk_state_pass_forward_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::invalid_argument& e) {
    TR_CHECK_VALUE(false, e.what());
  }
  return {h, v_new};
#else
  TR_CHECK_VALUE(false, "chunk_state_pass: this build has no CUDA kernels");
#endif
}

// grad_w / grad_initial_state are empty (0,) tensors when w / initial_state is None.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const OptTensor& grad_h_in, const OptTensor& grad_v_new_in, const OptTensor& w_in, const at::Tensor& kd_in,
    const at::Tensor& decay_in, const at::Tensor& h_in, const at::Tensor& v_new_in, const OptTensor& h0,
    const at::Tensor& seg_chunk_offsets, const at::Tensor& parents, const at::Tensor& root_index,
    const at::Tensor& level_segments, at::IntArrayRef level_offsets, const at::Tensor& child_offsets,
    const at::Tensor& children) {
  const Tables t{seg_chunk_offsets, parents, root_index, level_segments, level_offsets, child_offsets, children};
  const Sizes z = check_args("chunk_state_pass_backward", w_in, v_new_in, kd_in, decay_in, h0, t);
  const at::ScalarType acc = state_dtype(v_new_in.scalar_type());
  TR_CHECK_VALUE(h_in.dim() == 4 && h_in.size(0) == z.NC && h_in.size(1) == z.H && h_in.size(2) == z.K &&
                        h_in.size(3) == z.V,
                    "chunk_state_pass_backward: h must be (", z.NC, ", ", z.H, ", ", z.K, ", ", z.V, "), got ", h_in.sizes());
  if (grad_h_in)
    TR_CHECK_VALUE(grad_h_in->sizes() == h_in.sizes(), "chunk_state_pass_backward: grad_h must be ", h_in.sizes(),
                      ", got ", grad_h_in->sizes());
  if (grad_v_new_in)
    TR_CHECK_VALUE(grad_v_new_in->sizes() == v_new_in.sizes(), "chunk_state_pass_backward: grad_v_new must be ",
                      v_new_in.sizes(), ", got ", grad_v_new_in->sizes());
  const bool cpu = v_new_in.is_cpu();
  const DeviceGuard guard(v_new_in);
  TR_CHECK_VALUE(cpu || v_new_in.is_cuda(), "chunk_state_pass_backward: no kernel for device ", v_new_in.device());
  const at::ScalarType in = cpu ? acc : v_new_in.scalar_type();
  const OptTensor w = as(w_in, in), grad_h = as(grad_h_in, acc), grad_v_new = as(grad_v_new_in, in);
  const at::Tensor kd = as(kd_in, in), decay = as(decay_in, acc), h = as(h_in, acc), v_new = as(v_new_in, in);
  const auto opts = v_new.options().dtype(acc);
  at::Tensor grad_u = at::empty({z.NC, z.H, z.C, z.V}, opts);
  at::Tensor grad_state = at::empty({z.NC, z.H, z.K, z.V}, opts);
  at::Tensor grad_roots = at::empty({h0 ? z.R : 0, z.H, z.K, z.V}, opts);
  at::Tensor workspace = at::empty({std::max<int64_t>(z.S * z.H * z.K * z.V, 1)}, opts);
  auto p = params(z, t, in, acc);
  p.w = ptr_or_null(w);
  p.kd = kd.data_ptr();
  p.decay = decay.data_ptr();
  p.h = h.data_ptr();
  p.v_new = v_new.data_ptr();
  p.grad_h = ptr_or_null(grad_h);
  p.grad_v_new = ptr_or_null(grad_v_new);
  p.grad_u = grad_u.data_ptr();
  p.grad_state = grad_state.data_ptr();
  p.grad_initial_roots = h0 ? grad_roots.data_ptr() : nullptr;
  p.workspace = workspace.data_ptr();
  at::Tensor decay_partial;  // CUDA: <h, dS> per V tile, summed here in a fixed order
  if (cpu) {
    run_cpu(p, true, [](const kernels::ChunkStatePassParams& q) { kernels::chunk_state_pass_backward_cpu(q); });
  } else {
#ifdef TREE_RECURRENCE_WITH_CUDA
    decay_partial = at::empty({z.NC, z.H, (z.V + 31) / 32}, opts);
    p.grad_decay_partial = decay_partial.data_ptr();
    try {
      kernels::chunk_state_pass_backward_cuda(p, c10::cuda::getCurrentCUDAStream().stream());
    } catch (const std::invalid_argument& e) {
      TR_CHECK_VALUE(false, e.what());
    }
#else
    TR_CHECK_VALUE(false, "chunk_state_pass_backward: this build has no CUDA kernels");
#endif
  }
  // The parts that reduce over V (or K and V): batched matmuls over every chunk and head at once.
  // Half-type inputs: these two products take bf16/fp16 operands (h and dS rounded, fp32
  // accumulation, tensor cores on CUDA), as FLA keeps h and dh in the input type; float32 and
  // float64 inputs stay exact in their own type.
  const at::ScalarType out = v_new_in.scalar_type();
  const at::ScalarType mm = (out == at::kBFloat16 || out == at::kHalf) ? out : acc;
  at::Tensor grad_w = w_in ? at::matmul(grad_u.to(mm), h.to(mm).transpose(-1, -2)).neg_().to(out)
                           : at::empty({0}, v_new_in.options());
  at::Tensor grad_kd = at::matmul(v_new.to(mm), grad_state.to(mm).transpose(-1, -2)).to(out);
  at::Tensor grad_decay =
      (decay_partial.defined() ? decay_partial.sum(-1) : h.mul(grad_state).sum({-2, -1})).to(decay_in.scalar_type());
  at::Tensor grad_h0 = at::empty({0}, v_new_in.options());
  if (h0) grad_h0 = (z.per_root ? grad_roots : grad_roots.sum(0)).to(h0->scalar_type());
  return {grad_w, grad_u.to(out), grad_kd, grad_decay, grad_h0};
}

// Meta kernels: shapes may be symbolic here (torch.compile, AOTAutograd), so they check ranks and
// dtypes only and build outputs from symbolic sizes; the real kernels check everything.
void check_meta(const char* what, const OptTensor& w, const at::Tensor& u, const at::Tensor& kd, const at::Tensor& decay) {
  TR_CHECK_VALUE(u.dim() == 4 && kd.dim() == 4 && decay.dim() == 2 && (!w || w->dim() == 4), what,
                    ": u, kd, w must be 4-D (chunks, heads, chunk_len, V or K) and decay 2-D (chunks, heads)");
  TR_CHECK_TYPE(is_float(u.scalar_type()) && kd.scalar_type() == u.scalar_type() && (!w || w->scalar_type() == u.scalar_type()),
                   what, ": w, u and kd must share one float dtype");
}

std::tuple<at::Tensor, at::Tensor> forward_meta(const OptTensor& w, const at::Tensor& u, const at::Tensor& kd,
                                                       const at::Tensor& decay, const OptTensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       at::IntArrayRef, const at::Tensor&, const at::Tensor&) {
  check_meta("chunk_state_pass", w, u, kd, decay);
  const auto NC = u.sym_size(0), H = u.sym_size(1), C = u.sym_size(2), V = u.sym_size(3), K = kd.sym_size(3);
  return {at::empty_symint({NC, H, K, V}, u.options().dtype(state_dtype(u.scalar_type()))),
          at::empty_symint({NC, H, C, V}, u.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_meta(
    const OptTensor&, const OptTensor&, const OptTensor& w, const at::Tensor& kd, const at::Tensor& decay,
    const at::Tensor&, const at::Tensor& v_new, const OptTensor& h0, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, at::IntArrayRef, const at::Tensor&, const at::Tensor&) {
  check_meta("chunk_state_pass_backward", w, v_new, kd, decay);
  const auto like = [](const at::Tensor& x, const at::TensorOptions& o) { return at::empty_symint(x.sym_sizes(), o); };
  return {w ? like(*w, v_new.options()) : at::empty({0}, v_new.options()), like(v_new, v_new.options()),
          like(kd, v_new.options()), like(decay, decay.options()),
          h0 ? like(*h0, h0->options()) : at::empty({0}, v_new.options())};
}

using ForwardSig = std::tuple<at::Tensor, at::Tensor>(const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, at::IntArrayRef, const at::Tensor&, const at::Tensor&);
using BackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const OptTensor&, const OptTensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const OptTensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    at::IntArrayRef, const at::Tensor&, const at::Tensor&);

OptTensor opt(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

class ChunkStateFunction : public torch::autograd::Function<ChunkStateFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const OptTensor& w, const at::Tensor& u,
                                                const at::Tensor& kd, const at::Tensor& decay, const OptTensor& h0,
                                                const at::Tensor& seg_chunk_offsets, const at::Tensor& parents,
                                                const at::Tensor& root_index, const at::Tensor& level_segments,
                                                std::vector<int64_t> level_offsets, const at::Tensor& child_offsets,
                                                const at::Tensor& children, const c10::OperatorHandle* op,
                                                const c10::OperatorHandle* backward_op) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [h, v_new] = op->typed<ForwardSig>().call(w, u, kd, decay, h0, seg_chunk_offsets, parents, root_index,
                                                    level_segments, level_offsets, child_offsets, children);
    ctx->save_for_backward({w ? *w : at::Tensor(), kd, decay, h, v_new, h0 ? *h0 : at::Tensor(), seg_chunk_offsets, parents,
                            root_index, level_segments, child_offsets, children});
    ctx->saved_data["level_offsets"] = level_offsets;
    ctx->saved_data["backward_op"] = reinterpret_cast<int64_t>(backward_op);
    ctx->saved_data["u_dtype"] = u.scalar_type();
    return {h, v_new};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto level_offsets = ctx->saved_data["level_offsets"].toIntVector();
    const auto* backward_op = reinterpret_cast<const c10::OperatorHandle*>(ctx->saved_data["backward_op"].toInt());
    auto [gw, gu, gkd, gdecay, gh0] = backward_op->typed<BackwardSig>().call(
        opt(grads[0]), opt(grads[1]), opt(s[0]), s[1], s[2], s[3], s[4], opt(s[5]), s[6], s[7], s[8], s[9], level_offsets,
        s[10], s[11]);
    const auto u_dtype = ctx->saved_data["u_dtype"].toScalarType();
    if (gu.scalar_type() != u_dtype) gu = gu.to(u_dtype);
    return {s[0].defined() ? gw : at::Tensor(), gu, gkd, gdecay, s[5].defined() ? gh0 : at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace chunk_state

// Registered by shared_ops.cpp (the library's one TORCH_LIBRARY block defines the schemas).
void define_chunk_state_ops(torch::Library& m) {
  m.def("chunk_state_pass(Tensor? w, Tensor u, Tensor kd, Tensor decay, Tensor? initial_state, Tensor seg_chunk_offsets, "
        "Tensor parents, Tensor root_index, Tensor level_segments, int[] level_offsets, Tensor child_offsets, "
        "Tensor children) -> (Tensor h, Tensor v_new)");
  m.def("chunk_state_pass_backward(Tensor? grad_h, Tensor? grad_v_new, Tensor? w, Tensor kd, Tensor decay, Tensor h, "
        "Tensor v_new, Tensor? initial_state, Tensor seg_chunk_offsets, Tensor parents, Tensor root_index, "
        "Tensor level_segments, int[] level_offsets, Tensor child_offsets, Tensor children) -> "
        "(Tensor grad_w, Tensor grad_u, Tensor grad_kd, Tensor grad_decay, Tensor grad_initial_state)");
}

namespace {

std::tuple<at::Tensor, at::Tensor> forward_autograd(const chunk_state::OptTensor& w, const at::Tensor& u, const at::Tensor& kd,
                                                    const at::Tensor& decay, const chunk_state::OptTensor& h0,
                                                    const at::Tensor& seg_chunk_offsets, const at::Tensor& parents,
                                                    const at::Tensor& root_index, const at::Tensor& level_segments,
                                                    at::IntArrayRef level_offsets, const at::Tensor& child_offsets,
                                                    const at::Tensor& children) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow(TREE_RECURRENCE_SHARED_OP("chunk_state_pass"), "");
  static const c10::OperatorHandle backward_op =
      c10::Dispatcher::singleton().findSchemaOrThrow(TREE_RECURRENCE_SHARED_OP("chunk_state_pass_backward"), "");
  auto out = chunk_state::ChunkStateFunction::apply(w, u, kd, decay, h0, seg_chunk_offsets, parents, root_index,
                                                    level_segments, level_offsets.vec(), child_offsets, children, &op,
                                                    &backward_op);
  return {out[0], out[1]};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> chunk_state_pass(const std::optional<at::Tensor>& w, const at::Tensor& u,
                                                    const at::Tensor& kd, const at::Tensor& decay,
                                                    const std::optional<at::Tensor>& initial_state,
                                                    const at::Tensor& seg_chunk_offsets, const at::Tensor& parents,
                                                    const at::Tensor& root_index, const at::Tensor& level_segments,
                                                    at::IntArrayRef level_offsets, const at::Tensor& child_offsets,
                                                    const at::Tensor& children) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(TREE_RECURRENCE_SHARED_OP("chunk_state_pass"), "")
                             .typed<chunk_state::ForwardSig>();
  return op.call(w, u, kd, decay, initial_state, seg_chunk_offsets, parents, root_index, level_segments, level_offsets,
                 child_offsets, children);
}

}  // namespace tree_recurrence

TORCH_LIBRARY_IMPL(tree_recurrence, CPU, m) {
  m.impl("chunk_state_pass", &tree_recurrence::chunk_state::forward_impl);
  m.impl("chunk_state_pass_backward", &tree_recurrence::chunk_state::backward_impl);
}

#ifdef TREE_RECURRENCE_WITH_CUDA
TORCH_LIBRARY_IMPL(tree_recurrence, CUDA, m) {
  m.impl("chunk_state_pass", &tree_recurrence::chunk_state::forward_impl);
  m.impl("chunk_state_pass_backward", &tree_recurrence::chunk_state::backward_impl);
}
#endif

TORCH_LIBRARY_IMPL(tree_recurrence, Meta, m) {
  m.impl("chunk_state_pass", &tree_recurrence::chunk_state::forward_meta);
  m.impl("chunk_state_pass_backward", &tree_recurrence::chunk_state::backward_meta);
}

TORCH_LIBRARY_IMPL(tree_recurrence, Autograd, m) { m.impl("chunk_state_pass", &tree_recurrence::forward_autograd); }
