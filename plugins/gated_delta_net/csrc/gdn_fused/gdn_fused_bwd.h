// Test-only entry of the fused GDN backward (gdn_fused_bwd.cpp): op gdn_fused_backward_stages (arguments:
// grad_o, gdn_tree_scan's (GdnArgs, ../gdn_args.h), then the saved G, Ainv, w, kd, h, v_new, rq, rk;
// ops.cpp binds them) runs the backward kernels from GIVEN saved buffers (so it is testable on the GPU
// whatever the forward kernels do) and returns every stage's output, in this order:
//   [dv_local, q_g, grad_state_out, dv_total, d_root (R, HV, K, V),
//    dq_hv ((NC, HK, C, K): summed over each key head's value heads in order), dk_b, dG_b (after (b)),
//    dk_hv, dG (after (c)), dv, dbeta, dg, dq, dk (at the tokens: dv, dq, dk in the inputs' type, dbeta,
//    dg fp32),
//    d_initial_state (like initial_state; an empty tensor when it is None)]
// Layouts: kernels/params_bwd.h; float64 twin: tests/python/gdn_bwd_reference.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "gdn_fused.h"

namespace tree_recurrence::gdn::fused {

std::vector<at::Tensor> backward_stages(const at::Tensor& grad_o, const GdnArgs& a, Saved saved);

}  // namespace tree_recurrence::gdn::fused
