// The tree conv as torch ops of the shared ops library (libtree_recurrence_ops.so): tree_recurrence::tree_conv
// and ::tree_conv_backward, defined once for every family (CPU, CUDA, Meta, Autograd), and the C++ entry point
// tree_recurrence::tree_conv (sdk/tree_conv_op.h, which gives the schema).
#include "shared_ops_internal.h"

#include <ATen/core/Tensor.h>
#include "tree_recurrence/sdk/check.h"
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "tree_recurrence/kernels/tree_conv.h"
#include "tree_recurrence/sdk/element_type.h"
#include "tree_recurrence/sdk/tree_conv_op.h"

namespace tree_recurrence {
namespace conv_op {

kernels::DType kernel_dtype(const at::Tensor& t) {
  const auto dtype = sdk::kernel_dtype<kernels::DType>(t.scalar_type());
  TR_CHECK_TYPE(dtype.has_value(), "tree_conv: x has dtype ", t.scalar_type(), ", expected float32, float64, bfloat16 or float16");
  return *dtype;
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& ancestors) {
  kernel_dtype(x);  // refuses integer and bool inputs before anything is converted
  TR_CHECK_VALUE(x.dim() == 2, "tree_conv: x must be (tokens, channels), got ", x.sizes());
  TR_CHECK_VALUE(weight.dim() == 2 && weight.size(0) == x.size(1),
                    "tree_conv: weight must be (channels=", x.size(1), ", width), got ", weight.sizes());
  const int64_t W = weight.size(1);
  TR_CHECK_VALUE(W >= 1 && W <= kernels::kTreeConvMaxWidth, "tree_conv: width ", W, " not in [1, ",
                    kernels::kTreeConvMaxWidth, "]");
  TR_CHECK_VALUE(ancestors.dim() == 2 && ancestors.size(0) == x.size(0) && ancestors.size(1) == W - 1,
                    "tree_conv: ancestors must be (tokens=", x.size(0), ", width-1=", W - 1, "), got ", ancestors.sizes());
  TR_CHECK_TYPE(ancestors.scalar_type() == at::kLong, "tree_conv: ancestors must be int64");
  if (bias) TR_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == x.size(1), "tree_conv: bias must be (channels), got ", bias->sizes());
  for (const at::Tensor* t : {&weight, &ancestors})
    TR_CHECK_VALUE(t->device() == x.device(), "tree_conv: all tensors must be on ", x.device(), ", got one on ", t->device());
  if (bias) TR_CHECK_VALUE(bias->device() == x.device(), "tree_conv: bias is on ", bias->device(), ", x on ", x.device());
}

// CPU kernels compute in float32 or float64; half types are widened and rounded back.
at::Tensor cpu_compute(const at::Tensor& t) {
  return (t.scalar_type() == at::kDouble ? t : t.to(at::kFloat)).contiguous();
}

kernels::TreeConvParams params(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                      const at::Tensor& ancestors, bool silu) {
  kernels::TreeConvParams p;
  p.num_tokens = x.size(0);
  p.channels = x.size(1);
  p.width = weight.size(1);
  p.ancestors = p.width > 1 ? ancestors.data_ptr<int64_t>() : nullptr;
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias ? bias->data_ptr() : nullptr;
  p.silu = silu;
  return p;
}

// A kernel call's inputs: x as the caller converted it (the kernel's dtype), weight and bias in x's dtype,
// all contiguous, and the params pointing at them (outputs and gradients set by the caller).
struct Call {
  at::Tensor x, weight;
  std::optional<at::Tensor> bias;
  at::Tensor ancestors;
  kernels::TreeConvParams p;
};

Call prepare(const at::Tensor& x, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
                    const at::Tensor& ancestors_in, bool silu) {
  Call c{x, weight_in.to(x.scalar_type()).contiguous(),
         bias_in ? std::optional<at::Tensor>(bias_in->to(x.scalar_type()).contiguous()) : std::nullopt,
         ancestors_in.contiguous(), {}};
  c.p = params(c.x, c.weight, c.bias, c.ancestors, silu);
  return c;
}

// The backward's buffers (grad_y in x's dtype; fp32 weight and bias gradients), set in c.p.
struct BackwardBuffers {
  at::Tensor grad_y, grad_x, grad_w, grad_b;
};

BackwardBuffers backward_buffers(Call& c, const at::Tensor& grad_y_in) {
  BackwardBuffers b{grad_y_in.to(c.x.scalar_type()).contiguous(), at::empty_like(c.x),
                    at::zeros(c.weight.sizes(), c.x.options().dtype(at::kFloat)),
                    at::zeros({c.x.size(1)}, c.x.options().dtype(at::kFloat))};
  c.p.grad_y = b.grad_y.data_ptr();
  c.p.grad_x = b.grad_x.data_ptr();
  c.p.grad_weight = b.grad_w.data_ptr<float>();
  c.p.grad_bias = c.bias ? b.grad_b.data_ptr<float>() : nullptr;
  return b;
}

// Runs a kernel launcher; its std::invalid_argument (the kernels' argument errors) as a ValueError.
template <class Launch>
void run_kernel(Launch&& launch) {
  try {
    launch();
  } catch (const std::invalid_argument& e) {
    TR_CHECK_VALUE(false, e.what());
  }
}

at::Tensor forward_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
                              const at::Tensor& ancestors_in, const at::Tensor&, const at::Tensor&, bool silu) {
  check_inputs(x_in, weight_in, bias_in, ancestors_in);
  Call c = prepare(cpu_compute(x_in), weight_in, bias_in, ancestors_in, silu);
  at::Tensor y = at::empty_like(c.x);
  c.p.y = y.data_ptr();
  run_kernel([&] { kernels::tree_conv_forward_cpu(c.p, kernel_dtype(c.x)); });
  return y.to(x_in.scalar_type());
}

