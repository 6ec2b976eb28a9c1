// The fused bf16 / fp16 tensor-core path of gdn_tree_scan on CUDA. gdn_chunked.cpp's
// chunked_scan calls fused::scan when fused::supported(...) holds; everything else (CPU, fp32,
// fp64, shapes outside the kernels' range) stays on the ATen composite, which is also the exact
// twin these kernels are tested against.
//
// Math (chunk C = 64, chunks never cross a segment; tokens i, j of one chunk; HV value heads, HK key
// heads, head hv reads key head hv / (HV / HK)):
//   q^ = l2norm(q) * scale, k^ = l2norm(k) (l2norm(x) = x * rsqrt(sum x^2 + 1e-6), or the identity;
//   the arguments: GdnArgs, ../gdn_args.h)
//   G_i = sum_{m <= i} g_m (chunk-local, fp32, natural log), pad rows: g = 0, beta = 0, k = v = 0
//   A_ij = beta_i exp(G_i - G_j) <k^_i, k^_j> (j < i), Ainv = (I + A)^-1 (unit lower)
//   w = Ainv (beta exp(G) k^), u = Ainv (beta v), kd_j = exp(G_last - G_j) k^_j, decay = exp(G_last)
//   state pass (sdk/include/tree_recurrence/kernels/chunk_state_pass_tc.h): h[c], v_new[c]
//   o_i = exp(G_i) q^_i h[c] + sum_{j <= i} exp(G_i - G_j) <q^_i, k^_j> v_new_j
//
// Buffers (chunk-major; NC chunks of the plan's gather table (NC, 64)):
//   written by the forward, saved for the backward:
//     G      float32 (NC, HV, C)       chunk-local cumsum of g
//     Ainv   in-type (NC, HV, C, C)    (I + A)^-1
//     w      in-type (NC, HV, C, K)
//     kd     in-type (NC, HV, C, K)
//     h      in-type (NC, HV, K, V)    state entering each chunk
//     v_new  in-type (NC, HV, C, V)
//     rq, rk float32 (T, HK)           rsqrt(sum x^2 + 1e-6) of q and k (1 without l2norm)
//   forward-only: u in-type (NC, HV, C, V), final_state float32 (S, HV, K, V)
// "in-type" is v's dtype (bf16 or fp16); q, k, v share it; g and beta may be fp32 or the in-type.
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>
#include <vector>

#include "../gdn_args.h"

namespace tree_recurrence::gdn::fused {

struct Saved {
  at::Tensor G, Ainv, w, kd, h, v_new, rq, rk;
  // Forward-only (returned by forward() for the stage test; scan() does not keep them):
  at::Tensor u, decay, final_state;  // u in-type (NC, HV, C, V), decay f32 (NC, HV), final f32 (S, HV, K, V)
};

// Whether the fused kernels take this call: CUDA, q/k/v bf16 or fp16 alike, chunk 64, K and V
// multiples of 8 up to 128, and the fused kernels not switched off (settings::fused_kernels(),
// TREE_RECURRENCE_FUSED).
bool supported(const GdnArgs& a);

// The op with autograd (a torch::autograd::Function whose forward is forward() and whose backward
// is backward() below). Arguments already checked by the caller.
at::Tensor scan(const GdnArgs& a);

// Forward kernels (gdn_fused_fwd.cpp): o (T, HV, V) in v's dtype, and the saved buffers.
std::pair<at::Tensor, Saved> forward(const GdnArgs& a);

// Test-only (op gdn_fused_stages, arguments as gdn_tree_scan's): the forward's stages, no autograd:
// [o, G, Ainv, w, u, kd, decay, h, v_new, final_state, rq, rk].
std::vector<at::Tensor> stages(const GdnArgs& a);

struct Grads {
  at::Tensor dq, dk, dv, dg, dbeta;  // like q, k, v, g, beta (dtype and shape)
  at::Tensor d_initial_state;        // like initial_state (float32), undefined when it is None
};

// Backward kernels (gdn_fused_bwd.cpp) from the saved buffers and grad_o (T, HV, V). Takes `saved` over
// and drops each buffer right after its last reader (w, kd after the state pass; Ainv, h, v_new after
// the WY stage): a buffer the caller keeps a reference to stays alive (pass a copy to keep them).
Grads backward(const at::Tensor& grad_o, const GdnArgs& a, Saved&& saved);

}  // namespace tree_recurrence::gdn::fused
