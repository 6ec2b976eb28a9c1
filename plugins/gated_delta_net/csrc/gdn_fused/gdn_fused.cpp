// The fused GDN path's dispatch test and its autograd function (gdn_fused.h).
#include "gdn_fused.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <array>
#include <utility>

#include "tree_recurrence/sdk/check.h"
#include "tree_recurrence/sdk/settings.h"

namespace tree_recurrence::gdn::fused {
namespace {

bool half_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The stage buffers ScanFunction keeps in saved_data (key, field of Saved).
std::array<std::pair<const char*, at::Tensor*>, 5> stage_buffers(Saved& sv) {
  return {{{"Ainv", &sv.Ainv}, {"w", &sv.w}, {"kd", &sv.kd}, {"h", &sv.h}, {"v_new", &sv.v_new}}};
}

// Inputs: the differentiable tensors (q, k, v, g, beta, initial_state: the node's edges), then the
// arguments themselves (their scalars and tables; the tensors in them are the same).
struct ScanFunction : public torch::autograd::Function<ScanFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const GdnArgs& a) {
    auto [o, sv] = fused::forward(a);
    a.save(ctx, {sv.G, sv.rq, sv.rk});
    // The large stage buffers ride in saved_data, not save_for_backward, so that the backward can drop
    // each one after its last reader (a SavedVariable lives until the node releases all of them, after
    // the backward returned): w, kd after the state pass, Ainv, h, v_new after the WY stage. (Not
    // outputs or inputs of this node, so no version counter to check; saved-tensor hooks do not see them.)
    for (const auto& [key, buf] : stage_buffers(sv)) ctx->saved_data[key] = *buf;
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [a, extra] = GdnArgs::load(ctx);
    const at::Tensor grad_o = grads[0].defined() ? grads[0] : at::zeros_like(a.v);

    // edges: q, k, v, g, beta, initial_state (when given)
    bool need[6];
    for (int i = 0; i < 5; ++i) need[i] = ctx->needs_input_grad(i);
    need[5] = a.has_initial_state() && ctx->needs_input_grad(5);

    // The stage buffers: without retain_graph (the engine frees this node's buffers after this call
    // anyway) they are handed over, so fused::backward frees each after its last reader; with
    // retain_graph=True they stay here (a later backward through the graph needs them; this
    // backward's peak then keeps w, kd to the end).
    const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
    Saved sv;
    for (const auto& [key, buf] : stage_buffers(sv)) {
      auto it = ctx->saved_data.find(key);
      TR_CHECK(it != ctx->saved_data.end() && it->second.isTensor(), "gdn_tree_scan (fused backward): the saved "
               "buffer ", key, " is gone: an earlier backward through this graph without retain_graph=True "
               "released it (it frees the stage buffers as it goes); pass retain_graph=True to every backward "
               "but the last");
      *buf = it->second.toTensor();
      if (!keep_graph) ctx->saved_data.erase(it);
    }
    sv.G = extra[0];
    sv.rq = extra[1];
    sv.rk = extra[2];
    const Grads gr = fused::backward(grad_o, a, std::move(sv));
    auto keep = [&](const at::Tensor& d, int i) { return need[i] ? d : at::Tensor(); };
    // one entry per forward argument: q, k, v, g, beta, initial_state, the arguments
    return {keep(gr.dq, 0), keep(gr.dk, 1), keep(gr.dv, 2), keep(gr.dg, 3), keep(gr.dbeta, 4),
            a.has_initial_state() ? keep(gr.d_initial_state, 5) : at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool supported(const GdnArgs& a) {
  const at::Tensor &q = a.q, &k = a.k, &v = a.v, &gather = a.tables.gather;
  if (!settings::fused_kernels()) return false;
  if (!q.is_cuda() || !k.is_cuda() || !v.is_cuda()) return false;
  const auto dt = v.scalar_type();
  if (!half_type(dt) || q.scalar_type() != dt || k.scalar_type() != dt) return false;
  for (const at::Tensor* t : {&a.g, &a.beta})
    if (t->scalar_type() != at::kFloat && t->scalar_type() != dt) return false;
  if (gather.dim() != 2 || gather.size(1) != 64) return false;
  const int64_t K = q.size(2), V = v.size(2);
  if (K % 8 != 0 || K < 8 || K > 128 || V % 8 != 0 || V < 8 || V > 128) return false;
  if (v.size(1) > 65535 || gather.size(0) >= (int64_t{1} << 31)) return false;
  return true;
}

at::Tensor scan(const GdnArgs& a) {
  return ScanFunction::apply(a.q, a.k, a.v, a.g, a.beta, a.initial_state, a);
}

}  // namespace tree_recurrence::gdn::fused
