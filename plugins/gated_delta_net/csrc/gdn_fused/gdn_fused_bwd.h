// Test-only entry of the fused GDN backward (gdn_fused_bwd.cpp): op gdn_fused_backward_stages (arguments:
// grad_o, q, k, v, g, beta, the plan's chunk tables, initial_state, scale, use_qk_l2norm, then the
// saved G, Ainv, w, kd, h, v_new, rq, rk, then mode: -1 the backward's switches (gdn_fused_bwd.cpp), else
// bit 0 dq^ summed per key head in (b), bit 1 dv_total written over dv_local, bit 2 dO read at the tokens
// by the state pass and (b), do_c then formed by ATen for this output only) runs the backward kernels
// from GIVEN saved buffers (so it is
// testable on the GPU whatever the forward kernels do) and returns every stage's output, in this order:
//   [dv_local, q_g, do_c, grad_state_out, dv_total, d_root (R, HV, K, V),
//    dq_hv ((NC, HV, C, K), or (NC, HK, C, K) summed over each key head's value heads in order when
//    dq^ is summed in (b)), dk_b, dG_b (after (b)), dk_hv, dG (after (c)), dv, dbeta, dg, dq, dk (at the tokens: dv, dq,
//    dk in the inputs' type, dbeta, dg fp32),
//    d_initial_state (like initial_state; an empty tensor when it is None)]
// Layouts: kernels/params_bwd.h; float64 twin: tests/python/gdn_bwd_reference.py.
#pragma once

namespace tree_recurrence::gdn::fused {

// Defines and implements gdn_fused_backward_stages (called once from ops.cpp's register_ops).
void register_backward_stages_op();

}  // namespace tree_recurrence::gdn::fused
