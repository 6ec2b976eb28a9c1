#include "kda_tree_scan.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include <cmath>
#include <vector>

#include "tree_recurrence/sdk/delta_rule.h"
#include "tree_recurrence/sdk/segment_walk.h"

namespace kimi_linear {
namespace {

void check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
           const at::Tensor& seg_offsets, const at::Tensor& parents) {
  TR_CHECK_VALUE(q.dim() == 3 && k.sizes() == q.sizes(), "kda_tree_scan: q and k must be (tokens, heads, key_dim) alike, got ",
                    q.sizes(), " and ", k.sizes());
  TR_CHECK_VALUE(v.dim() == 3 && v.size(0) == q.size(0), "kda_tree_scan: v must be (tokens=", q.size(0),
                    ", value_heads, value_dim), got ", v.sizes());
  TR_CHECK_VALUE(q.size(1) > 0 && v.size(1) % q.size(1) == 0, "kda_tree_scan: value heads ", v.size(1),
                    " must be a multiple of key heads ", q.size(1));
  TR_CHECK_VALUE(g.dim() == 3 && g.size(0) == v.size(0) && g.size(1) == v.size(1) && g.size(2) == q.size(2),
                    "kda_tree_scan: g must be (tokens, value_heads, key_dim)=(", v.size(0), ", ", v.size(1), ", ", q.size(2),
                    ") (one log decay per key channel), got ", g.sizes());
  TR_CHECK_VALUE(beta.dim() == 2 && beta.size(0) == v.size(0) && beta.size(1) == v.size(1),
                    "kda_tree_scan: beta must be (tokens, value_heads)=(", v.size(0), ", ", v.size(1), "), got ", beta.sizes());
  for (const at::Tensor* t : {&k, &v, &g, &beta})
    TR_CHECK_VALUE(t->device() == q.device(), "kda_tree_scan: all tensors must be on ", q.device(), ", got one on ",
                      t->device());
  TR_CHECK_VALUE(seg_offsets.is_cpu() && parents.is_cpu() && seg_offsets.scalar_type() == at::kLong &&
                        parents.scalar_type() == at::kLong,
                    "kda_tree_scan: seg_offsets and parents must be int64 CPU tensors (the plan's host arrays)");
  TR_CHECK_VALUE(seg_offsets.dim() == 1 && parents.dim() == 1 && seg_offsets.numel() == parents.numel() + 1,
                    "kda_tree_scan: seg_offsets must have one more entry than parents");
  TR_CHECK_VALUE(seg_offsets.numel() >= 2 && seg_offsets.data_ptr<int64_t>()[0] == 0 &&
                        seg_offsets.data_ptr<int64_t>()[seg_offsets.numel() - 1] == q.size(0),
                    "kda_tree_scan: seg_offsets must run from 0 to the number of tokens ", q.size(0));
  // segment order and parents are checked by walk_segments
}

}  // namespace

at::Tensor tree_scan(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                     const at::Tensor& beta_in, const at::Tensor& seg_offsets, const at::Tensor& parents,
                     const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm) {
  check(q_in, k_in, v_in, g_in, beta_in, seg_offsets, parents);
  // fp32 states, as the library kernels; float64 when the values are float64 (exact tests). The l2norm is
  // transformers' KDA one (x / sqrt(sum(x^2) + 1e-6)), matching FLA's.
  const at::ScalarType compute = v_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto qk = tree_recurrence::token_scan_qk(q_in, k_in, v_in.size(1), compute, scale, use_qk_l2norm,
                                                 &tree_recurrence::l2norm_div);
  const at::Tensor q = qk.first, k = qk.second;
  const at::Tensor v = v_in.to(compute);
  const at::Tensor decay = g_in.to(compute).exp().unsqueeze(-1);   // (N, HV, K, 1): per key channel
  const at::Tensor beta = beta_in.to(compute).unsqueeze(-1);       // (N, HV, 1)
  const int64_t HV = v.size(1), K = q.size(2), V = v.size(2);
  std::vector<at::Tensor> outputs(q.size(0));
  tree_recurrence::walk_segments("kda_tree_scan", seg_offsets, parents, initial_state, {HV, K, V}, v.options(),
                                 [&](at::Tensor state, int64_t t) {
                                   const at::Tensor kt = k[t].unsqueeze(-1);               // (HV, K, 1)
                                   state = state * decay[t];                                // decay each key channel's row of S
                                   const at::Tensor remembered = (state * kt).sum(1);       // (HV, V) = S^T k
                                   const at::Tensor delta = (v[t] - remembered) * beta[t];  // (HV, V)
                                   state = state + kt * delta.unsqueeze(1);
                                   outputs[t] = (state * q[t].unsqueeze(-1)).sum(1);        // (HV, V) = S^T q
                                   return state;
                                 });
  if (outputs.empty()) return at::empty({0, HV, V}, v_in.options());
  return at::stack(outputs).to(v_in.scalar_type());
}

}  // namespace kimi_linear
