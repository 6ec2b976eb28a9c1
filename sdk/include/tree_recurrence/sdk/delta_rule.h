// Pieces the delta-rule ops share (Gated DeltaNet's chunked op and token oracle, the KDA example's
// token scan): the q / k normalisation and their preparation for a per-token recurrence.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "tree_recurrence/sdk/segment_walk.h"

namespace tree_recurrence {

// x * rsqrt(sum(x^2) + 1e-6) over the last dimension (transformers' l2norm of the Gated DeltaNet models).
inline at::Tensor l2norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6); }

// x / sqrt(sum(x^2) + 1e-6) over the last dimension (transformers' KDA l2norm, FLA's): the same
// epsilon, rounded differently.
inline at::Tensor l2norm_div(const at::Tensor& x) { return x / at::sqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6); }

// The checks every token-by-token delta-rule op makes (its gate's shape is its own): q and k (T, HK, K)
// alike, v (T, HV, V) with HV a multiple of HK, beta (T, HV), and the token tables (check_token_tables).
inline void check_token_scan_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& beta, const at::Tensor& seg_offsets, const at::Tensor& parents) {
  TR_CHECK_VALUE(q.dim() == 3 && k.sizes() == q.sizes(), op, ": q and k must be (tokens, heads, key_dim) alike, got ",
                 q.sizes(), " and ", k.sizes());
  TR_CHECK_VALUE(v.dim() == 3 && v.size(0) == q.size(0), op, ": v must be (tokens=", q.size(0),
                 ", value_heads, value_dim), got ", v.sizes());
  TR_CHECK_VALUE(q.size(1) > 0 && v.size(1) % q.size(1) == 0, op, ": value heads ", v.size(1),
                 " must be a multiple of key heads ", q.size(1));
  TR_CHECK_VALUE(beta.dim() == 2 && beta.size(0) == v.size(0) && beta.size(1) == v.size(1), op,
                 ": beta must be (tokens, value_heads)=(", v.size(0), ", ", v.size(1), "), got ", beta.sizes());
  check_token_tables(op, seg_offsets, parents, q.size(0));
}

// q (T, HK, K) and k for a token-by-token delta rule over `value_heads` heads: widened to `compute`,
// normalised by `norm` when use_qk_l2norm, repeated from the key heads to the value heads, q scaled by
// `scale` (1 / sqrt(K) when it is 0).
inline std::pair<at::Tensor, at::Tensor> token_scan_qk(const at::Tensor& q_in, const at::Tensor& k_in, int64_t value_heads,
                                                       at::ScalarType compute, double scale, bool use_qk_l2norm,
                                                       at::Tensor (*norm)(const at::Tensor&) = &l2norm) {
  const int64_t groups = value_heads / q_in.size(1);
  at::Tensor q = q_in.to(compute), k = k_in.to(compute);
  if (use_qk_l2norm) {
    q = norm(q);
    k = norm(k);
  }
  if (groups > 1) {
    q = q.repeat_interleave(groups, 1);
    k = k.repeat_interleave(groups, 1);
  }
  q = q * (scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(2))));
  return {q, k};
}

// The gated delta rule token by token over the trie (walk_segments), state S (HV, K, V) per segment:
//   S = S * exp(g_t);  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t,
// computed in fp32 (float64 for float64 values: the exact tests), q and k prepared by token_scan_qk
// (`norm`, grouped heads, `scale`). g is (T, HV), one log decay per head, or (T, HV, K), one per key
// channel; beta (T, HV). Returns o (T, HV, V) in v's dtype (an empty row: (0, HV, V)).
inline at::Tensor delta_rule_token_scan(const char* op, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                        const at::Tensor& g, const at::Tensor& beta_in, const at::Tensor& seg_offsets,
                                        const at::Tensor& parents, const std::optional<at::Tensor>& initial_state,
                                        double scale, bool use_qk_l2norm, at::Tensor (*norm)(const at::Tensor&) = &l2norm) {
  const at::ScalarType compute = v_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto [q, k] = token_scan_qk(q_in, k_in, v_in.size(1), compute, scale, use_qk_l2norm, norm);
  const at::Tensor v = v_in.to(compute), beta = beta_in.to(compute).unsqueeze(-1);  // beta (T, HV, 1)
  at::Tensor decay = g.to(compute).exp();
  while (decay.dim() < 4) decay = decay.unsqueeze(-1);  // (T, HV, 1, 1) or (T, HV, K, 1): broadcast over S
  const at::ScalarType out_dtype = v_in.scalar_type();
  const int64_t HV = v.size(1), K = q.size(2), V = v.size(2);
  std::vector<at::Tensor> outputs(q.size(0));
  // Per-token slices from one unbind each: its backward stacks every token's gradient at once
  // (indexing q[t] in the loop would allocate a full-size gradient per token).
  const std::vector<at::Tensor> qs = q.unbind(0), ks = k.unbind(0), vs = v.unbind(0), decays = decay.unbind(0),
                                betas = beta.unbind(0);
  walk_segments(op, seg_offsets, parents, initial_state, {HV, K, V}, v.options(), [&](at::Tensor state, int64_t t) {
    const at::Tensor kt = ks[t].unsqueeze(-1);                   // (HV, K, 1)
    state = state * decays[t];                                   // every row of S, or each key channel's
    const at::Tensor remembered = (state * kt).sum(1);           // (HV, V) = S^T k
    const at::Tensor delta = (vs[t] - remembered) * betas[t];    // (HV, V)
    state = state + kt * delta.unsqueeze(1);
    outputs[t] = (state * qs[t].unsqueeze(-1)).sum(1);           // (HV, V) = S^T q
    return state;
  });
  if (outputs.empty()) return at::empty({0, HV, V}, v.options().dtype(out_dtype));
  return at::stack(outputs).to(out_dtype);
}

}  // namespace tree_recurrence