// Returns (grad_x, grad_weight, grad_bias) in the inputs' dtypes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cpu(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                                    const at::Tensor& weight_in,
                                                                    const std::optional<at::Tensor>& bias_in,
                                                                    const at::Tensor& ancestors_in, const at::Tensor&,
                                                                    const at::Tensor&, bool silu) {
  Call c = prepare(cpu_compute(x_in), weight_in, bias_in, ancestors_in, silu);
  const BackwardBuffers b = backward_buffers(c, grad_y_in);
  run_kernel([&] { kernels::tree_conv_backward_cpu(c.p, kernel_dtype(c.x)); });
  return {b.grad_x.to(x_in.scalar_type()), b.grad_w.to(weight_in.scalar_type()),
          bias_in ? b.grad_b.to(bias_in->scalar_type()) : at::Tensor()};
}

#ifdef TREE_RECURRENCE_WITH_CUDA
at::Tensor forward_cuda(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias_in,
                               const at::Tensor& ancestors_in, const at::Tensor&, const at::Tensor&, bool silu) {
  check_inputs(x_in, weight_in, bias_in, ancestors_in);
  c10::cuda::CUDAGuard guard(x_in.device());
  Call c = prepare(x_in.contiguous(), weight_in, bias_in, ancestors_in, silu);
  at::Tensor y = at::empty_like(c.x);
  c.p.y = y.data_ptr();
  run_kernel([&] { kernels::tree_conv_forward_cuda(c.p, kernel_dtype(c.x), c10::cuda::getCurrentCUDAStream().stream()); });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_cuda(const at::Tensor& grad_y_in, const at::Tensor& x_in,
                                                                     const at::Tensor& weight_in,
                                                                     const std::optional<at::Tensor>& bias_in,
                                                                     const at::Tensor& ancestors_in, const at::Tensor& reader_offsets,
                                                                     const at::Tensor& readers, bool silu) {
  c10::cuda::CUDAGuard guard(x_in.device());
  Call c = prepare(x_in.contiguous(), weight_in, bias_in, ancestors_in, silu);
  const BackwardBuffers b = backward_buffers(c, grad_y_in);
  const int64_t ws = kernels::tree_conv_backward_cuda_workspace_floats(c.x.size(0), c.x.size(1), c.weight.size(1));
  at::Tensor workspace = at::empty({std::max<int64_t>(ws, 1)}, c.x.options().dtype(at::kFloat));
  c.p.reader_offsets = reader_offsets.data_ptr<int64_t>();
  c.p.readers = readers.data_ptr<int64_t>();
  c.p.workspace = workspace.data_ptr<float>();
  run_kernel([&] { kernels::tree_conv_backward_cuda(c.p, kernel_dtype(c.x), c10::cuda::getCurrentCUDAStream().stream()); });
  return {b.grad_x, b.grad_w.to(weight_in.scalar_type()), bias_in ? b.grad_b.to(bias_in->scalar_type()) : at::Tensor()};
}
#endif

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_any(const at::Tensor& grad_y, const at::Tensor& x,
                                                                    const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                                                    const at::Tensor& ancestors, const at::Tensor& reader_offsets,
                                                                    const at::Tensor& readers, bool silu) {
#ifdef TREE_RECURRENCE_WITH_CUDA
  if (x.is_cuda()) return backward_cuda(grad_y, x, weight, bias, ancestors, reader_offsets, readers, silu);
#endif
  TR_CHECK_VALUE(x.is_cpu(), "tree_conv: no kernel for device ", x.device(), " in this build");
  return backward_cpu(grad_y, x, weight, bias, ancestors, reader_offsets, readers, silu);
}

// The backward as an op of its own (CPU, CUDA, Meta), so autograd reaches it through the dispatcher
// and tracing with fake tensors (torch.compile, AOTAutograd) sees shapes, not data pointers.
// The bias gradient is always returned (zeros without a bias) so the schema has no optional output.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_op(const at::Tensor& grad_y, const at::Tensor& x,
                                                                   const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                                                   const at::Tensor& ancestors, const at::Tensor& reader_offsets,
                                                                   const at::Tensor& readers, bool silu) {
  auto [gx, gw, gb] = backward_any(grad_y, x, weight, bias, ancestors, reader_offsets, readers, silu);
  if (!gb.defined()) gb = at::zeros({x.size(1)}, x.options());
  return {gx, gw, gb};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_meta(const at::Tensor&, const at::Tensor& x,
                                                                     const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                                                                     const at::Tensor&, const at::Tensor&, const at::Tensor&, bool) {
  return {at::empty_like(x), at::empty_like(weight), bias ? at::empty_like(*bias) : at::empty({x.size(1)}, x.options())};
}

class TreeConvFunction : public torch::autograd::Function<TreeConvFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, const at::Tensor& ancestors, const at::Tensor& reader_offsets,
                            const at::Tensor& readers, bool silu, const c10::OperatorHandle* op) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({x, weight, bias ? *bias : at::Tensor(), ancestors, reader_offsets, readers});
    ctx->saved_data["silu"] = silu;
    ctx->saved_data["has_bias"] = bias.has_value();
    return op->typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, bool)>()
        .call(x, weight, bias, ancestors, reader_offsets, readers, silu);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    std::optional<at::Tensor> bias = has_bias ? std::optional<at::Tensor>(saved[2]) : std::nullopt;
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow(TREE_RECURRENCE_SHARED_OP("tree_conv_backward"), "")
                               .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
    auto [gx, gw, gb] = op.call(grads[0].contiguous(), saved[0], saved[1], bias, saved[3], saved[4], saved[5],
                                ctx->saved_data["silu"].toBool());
    return {gx, gw, has_bias ? gb : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor forward_meta(const at::Tensor& x, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, bool) {
  return at::empty_like(x);
}

at::Tensor forward_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const at::Tensor& ancestors, const at::Tensor& reader_offsets, const at::Tensor& readers,
                            bool silu) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow(TREE_RECURRENCE_SHARED_OP("tree_conv"), "");
  return TreeConvFunction::apply(x, weight, bias, ancestors, reader_offsets, readers, silu, &op);
}

}  // namespace conv_op

