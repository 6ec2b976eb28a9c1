#include "gdn_token_oracle.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include "tree_recurrence/sdk/delta_rule.h"
#include "tree_recurrence/sdk/segment_walk.h"

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
  check_token_tables("gdn_token_scan", seg_offsets, parents, q.size(0));
}

}  // namespace

at::Tensor token_oracle(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                      const at::Tensor& beta_in, const at::Tensor& seg_offsets, const at::Tensor& parents,
                      const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm) {
  check(q_in, k_in, v_in, g_in, beta_in, seg_offsets, parents);
  // fp32 states, as the library kernels; float64 when the values are float64 (exact tests).
  const at::ScalarType compute = v_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto qk = token_scan_qk(q_in, k_in, v_in.size(1), compute, scale, use_qk_l2norm);  // l2norm: x * rsqrt
  // one gate per head: decay (T, HV, 1, 1)
  return delta_rule_token_walk("gdn_token_scan", qk.first, qk.second, v_in.to(compute),
                               g_in.to(compute).exp().unsqueeze(-1).unsqueeze(-1), beta_in.to(compute).unsqueeze(-1),
                               seg_offsets, parents, initial_state, v_in.scalar_type());
}

}  // namespace tree_recurrence::gdn
