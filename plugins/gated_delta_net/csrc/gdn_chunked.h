// The gated delta rule over a trie, chunked (op `gdn_tree_scan`, the seam's native route): a
// composite of ATen ops, so it runs on every device (every chunk-local stage is one batched matmul
// or triangular solve over all chunks of the row at once: cuBLAS on CUDA, BLAS on CPU) and autograd
// derives its backward. The only sequential part, the inter-chunk state recurrence that follows
// the trie, is the SDK op `chunk_state_pass` (sdk/include/tree_recurrence/sdk/chunk_state_op.h).
//
// Token recurrence (state S (K, V) per value head; gdn_token_oracle.h is its float64 oracle):
//   S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
// Chunks never cross a segment boundary (a segment of L tokens has ceil(L / C) chunks, the last one
// right-padded with k = v = g = beta = 0, which leaves the state alone). Per chunk and value head,
// with h the state entering the chunk and G_i = sum_{j<=i} g_j inside the chunk, unrolling the
// recurrence gives for the corrected values v'_j = beta_j (v_j - (exp(g_j) S_{j-1})^T k_j):
//   (I + A) v' = beta v - beta exp(G) k h,   A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i
//   so v' = u - w h with  u = T (beta v),  w = T (beta exp(G) k),  T = (I + A)^-1 (unit lower
//   triangular solve);
//   S_out = exp(G_last) h + sum_j exp(G_last - G_j) k_j v'_j^T   (chunk_state_pass: kd, decay)
//   o_i = exp(G_i) q_i^T h + sum_{j<=i} (q_i . k_j) exp(G_i - G_j) v'_j.
// Every exponent is <= 0: differences G_i - G_j are masked to -inf above the diagonal BEFORE the
// exp (never exp(-G)), so strong decays underflow to 0 and never overflow or make NaN.
//
// Arguments: GdnArgs (gdn_args.h), with the plan's chunk tables on the inputs' device (no host sync):
//   gather (NC, C) int64 token of each chunk position or -1; scatter (T) int64 flat position of each
//   token in NC * C; seg_chunk_offsets, parents, root_index, level_segments, level_offsets,
//   child_offsets, children: handed to chunk_state_pass as they are.
// Computes in fp32 (float64 for float64 v; bf16 and fp16 inputs are widened); the state is fp32.
// On CUDA, bf16 / fp16 calls the fused kernels take (gdn_fused/gdn_fused.h: fused::supported) run
// there instead (TREE_RECURRENCE_FUSED=0 keeps them on the composite).
// Returns o (T, HV, V) in v's dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include "gdn_args.h"

namespace tree_recurrence::gdn {

at::Tensor chunked_scan(const GdnArgs& a);

// The ATen composite itself (what chunked_scan runs when the fused CUDA kernels do not take the
// call). Same arguments and result.
at::Tensor composite_scan(const GdnArgs& a);

}  // namespace tree_recurrence::gdn
