// The gated delta rule over a trie, token by token: the float64 oracle of the chunked op
// `gdn_tree_scan` (gdn_chunked.h), registered for tests only, as op `gdn_token_scan`, when
// TREE_RECURRENCE_TEST_OPS=1 (sdk/test_ops.h). Host-driven (every segment starts from its parent's
// final state), written with ATen ops so autograd derives the backward; slow, never a seam's route.
//
//   q, k (N, H, K); v (N, HV, V), HV a multiple of H (grouped values); g, beta (N, HV), g the log
//   decay (<= 0). seg_offsets (S+1) and parents (S) are the plan's host int64 arrays.
//   initial_state (HV, K, V) or (R, HV, K, V) (one per root, in root order) or None.
//   scale <= 0 means key_dim^-0.5 (what the models use).
//   Returns o (N, HV, V) in v's dtype; the recurrence runs in fp32 (float64 for float64 values):
//     S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale * q_t)
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace tree_recurrence::gdn {

at::Tensor token_oracle(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                      const at::Tensor& seg_offsets, const at::Tensor& parents, const std::optional<at::Tensor>& initial_state,
                      double scale, bool use_qk_l2norm);

}  // namespace tree_recurrence::gdn
