// The fused GDN backward (issue 19): host side of the chunk-local backward kernels
// (kernels/*_bwd.cu, parameters in kernels/params_bwd.h) and the reverse tree state pass
// (sdk chunk_state_pass_tc_backward).
#include "gdn_fused.h"

#include <c10/util/Exception.h>

namespace tree_recurrence::gdn::fused {

Grads backward(const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, const Tables& tables, const std::optional<at::Tensor>& initial_state, double scale,
               bool use_qk_l2norm, const Saved& saved) {
  TORCH_CHECK(false, "fused GDN backward: not implemented yet");
}

}  // namespace tree_recurrence::gdn::fused