void define_tree_conv_ops(torch::Library& m) {
  m.def("tree_conv(Tensor x, Tensor weight, Tensor? bias, Tensor ancestors, Tensor reader_offsets, Tensor readers, bool silu) -> Tensor");
  m.def("tree_conv_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor? bias, Tensor ancestors, Tensor reader_offsets, "
        "Tensor readers, bool silu) -> (Tensor, Tensor, Tensor)");
}

at::Tensor tree_conv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     const at::Tensor& ancestors, const at::Tensor& reader_offsets, const at::Tensor& readers, bool silu) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(TREE_RECURRENCE_SHARED_OP("tree_conv"), "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                               const at::Tensor&, const at::Tensor&, const at::Tensor&, bool)>();
  return op.call(x, weight, bias, ancestors, reader_offsets, readers, silu);
}

}  // namespace tree_recurrence

TORCH_LIBRARY_IMPL(tree_recurrence, CPU, m) {
  m.impl("tree_conv", &tree_recurrence::conv_op::forward_cpu);
  m.impl("tree_conv_backward", &tree_recurrence::conv_op::backward_op);
}

#ifdef TREE_RECURRENCE_WITH_CUDA
TORCH_LIBRARY_IMPL(tree_recurrence, CUDA, m) {
  m.impl("tree_conv", &tree_recurrence::conv_op::forward_cuda);
  m.impl("tree_conv_backward", &tree_recurrence::conv_op::backward_op);
}
#endif

TORCH_LIBRARY_IMPL(tree_recurrence, Meta, m) {
  m.impl("tree_conv", &tree_recurrence::conv_op::forward_meta);
  m.impl("tree_conv_backward", &tree_recurrence::conv_op::backward_meta);
}

TORCH_LIBRARY_IMPL(tree_recurrence, Autograd, m) { m.impl("tree_conv", &tree_recurrence::conv_op::forward_autograd); }
