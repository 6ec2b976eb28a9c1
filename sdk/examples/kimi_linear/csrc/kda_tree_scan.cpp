#include "kda_tree_scan.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include "tree_recurrence/sdk/delta_rule.h"
#include "tree_recurrence/sdk/segment_walk.h"

namespace kimi_linear {
namespace {

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
           const at::Tensor& seg_offsets, const at::Tensor& parents) {
  TR_CHECK_VALUE(q.dim() == 3 && k.sizes() == q.sizes(), "kda_tree_scan: q and k must be (tokens, heads, key_dim) alike, got ",
                    q.sizes(), " and ", k.sizes());
  TR_CHECK_VALUE(v.dim() == 3 && v.size(0) == q.size(0), "kda_tree_scan: v must be (tokens=", q.size(0),
                    ", value_heads, value_dim), got ", v.sizes());
  TR_CHECK_VALUE(q.size(1) > 0 && v.size(1) % q.size(1) == 0, "kda_tree_scan: value heads ", v.size(1),
                    " must be a multiple of key heads ", q.size(1));
  TR_CHECK_VALUE(g.dim() == 3 && g.size(0) == v.size(0) && g.size(1) == v.size(1) && g.size(2) == q.size(2),
                    "kda_tree_scan: g must be (tokens, value_heads, key_dim)=(", v.size(0), ", ", v.size(1), ", ", q.size(2),
                    ") (one log decay per key channel), got ", g.sizes());
  TR_CHECK_VALUE(beta.dim() == 2 && beta.size(0) == v.size(0) && beta.size(1) == v.size(1),
                    "kda_tree_scan: beta must be (tokens, value_heads)=(", v.size(0), ", ", v.size(1), "), got ", beta.sizes());
  for (const at::Tensor* t : {&k, &v, &g, &beta})
    TR_CHECK_VALUE(t->device() == q.device(), "kda_tree_scan: all tensors must be on ", q.device(), ", got one on ",
                      t->device());
  tree_recurrence::check_token_tables("kda_tree_scan", seg_offsets, parents, q.size(0));
}

}  // namespace

at::Tensor tree_scan(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                     const at::Tensor& beta_in, const at::Tensor& seg_offsets, const at::Tensor& parents,
                     const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm) {
  check(q_in, k_in, v_in, g_in, beta_in, seg_offsets, parents);
  // fp32 states, as the library kernels; float64 when the values are float64 (exact tests). The l2norm is
  // transformers' KDA one (x / sqrt(sum(x^2) + 1e-6)), matching FLA's.
  const at::ScalarType compute = v_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto qk = tree_recurrence::token_scan_qk(q_in, k_in, v_in.size(1), compute, scale, use_qk_l2norm,
                                                 &tree_recurrence::l2norm_div);
  // one decay per key channel: decay (T, HV, K, 1)
  return tree_recurrence::delta_rule_token_walk("kda_tree_scan", qk.first, qk.second, v_in.to(compute),
                                                g_in.to(compute).exp().unsqueeze(-1), beta_in.to(compute).unsqueeze(-1),
                                                seg_offsets, parents, initial_state, v_in.scalar_type());
}

}  // namespace kimi_linear
