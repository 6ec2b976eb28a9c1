#include "kda_tree_scan.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include "tree_recurrence/sdk/delta_rule.h"
#include "tree_recurrence/sdk/segment_walk.h"

namespace kimi_linear {
namespace {

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
           const at::Tensor& seg_offsets, const at::Tensor& parents) {
  tree_recurrence::check_token_scan_inputs("kda_tree_scan", q, k, v, beta, seg_offsets, parents);
  TR_CHECK_VALUE(g.dim() == 3 && g.size(0) == v.size(0) && g.size(1) == v.size(1) && g.size(2) == q.size(2),
                    "kda_tree_scan: g must be (tokens, value_heads, key_dim)=(", v.size(0), ", ", v.size(1), ", ", q.size(2),
                    ") (one log decay per key channel), got ", g.sizes());
  for (const at::Tensor* t : {&k, &v, &g, &beta})
    TR_CHECK_VALUE(t->device() == q.device(), "kda_tree_scan: all tensors must be on ", q.device(), ", got one on ",
                      t->device());
}

}  // namespace

at::Tensor tree_scan(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                     const at::Tensor& beta_in, const at::Tensor& seg_offsets, const at::Tensor& parents,
                     const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm) {
  check(q_in, k_in, v_in, g_in, beta_in, seg_offsets, parents);
  // fp32 states, as the library kernels (float64 for float64 values); one decay per key channel. The l2norm
  // is transformers' KDA one (x / sqrt(sum(x^2) + 1e-6)), matching FLA's.
  return tree_recurrence::delta_rule_token_scan("kda_tree_scan", q_in, k_in, v_in, g_in, beta_in, seg_offsets, parents,
                                                initial_state, scale, use_qk_l2norm, &tree_recurrence::l2norm_div);
}

}  // namespace kimi_linear
