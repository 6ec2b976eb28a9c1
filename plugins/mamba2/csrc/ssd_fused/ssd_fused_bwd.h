// The fused SSD backward's test-only op (ssd_fused_bwd.cpp): the backward run from GIVEN saved
// buffers (so it is testable on the GPU even when the forward kernels are not right yet), returning
// every intermediate and final gradient:
//
//   ssd_fused_backward_stages(grad_out, x, dt, B, C, A, D, dt_bias, z, initial_state, dt_limit,
//       dt_softplus, gather, scatter, seg_chunk_offsets, parents, root_index, level_segments,
//       level_offsets, child_offsets, children, saved_dt, saved_Lam, saved_states, saved_y) -> Tensor[]
//
// in this order (fp32 unless said; an absent one is an empty tensor):
//   0 dy (T,H,P)  1 dz (T,H,P)  2 cb (NC,G,L,L)  3 local (NC,H,P,N)  4 ds_leave (NC,H,P,N)
//   5 ddecay (NC,H)  6 d_roots (R,H,P,N)  7 q (NC,H,L)  8 v (NC,H,L)  9 ddt_direct (NC,H,L)
//   10 d_dtA (NC,H,L)  11 ddt wrt the prepared dt (T,H)  12 ddt_raw (T,H)  13 dA_part (NC,H)
//   final, in their inputs' dtypes: 14 dx  15 ddt (raw dt)  16 dB  17 dC  18 dA  19 dD  20 ddt_bias
//   21 dz  22 d_initial_state (fp32)
// x, B, C, grad_out, z, saved_states and saved_y may be fp32, bf16 or fp16 (fp32 for a tight stage
// test); CUDA only.
#pragma once

namespace tree_recurrence::ssd::fused {

void register_backward_stages_op();

}  // namespace tree_recurrence::ssd::fused
