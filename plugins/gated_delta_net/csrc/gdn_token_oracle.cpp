#include "gdn_token_oracle.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include "tree_recurrence/sdk/delta_rule.h"
#include "tree_recurrence/sdk/segment_walk.h"

#include <cmath>
#include <vector>

namespace tree_recurrence::gdn {
namespace {

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
           const at::Tensor& seg_offsets, const at::Tensor& parents) {
  TR_CHECK_VALUE(q.dim() == 3 && k.sizes() == q.sizes(), "gdn_token_scan: q and k must be (tokens, heads, key_dim) alike, got ",
                    q.sizes(), " and ", k.sizes());
  TR_CHECK_VALUE(v.dim() == 3 && v.size(0) == q.size(0), "gdn_token_scan: v must be (tokens, value_heads, value_dim), got ",
                    v.sizes());
  TR_CHECK_VALUE(v.size(1) % q.size(1) == 0, "gdn_token_scan: value heads ", v.size(1), " must be a multiple of key heads ",
                    q.size(1));
  for (const at::Tensor* t : {&g, &beta})
    TR_CHECK_VALUE(t->dim() == 2 && t->size(0) == v.size(0) && t->size(1) == v.size(1),
                      "gdn_token_scan: g and beta must be (tokens, value_heads)=", v.size(0), "x", v.size(1), ", got ", t->sizes());
  TR_CHECK_VALUE(seg_offsets.is_cpu() && parents.is_cpu() && seg_offsets.scalar_type() == at::kLong &&
                        parents.scalar_type() == at::kLong,
                    "gdn_token_scan: seg_offsets and parents must be int64 CPU tensors (the plan's host arrays)");
  TR_CHECK_VALUE(seg_offsets.numel() == parents.numel() + 1, "gdn_token_scan: seg_offsets must have one more entry than parents");
  TR_CHECK_VALUE(seg_offsets.numel() >= 2 && seg_offsets.data_ptr<int64_t>()[seg_offsets.numel() - 1] == q.size(0),
                    "gdn_token_scan: seg_offsets must end at the number of tokens ", q.size(0));
}

}  // namespace

at::Tensor token_oracle(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                      const at::Tensor& beta_in, const at::Tensor& seg_offsets, const at::Tensor& parents,
                      const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm) {
  check(q_in, k_in, v_in, g_in, beta_in, seg_offsets, parents);
  // fp32 states, as the library kernels; float64 when the values are float64 (exact tests).
  const at::ScalarType compute = v_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto qk = token_scan_qk(q_in, k_in, v_in.size(1), compute, scale, use_qk_l2norm);  // l2norm: x * rsqrt
  const at::Tensor q = qk.first, k = qk.second;
  const at::Tensor v = v_in.to(compute), decay = g_in.to(compute).exp(), beta = beta_in.to(compute);
  const int64_t HV = v.size(1), K = q.size(2), V = v.size(2);
  std::vector<at::Tensor> outputs(q.size(0));
  // Per-token slices from one unbind each: its backward stacks every token's gradient at once
  // (indexing q[t] in the loop would allocate a full-size gradient per token).
  const std::vector<at::Tensor> qs = q.unbind(0), ks = k.unbind(0), vs = v.unbind(0), decays = decay.unbind(0),
                                betas = beta.unbind(0);
  walk_segments("gdn_token_scan", seg_offsets, parents, initial_state, {HV, K, V}, v.options(), [&](at::Tensor state, int64_t t) {
    const at::Tensor kt = ks[t].unsqueeze(-1);  // (HV, K, 1)
    state = state * decays[t].view({HV, 1, 1});
    const at::Tensor remembered = (state * kt).sum(1);  // (HV, V)
    const at::Tensor delta = (vs[t] - remembered) * betas[t].unsqueeze(-1);
    state = state + kt * delta.unsqueeze(1);
    outputs[t] = (state * qs[t].unsqueeze(-1)).sum(1);  // (HV, V)
    return state;
  });
  return at::stack(outputs).to(v_in.scalar_type());
}

}  // namespace tree_recurrence::gdn
