#include "gdn_token_oracle.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include "tree_recurrence/sdk/delta_rule.h"
#include "tree_recurrence/sdk/segment_walk.h"

namespace tree_recurrence::gdn {

at::Tensor token_oracle(const GdnTokenArgs& a) {
  const at::Tensor &seg_offsets = a.tables.seg_offsets, &parents = a.tables.parents;
  check_token_scan_inputs("gdn_token_scan", a.q, a.k, a.v, a.beta, seg_offsets, parents);
  TR_CHECK_VALUE(a.g.sizes() == a.beta.sizes(), "gdn_token_scan: g must be (tokens, value_heads)=(", a.v.size(0), ", ",
                 a.v.size(1), ") (one log decay per head), got ", a.g.sizes());
  // fp32 states, as the library kernels (float64 for float64 values); one gate per head; l2norm: x * rsqrt
  return delta_rule_token_scan("gdn_token_scan", a.q, a.k, a.v, a.g, a.beta, seg_offsets, parents, a.initial_state,
                               a.scale, a.use_qk_l2norm);
}

}  // namespace tree_recurrence::gdn
