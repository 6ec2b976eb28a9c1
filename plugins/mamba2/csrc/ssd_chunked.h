// The Mamba2 SSD scan over a trie, chunked (op `ssd_tree_scan`): a composite of ATen ops, so it runs
// on every device (batched matmuls over all chunks at once: cuBLAS on CUDA) and autograd derives
// its backward. The only sequential part, the inter-chunk state recurrence that follows the trie,
// is the SDK op `chunk_state_pass` (sdk/include/tree_recurrence/sdk/chunk_state_op.h).
//
// Chunks never cross a segment boundary: every segment is cut into ceil(len / chunk) chunks, the
// last one right-padded. Per chunk c and head h, with dt prepared as below and A (H) < 0:
//   dA_j = dt_j A_h,  G_i = sum_{j<=i} dA_j (within the chunk; padding has dt = 0)
//   kd_j = B_j exp(G_last - G_j),  u_j = dt_j x_j,  decay = exp(G_last)
//   h = chunk_state_pass(kd, u, decay, ...)           state entering each chunk, (N, P) per head
//   y_i = exp(G_i) C_i . h + sum_{j<=i} (C_i . B_j) exp(G_i - G_j) u_j + D x_i,  then * silu(z_i)
// Differences of G are masked to -inf above the diagonal before exp (never exp of a positive
// number), so strong decays underflow to 0 and never produce NaN.
//
// Arguments (the plan's chunk tables on x's device: TreePlan.chunk_tables; no host sync):
//   x (T, H, P); dt (T, H) raw; B, C (T, G, N), head h reads group h / (H / G);
//   gather (NC, chunk) int64 token of each chunk position or -1; scatter (T) int64 flat position
//   of each token in NC * chunk; seg_chunk_offsets, parents, root_index, level_segments,
//   level_offsets, child_offsets, children: handed to chunk_state_pass as they are;
//   initial_state (H, P, N), (1, H, P, N) (shared by every root) or (R, H, P, N) (one per root, in
//   root order) or None (zeros) -- mamba-ssm's (P, N) layout;
//   A (H); dt_limit (lo, hi); D (H) or (H, P) or None; dt_bias (H) or None; dt <- clamp(softplus?(dt
//   + dt_bias)) computed in fp32 (mamba-ssm's kernels); z like x or (1, T, H, P) or None.
// Computes in fp32 (float64 for float64 x; bf16 and fp16 inputs are widened); the state is fp32.
// Returns y (T, H, P) in fp32 (float64 for float64 x), as transformers' torch reference does; except
// on the fused CUDA path (bf16 / fp16 x where fused::supported holds, ssd_fused/ssd_fused.h): there y
// is in x's dtype, as mamba-ssm's mamba_chunk_scan_combined returns it (the kernels round y to the
// input dtype; widening it only cost a (T, H, P) fp32 buffer and a cast). Callers that need one dtype
// cast (the family adapter does y.to(x.dtype)).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "tree_recurrence/sdk/chunk_tables.h"

namespace tree_recurrence::ssd {

at::Tensor chunked_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                        TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                        const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                        const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z);

// The ATen composite itself (what chunked_scan runs unless the fused CUDA kernels take the call,
// ssd_fused/ssd_fused.h). Same arguments.
at::Tensor composite_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                          TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                          const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                          const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z);

// The checks of x, dt, B, C, A, D, dt_bias and dt_limit both SSD scan ops make (ssd_tree_scan and the
// float64 oracle ssd_token_scan); ``op`` names the op in the messages.
void check_scan_args(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                     const at::Tensor& A, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
                     at::ArrayRef<double> dt_limit);

// y * silu(z) in dtype f (z: (T, H, P) like x, or (1, T, H, P)); y itself without z. Both scan ops' output gate.
at::Tensor gate_by_z(const char* op, at::Tensor y, const std::optional<at::Tensor>& z_in, at::IntArrayRef x_sizes,
                     at::ScalarType f);

}  // namespace tree_recurrence::ssd
