// The fused GDN path's dispatch test and its autograd function (issue 19; gdn_fused.h).
#include "gdn_fused.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <array>
#include <utility>

#include "../gdn_chunked.h"
#include "tree_recurrence/sdk/check.h"

namespace tree_recurrence::gdn::fused {
namespace {

bool half_type(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The stage buffers ScanFunction keeps in saved_data (key, field of Saved).
std::array<std::pair<const char*, at::Tensor*>, 5> stage_buffers(Saved& sv) {
  return {{{"Ainv", &sv.Ainv}, {"w", &sv.w}, {"kd", &sv.kd}, {"h", &sv.h}, {"v_new", &sv.v_new}}};
}

struct ScanFunction : public torch::autograd::Function<ScanFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& g, const at::Tensor& beta, const Tables& tables,
                            const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm) {
    auto [o, sv] = fused::forward(q, k, v, g, beta, tables, initial_state, scale, use_qk_l2norm);
    const bool has_init = initial_state.has_value() && initial_state->defined();
    ctx->save_for_backward({q, k, v, g, beta, has_init ? *initial_state : at::Tensor(), sv.G, sv.rq, sv.rk});
    // The large stage buffers ride in saved_data, not save_for_backward, so that the backward can drop
    // each one after its last reader (a SavedVariable lives until the node releases all of them, after
    // the backward returned): w, kd after the state pass, Ainv, h, v_new after the WY stage. (Not
    // outputs or inputs of this node, so no version counter to check; saved-tensor hooks do not see them.)
    for (const auto& [key, buf] : stage_buffers(sv)) ctx->saved_data[key] = *buf;
    tables.save(ctx);
    ctx->saved_data["has_init"] = has_init;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["use_qk_l2norm"] = use_qk_l2norm;
    return o;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3], &beta = saved[4];
    const bool has_init = ctx->saved_data["has_init"].toBool();
    const std::optional<at::Tensor> init = has_init ? std::optional<at::Tensor>(saved[5]) : std::nullopt;
    const Tables t = Tables::load(ctx);
    const double scale = ctx->saved_data["scale"].toDouble();
    const bool l2 = ctx->saved_data["use_qk_l2norm"].toBool();
    const at::Tensor grad_o = grads[0].defined() ? grads[0] : at::zeros_like(v);

    // edges: q, k, v, g, beta, initial_state (when given)
    bool need[6];
    for (int i = 0; i < 5; ++i) need[i] = ctx->needs_input_grad(i);
    need[5] = has_init && ctx->needs_input_grad(5);

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
    Grads gr;
    if (!env_is_zero("TREE_RECURRENCE_GDN_FUSED_BWD")) {
      sv.G = saved[6];
      sv.rq = saved[7];
      sv.rk = saved[8];
      gr = fused::backward(grad_o, q, k, v, g, beta, t, init, scale, l2, std::move(sv));
    } else {
      sv = Saved();  // unused here
      // Interim fallback: the composite recomputed on fp32 copies, differentiated by autograd (the
      // composite's own gradients: it widens bf16 / fp16 inputs to fp32 the same way).
      at::AutoGradMode enable(true);
      auto leaf = [](const at::Tensor& x, bool req) { return x.detach().to(at::kFloat).requires_grad_(req); };
      const at::Tensor q32 = leaf(q, need[0]), k32 = leaf(k, need[1]), v32 = leaf(v, need[2]), g32 = leaf(g, need[3]),
                       b32 = leaf(beta, need[4]);
      std::optional<at::Tensor> i32;
      if (has_init) i32 = leaf(*init, need[5]);
      const at::Tensor o = composite_scan(q32, k32, v32, g32, b32, t.gather, t.scatter, t.seg_chunk_offsets, t.parents,
                                          t.root_index, t.level_segments, t.level_offsets, t.child_offsets, t.children,
                                          i32, scale, l2);
      std::vector<at::Tensor> inputs;
      const at::Tensor* all[6] = {&q32, &k32, &v32, &g32, &b32, has_init ? &*i32 : nullptr};
      for (int i = 0; i < 6; ++i)
        if (need[i]) inputs.push_back(*all[i]);
      std::vector<at::Tensor> got;
      if (!inputs.empty())
        got = torch::autograd::grad({o}, inputs, {grad_o.to(at::kFloat)}, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
      at::Tensor* out[6] = {&gr.dq, &gr.dk, &gr.dv, &gr.dg, &gr.dbeta, &gr.d_initial_state};
      const at::Tensor* like[6] = {&q, &k, &v, &g, &beta, has_init ? &*init : nullptr};
      size_t n = 0;
      for (int i = 0; i < 6; ++i)
        if (need[i]) {
          at::Tensor d = got[n++];
          if (!d.defined()) d = at::zeros_like(*all[i]);
          *out[i] = d.to(like[i]->scalar_type());
        }
    }
    auto keep = [&](const at::Tensor& d, int i) { return need[i] ? d : at::Tensor(); };
    // one entry per forward argument: q, k, v, g, beta, tables, initial_state, scale, use_qk_l2norm
    return {keep(gr.dq, 0), keep(gr.dk, 1), keep(gr.dv, 2), keep(gr.dg, 3), keep(gr.dbeta, 4), at::Tensor(),
            has_init ? keep(gr.d_initial_state, 5) : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
               const at::Tensor& gather) {
  if (env_is_zero("TREE_RECURRENCE_GDN_FUSED")) return false;
  if (!q.is_cuda() || !k.is_cuda() || !v.is_cuda()) return false;
  const auto dt = v.scalar_type();
  if (!half_type(dt) || q.scalar_type() != dt || k.scalar_type() != dt) return false;
  for (const at::Tensor* t : {&g, &beta})
    if (t->scalar_type() != at::kFloat && t->scalar_type() != dt) return false;
  if (gather.dim() != 2 || gather.size(1) != 64) return false;
  const int64_t K = q.size(2), V = v.size(2);
  if (K % 8 != 0 || K < 8 || K > 128 || V % 8 != 0 || V < 8 || V > 128) return false;
  if (v.size(1) > 65535 || gather.size(0) >= (int64_t{1} << 31)) return false;
  return true;
}

at::Tensor scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                const Tables& tables, const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm) {
  return ScanFunction::apply(q, k, v, g, beta, tables, initial_state, scale, use_qk_l2norm);
}

}  // namespace tree_recurrence::gdn::fused
