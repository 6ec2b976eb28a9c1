// Test-only entry of the fused GDN backward (gdn_fused_bwd.cpp): op gdn_fused_backward_stages runs the
// backward kernels from GIVEN saved buffers (so it is testable on the GPU whatever the forward
// kernels do) and returns every stage's output, in this order:
//   [dv_local, q_g, do_c, grad_state_out, dv_total, d_root (R, HV, K, V),
//    dq_hv, dk_b, dG_b (after (b)), dk_hv, dG (after (c)), dv, dbeta, dg, dq, dk (at the tokens: dv, dq,
//    dk in the inputs' type, dbeta, dg fp32),
//    d_initial_state (like initial_state; an empty tensor when it is None)]
// Layouts: kernels/params_bwd.h; float64 twin: tests/python/gdn_bwd_reference.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

namespace tree_recurrence::gdn::fused {

std::vector<at::Tensor> backward_stages(const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                        const at::Tensor& gather, const at::Tensor& scatter,
                                        const at::Tensor& seg_chunk_offsets, const at::Tensor& parents,
                                        const at::Tensor& root_index, const at::Tensor& level_segments,
                                        at::IntArrayRef level_offsets, const at::Tensor& child_offsets,
                                        const at::Tensor& children, const std::optional<at::Tensor>& initial_state,
                                        double scale, bool use_qk_l2norm, const at::Tensor& G, const at::Tensor& Ainv,
                                        const at::Tensor& w, const at::Tensor& kd, const at::Tensor& h,
                                        const at::Tensor& v_new, const at::Tensor& rq, const at::Tensor& rk);

// Defines and implements gdn_fused_backward_stages (called once from ops.cpp's register_ops).
void register_backward_stages_op();

}  // namespace tree_recurrence::gdn::fused
