// The fused SSD backward's kernel plan and its test-only op (ssd_fused_bwd.cpp). The op runs the backward from
// GIVEN saved buffers and returns every intermediate and final gradient:
//
//   ssd_fused_backward_stages(grad_out, x, dt, B, C, A, D, dt_bias, z, initial_state, dt_limit,
//       dt_softplus, gather, scatter, seg_chunk_offsets, parents, root_index, level_segments,
//       level_offsets, child_offsets, children, saved_dt, saved_Lam, saved_states, saved_y,
//       route=-1, fused_pass=-1) -> Tensor[]
//
// in this order (fp32 unless said; an absent one is an empty tensor):
//   0 dy (T,H,P)  1 dz (T,H,P)  2 cb (NC,G,L,L)  3 local (NC,H,P,N)  4 ds_leave (NC,H,P,N)
//   5 ddecay (NC,H)  6 d_roots (R,H,P,N)  7 q (NC,H,L)  8 v (NC,H,L)  9 ddt_direct (NC,H,L)
//   10 d_dtA (NC,H,L)  11 ddt wrt the prepared dt (T,H)  12 ddt_raw (T,H)  13 dA_part (NC,H)
//   final, in their inputs' dtypes: 14 dx  15 ddt (raw dt)  16 dB  17 dC  18 dA  19 dD  20 ddt_bias
//   21 dz  22 d_initial_state (fp32)
// x, B, C, grad_out, z, saved_states and saved_y may be fp32, bf16 or fp16 (fp32 for a tight stage
// test); CUDA only. route and fused_pass override the plan (-1: the plan's choice; an override the
// inputs do not allow is an error): route 0 CudaCore, 1 TensorCore, 2 Half; fused_pass 0 / 1 on Half.
// With the Half route and fused_pass 1, the local stage (3) comes from local_bf16 run on the side.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/params_bwd.h"
#include "ssd_fused.h"

namespace tree_recurrence::ssd::fused {

// The backward's routes (ssd_fused_bwd.cpp's header comment says which inputs take which).
enum class BwdRoute : int { CudaCore = 0, TensorCore = 1, Half = 2 };

struct BwdPlan {
  BwdRoute route = BwdRoute::CudaCore;
  bool fused_pass = false;   // Half: the fused reverse local + state pass (short segments) instead of two kernels
  bool recompute_y = false;  // Half, z given, no saved y: post_bf16 recomputes the pre-gate y
};

// The stage op's overrides of the plan: -1 leaves the choice to the plan.
struct BwdPlanOverride {
  int64_t route = -1;
  int64_t fused_pass = -1;
};

void register_backward_stages_op();

// (ssd_fused.cpp) The backward's input checks and kernel parameters. bwd_type: t's kernel dtype (fp32, bf16,
// fp16; any other throws naming it). check_backward_inputs: the shapes of the backward's arguments (throws naming
// the first that does not fit); returns R, the rows of the initial states' gradient, and sets shared_h0 (one
// initial state for every root). bind_backward_params: p's dims, dtypes and input pointers from the inputs as the
// kernels read them (contiguous; float64 narrowed to fp32; dt, A, dt_bias, D in fp32), kept alive in `in`.
struct BwdInputs {
  at::Tensor x, B, C, dout, states, dt_raw, A, dt_bias, D, z, y, dt_s, Lam, gather, sco, ridx, lsegs, coff, kids;
};
kernels::BwdType bwd_type(const at::Tensor& t, const char* name);
int64_t check_backward_inputs(const at::Tensor& grad_out, const Args& a, const Tables& t, const Saved& saved,
                              bool& shared_h0);
void bind_backward_params(kernels::BwdParams& p, BwdInputs& in, const at::Tensor& grad_out, const Args& a,
                          const Tables& t, const Saved& saved);

}  // namespace tree_recurrence::ssd::fused
