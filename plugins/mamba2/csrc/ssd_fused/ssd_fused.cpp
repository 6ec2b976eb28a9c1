// fused::supported, fused::scan (the autograd Function around fused::forward / fused::backward) and
// the binding of ssd_tree_scan's arguments (ssd_fused.h).
//
// Backward: fused::backward, unless TREE_RECURRENCE_SSD_FUSED_BWD is "0": then the interim fallback
// recomputes the ATen composite (ssd_chunked.h, composite_scan) under autograd from the saved inputs
// and backpropagates through it, so every gradient (x, dt, B, C, A, D, dt_bias, z, initial_state) is
// exactly the composite's. The composite's state pass (chunk_state_pass) takes chunks up to
// kChunkStateMaxChunk (64): at a larger chunk the variable is ignored and the backward stays on
// fused::backward (one warning). It is not refused with an error: on the H200 an error thrown on this
// CUDA path (from the recompute in the backward thread, GPU run 3, and from a check in scan() before
// Function::apply, GPU run 4) ended the process with a segmentation fault instead of raising; that
// crash is an open bug (docs/kernels.md).
//
// Output dtype: x's (bf16 / fp16), as the kernels write it (mamba-ssm's chunk scan rounds its output
// to the input dtype too). Until this change the op widened it to fp32 (exactly), a 1.6 GB buffer and
// a cast at GRPO that the consumers narrowed right back (the family adapter: y.to(x.dtype)). The
// composite (every other path) still returns fp32 (ssd_chunked.h). A grad_out arriving in any dtype
// is handed to fused::backward in the in-type, to the interim fallback in the composite's fp32.
#include "ssd_fused.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../ssd_chunked.h"
#include "kernels/params.h"
#include "tree_recurrence/kernels/chunk_state_pass.h"  // kChunkStateMaxChunk
#include "tree_recurrence/sdk/test_ops.h"

