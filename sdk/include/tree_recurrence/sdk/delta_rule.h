// Pieces the delta-rule ops share (Gated DeltaNet's chunked op and token oracle, the KDA example's
// token scan): the q / k normalisation and their preparation for a per-token recurrence.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <utility>

namespace tree_recurrence {

// x * rsqrt(sum(x^2) + 1e-6) over the last dimension (transformers' l2norm of the Gated DeltaNet models).
inline at::Tensor l2norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6); }

// x / sqrt(sum(x^2) + 1e-6) over the last dimension (transformers' KDA l2norm, FLA's): the same
// epsilon, rounded differently.
inline at::Tensor l2norm_div(const at::Tensor& x) { return x / at::sqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6); }

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

}  // namespace tree_recurrence
