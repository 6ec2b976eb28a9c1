// Native Kimi Delta Attention (KDA) over a trie (host-driven: every segment starts from its parent's final
// state). Written with ATen ops, so autograd derives the backward; it is the CPU reference the fork and rescan
// strategies are checked against, and it runs on any device (slowly on CUDA, where it is not advertised).
//
// KDA is the gated delta rule with a decay per KEY CHANNEL instead of one per head. Per head, state S (K, V):
//   S <- diag(exp(g_t)) S                 g_t (K) the log decay (<= 0), one per key channel
//   S <- S + k_t (beta_t (v_t - S^T k_t))^T
//   o_t = S^T (scale * q_t)
// exactly transformers' chunk_kimi_delta_attention / recurrent_kimi_delta_attention and FLA's chunk_kda
// (q and k l2-normalised first when use_qk_l2norm: x / sqrt(sum x^2 + 1e-6), in the compute dtype).
//
//   q, k (N, H, K); v (N, HV, V), HV a multiple of H (value head hv reads key head hv / (HV / H), as FLA);
//   g (N, HV, K); beta (N, HV). seg_offsets (S+1) and parents (S): the plan's host int64 arrays.
//   initial_state (HV, K, V) or (R, HV, K, V) (one per root, in root order) or None (zeros).
//   scale <= 0 means K^-0.5 (what the models use).
//   Returns o (N, HV, V) in v's dtype. The recurrence runs in fp32, in float64 when v is float64 (exact tests).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kimi_linear {

at::Tensor tree_scan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                     const at::Tensor& seg_offsets, const at::Tensor& parents, const std::optional<at::Tensor>& initial_state,
                     double scale, bool use_qk_l2norm);

}  // namespace kimi_linear