namespace tree_recurrence::ssd::fused {
namespace {

// Diagnosis hook for errors thrown on the fused path (benchmarks/gpu/diag_throw.py: thrown errors must
// raise, not crash): with TREE_RECURRENCE_SSD_DIAG_THROW set to "scan", "forward" or "backward", a
// ValueError is thrown at that point (in scan() before Function::apply, inside ScanFn::forward, inside
// ScanFn::backward in the autograd thread). Armed only in test processes (TREE_RECURRENCE_TEST_OPS=1,
// tests/python/conftest.py and benchmarks/gpu/kernels.sh set it), so a variable left set in a user's
// environment does nothing; both variables are read once per process.
const char* diag_point() {
  static const std::string point = [] {
    const char* v = std::getenv("TREE_RECURRENCE_SSD_DIAG_THROW");
    return (v != nullptr && tree_recurrence::test_ops_enabled()) ? std::string(v) : std::string();
  }();
  return point.c_str();
}

void diag_throw(const char* where) {
  TR_CHECK_VALUE(std::strcmp(diag_point(), where) != 0, "ssd_tree_scan: TREE_RECURRENCE_SSD_DIAG_THROW=",
                 where, ": diagnostic throw in the fused path's ", where);
}

// Why the fused kernels do not take this call, or "" when they do.
std::string unsupported(const Args& a, const Tables& t) {
  if (env_is_zero("TREE_RECURRENCE_SSD_FUSED")) return "TREE_RECURRENCE_SSD_FUSED=0";
#ifndef TREE_RECURRENCE_WITH_CUDA
  (void)a;
  (void)t;
  return "built without CUDA";
#else
  const at::Tensor& x = a.x;
  if (!x.is_cuda()) return "x is not on a CUDA device";
  if (x.key_set().has(c10::DispatchKey::Python) || x.key_set().has(c10::DispatchKey::Functionalize) ||
      x.key_set().has(c10::DispatchKey::Meta))
    return "x is a traced (fake / functional / meta) tensor";
  const auto in = x.scalar_type();
  if (in != at::kBFloat16 && in != at::kHalf) return "x is neither bfloat16 nor float16";
  if (a.B.scalar_type() != in || a.C.scalar_type() != in) return "B and C do not have x's dtype";
  if (x.dim() != 3 || a.B.dim() != 3 || t.gather.dim() != 2) return "bad ranks";
  if (!kernels::fwd_shape_supported(t.gather.size(1), x.size(2), a.B.size(2)))
    return "chunk not 64/128/256, or head_dim / state not multiples of 8 up to 128 / 256";
  for (const at::Tensor* v : {&a.dt, &a.A})
    if (!at::isFloatingType(v->scalar_type()) || !v->is_cuda()) return "dt or A is not a floating CUDA tensor";
  for (const auto* o : {&a.D, &a.dt_bias, &a.z, &a.initial_state})
    if (*o && (!at::isFloatingType((*o)->scalar_type()) || (*o)->device() != x.device()))
      return "an optional input is not a floating tensor on x's device";
  if (a.z) {
    const at::Tensor z = a.z->dim() == 4 && a.z->size(0) == 1 ? (*a.z)[0] : *a.z;
    if (z.sizes() != x.sizes()) return "z is not shaped like x";
  }
  if (a.initial_state) {
    const at::Tensor& s = *a.initial_state;
    if (!((s.dim() == 3 || s.dim() == 4) && s.size(-3) == x.size(1) && s.size(-2) == x.size(2) && s.size(-1) == a.B.size(2)))
      return "initial_state is not (H, P, N) or (R, H, P, N)";
  }
  for (const at::Tensor* v : {&t.gather, &t.seg_chunk_offsets, &t.parents, &t.root_index, &t.level_segments, &t.child_offsets})
    if (v->scalar_type() != at::kLong || v->device() != x.device()) return "a chunk table is not int64 on x's device";
  if (t.level_offsets.empty()) return "level_offsets is empty";
  return "";
#endif
}

at::Tensor opt(const std::optional<at::Tensor>& v) { return v ? *v : at::Tensor(); }
std::optional<at::Tensor> some(const at::Tensor& v) { return v.defined() ? std::optional<at::Tensor>(v) : std::nullopt; }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ScanFn : public torch::autograd::Function<ScanFn> {
  // Inputs 0..4 are tensors; 5..8 optional tensors (std::optional, not undefined tensors: apply()
  // builds a VariableInfo of every at::Tensor argument, which throws "tensor does not have a
  // device" on an undefined one, while an absent optional is simply not a variable input); 9, 10
  // the Args (scalars) and Tables; 11 whether the pre-gate y is saved (false when no gradient can
  // follow: grad mode off or no input requiring grad). backward() returns one slot per argument (12), undefined for the
  // absent optionals and the two non-tensors; needs_input_grad() counts only the present tensors
  // (its index is the autograd edge: see the interim backward).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B,
                            const at::Tensor& C, const at::Tensor& A, const std::optional<at::Tensor>& D,
                            const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& z,
                            const std::optional<at::Tensor>& h0, const Args* args, const Tables* tables,
                            bool save_y) {
    diag_throw("forward");
    // y is stored only for a backward that reads it (forms_y_itself: the post kernel recomputes it)
    auto [out, saved] = fused::forward(*args, *tables, save_y && !forms_y_itself(*args, *tables));
    ctx->save_for_backward({x, dt, B, C, A, opt(D), opt(dt_bias), opt(z), opt(h0), saved.dt, saved.Lam, saved.states,
                            saved.y});
    ctx->saved_data["dt_min"] = args->dt_min;
    ctx->saved_data["dt_max"] = args->dt_max;
    ctx->saved_data["dt_softplus"] = args->dt_softplus;
    tables->save(ctx);
    return out;  // x's dtype (ssd_chunked.h: the fused path's output contract)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    diag_throw("backward");
    const variable_list sv = ctx->get_saved_variables();
    Args a;
    a.x = sv[0], a.dt = sv[1], a.B = sv[2], a.C = sv[3], a.A = sv[4];
    a.D = some(sv[5]), a.dt_bias = some(sv[6]), a.z = some(sv[7]), a.initial_state = some(sv[8]);
    a.dt_min = ctx->saved_data["dt_min"].toDouble();
    a.dt_max = ctx->saved_data["dt_max"].toDouble();
    a.dt_softplus = ctx->saved_data["dt_softplus"].toBool();
    const Tables t = Tables::load(ctx);
    at::Tensor g = grads[0];
    if (!g.defined()) g = at::zeros(a.x.sizes(), a.x.options().dtype(at::kFloat));

    variable_list out(12);
    bool interim = env_is_zero("TREE_RECURRENCE_SSD_FUSED_BWD");
    if (interim && t.gather.size(1) > tree_recurrence::kernels::kChunkStateMaxChunk) {
      // the composite takes chunk <= 64: keep the fused backward (one warning)
      TORCH_WARN_ONCE(::tree_recurrence::sdk::message::str(
          "ssd_tree_scan: TREE_RECURRENCE_SSD_FUSED_BWD=0 ignored for chunk ", t.gather.size(1),
          " (the interim backward's composite takes chunk <= ", tree_recurrence::kernels::kChunkStateMaxChunk,
          "): fused backward used"));
      interim = false;
    }
    if (!interim) {
      // Without retain_graph no later backward reads the saved y (the engine frees this node's buffers after this
      // call): the backward may write dz over it. Saved-tensor hooks that unpack to a fresh tensor (save_on_cpu,
      // checkpointing) hand over a copy, which is as much ours.
      const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
      const Saved saved{sv[9], sv[10], sv[11], sv[12], /*y_consumable=*/!keep_graph};
      const Grads gr = fused::backward(g.to(a.x.scalar_type()), a, t, saved);
      out[0] = gr.dx, out[1] = gr.ddt, out[2] = gr.dB, out[3] = gr.dC, out[4] = gr.dA;
      out[5] = gr.dD, out[6] = gr.ddt_bias, out[7] = gr.dz, out[8] = gr.d_initial_state;
      return out;
    }

    // Interim fallback: the composite recomputed under autograd.
    at::AutoGradMode enable(true);
    variable_list leaves(9);
    std::vector<at::Tensor> wanted;
    std::vector<size_t> where;
    size_t edge = 0;  // autograd edge of argument i: the present tensors before it
    for (size_t i = 0; i < 9; ++i) {
      if (!sv[i].defined()) continue;
      const bool need = ctx->needs_input_grad(edge++);
      leaves[i] = sv[i].detach().requires_grad_(need);
      if (need) wanted.push_back(leaves[i]), where.push_back(i);
    }
    if (wanted.empty()) return out;
    const std::array<double, 2> limit{a.dt_min, a.dt_max};
    const at::Tensor y = composite_scan(leaves[0], leaves[1], leaves[2], leaves[3], t.gather, t.scatter, t.seg_chunk_offsets,
                                        t.parents, t.root_index, t.level_segments, t.level_offsets, t.child_offsets,
                                        t.children, some(leaves[8]), leaves[4], limit, some(leaves[5]), some(leaves[6]),
                                        a.dt_softplus, some(leaves[7]));
    const variable_list got = torch::autograd::grad({y}, wanted, {g.to(y.scalar_type())}, /*retain_graph=*/false,
                                                    /*create_graph=*/false, /*allow_unused=*/true);
    for (size_t k = 0; k < where.size(); ++k) out[where[k]] = got[k];
    return out;
  }
};

}  // namespace

