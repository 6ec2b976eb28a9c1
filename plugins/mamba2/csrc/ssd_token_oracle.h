// The float64 oracle of the Mamba2 SSD tree scan, registered for tests only (op `ssd_token_scan`,
// when TREE_RECURRENCE_TEST_OPS=1: sdk/test_ops.h): a token-by-token recurrence over the trie,
// host-driven (every segment starts from its parent's final state), written with ATen ops so
// autograd derives the backward. Tests check the chunked `ssd_tree_scan` (ssd_chunked.h) against
// it; it computes in float64 for float64 inputs, else in fp32. It is not a seam kernel.
//
// Semantics: exactly transformers' torch `mamba2_chunk_scan` (modeling_mamba2.py and the copies
// in bamba, nemotron_h, granitemoehybrid, falcon_h1, zamba2), as a token recurrence:
//   dt  <- dt + dt_bias (in dt's dtype, if given); softplus if dt_softplus; clamp to dt_limit
//          (still in dt's dtype, as the reference does), then fp32
//   S_t =  exp(dt_t * A) S_{t-1} + (dt_t x_t) B_t^T          (per head, fp32, S (P, N))
//   y_t =  S_t C_t + D * x_t                                  (then * silu(z_t) if z is given)
//
//   x (T, H, P); dt (T, H) raw; B, C (T, G, N) grouped (head h reads group h / (H / G));
//   A (H) (fp32 in the models; promoted to fp32); D (H) or (H, P) or None; dt_bias (H) or None;
//   dt_limit (lo, hi); z (T, H, P) or (1, T, H, P) or None (mamba-ssm's output gate; transformers'
//   torch reference ignores z and every transformers mixer passes z=None).
//   seg_offsets (S+1), parents (S): the plan's host int64 arrays.
//   initial_state (H, P, N) or (R, H, P, N) (one per root, in root order) or None (zeros).
//   Returns y (T, H, P) in fp32 (float64 for float64 x), as the torch reference returns it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace tree_recurrence::ssd {

at::Tensor token_oracle(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                     const at::Tensor& seg_offsets, const at::Tensor& parents, const std::optional<at::Tensor>& initial_state,
                     const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                     const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z);

}  // namespace tree_recurrence::ssd
