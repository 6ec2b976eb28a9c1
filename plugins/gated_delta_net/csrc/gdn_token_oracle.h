// The gated delta rule over a trie, token by token: the float64 oracle of the chunked op
// `gdn_tree_scan` (gdn_chunked.h), registered for tests only, as op `gdn_token_scan`, when
// TREE_RECURRENCE_TEST_OPS=1 (sdk/settings.h). Host-driven (every segment starts from its parent's
// final state), written with ATen ops so autograd derives the backward; slow, never a seam's route.
//
//   Arguments: GdnTokenArgs (gdn_args.h): q, k (N, H, K); v (N, HV, V); g, beta (N, HV); the plan's
//   host int64 seg_offsets (S+1) and parents (S); initial_state (HV, K, V) or (R, HV, K, V) or None.
//   Returns o (N, HV, V) in v's dtype; the recurrence runs in fp32 (float64 for float64 values):
//     S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (scale * q_t)
#pragma once

#include <ATen/core/Tensor.h>

#include "gdn_args.h"

namespace tree_recurrence::gdn {

at::Tensor token_oracle(const GdnTokenArgs& a);

}  // namespace tree_recurrence::gdn
