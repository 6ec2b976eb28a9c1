#include "gdn_token_oracle.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include "tree_recurrence/sdk/delta_rule.h"
#include "tree_recurrence/sdk/segment_walk.h"

namespace tree_recurrence::gdn {
namespace {

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
           const at::Tensor& seg_offsets, const at::Tensor& parents) {
  check_token_scan_inputs("gdn_token_scan", q, k, v, beta, seg_offsets, parents);
  TR_CHECK_VALUE(g.sizes() == beta.sizes(), "gdn_token_scan: g must be (tokens, value_heads)=(", v.size(0), ", ", v.size(1),
                 ") (one log decay per head), got ", g.sizes());
}

}  // namespace

at::Tensor token_oracle(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                      const at::Tensor& beta_in, const at::Tensor& seg_offsets, const at::Tensor& parents,
                      const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm) {
  check(q_in, k_in, v_in, g_in, beta_in, seg_offsets, parents);
  // fp32 states, as the library kernels (float64 for float64 values); one gate per head; l2norm: x * rsqrt
  return delta_rule_token_scan("gdn_token_scan", q_in, k_in, v_in, g_in, beta_in, seg_offsets, parents, initial_state, scale,
                               use_qk_l2norm);
}

}  // namespace tree_recurrence::gdn