bool supported(const Args& a, const Tables& t) { return unsupported(a, t).empty(); }

at::Tensor scan(const Args& a, const Tables& t) {
  // Absent optionals as std::nullopt (also a defined-less optional would be dropped the same way).
  const auto present = [](const std::optional<at::Tensor>& v) { return some(opt(v)); };
  diag_throw("scan");
  bool grad = false;
  if (at::GradMode::is_enabled()) {
    for (const at::Tensor* v : {&a.x, &a.dt, &a.B, &a.C, &a.A}) grad = grad || v->requires_grad();
    for (const auto* o : {&a.D, &a.dt_bias, &a.z, &a.initial_state}) grad = grad || (*o && (*o)->requires_grad());
  }
  return ScanFn::apply(a.x, a.dt, a.B, a.C, a.A, present(a.D), present(a.dt_bias), present(a.z), present(a.initial_state),
                       &a, &t, /*save_y=*/grad);
}

std::pair<Args, Tables> bind(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                             TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                             const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                             const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z) {
  Args a;
  a.x = x, a.dt = dt, a.B = B, a.C = C, a.A = A;
  a.D = D, a.dt_bias = dt_bias, a.z = z, a.initial_state = initial_state;
  TR_CHECK_VALUE(dt_limit.size() == 2, "ssd_tree_scan: dt_limit must be (low, high)");
  a.dt_min = dt_limit[0], a.dt_max = dt_limit[1];
  a.dt_softplus = dt_softplus;
  return {a, Tables::of(TREE_RECURRENCE_CHUNK_TABLE_ARGS)};
}

std::vector<at::Tensor> stages_op(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                                  TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                                  const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                                  const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z) {
  auto [a, t] = bind(x, dt, B, C, TREE_RECURRENCE_CHUNK_TABLE_ARGS, initial_state, A, dt_limit, D, dt_bias, dt_softplus, z);
  const std::string why = unsupported(a, t);
  TR_CHECK_VALUE(why.empty(), "ssd_fused_stages: the fused kernels do not take this call: ", why);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out = forward_stages(a, t);
  if (!out[5].defined()) out[5] = at::empty({0}, x.options());
  return out;
}

}  // namespace tree_recurrence::ssd::fused
