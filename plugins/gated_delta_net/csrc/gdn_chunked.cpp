#include "gdn_chunked.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include <limits>
#include <utility>
#include <vector>

#include "tree_recurrence/sdk/chunk_state_op.h"
#include "tree_recurrence/sdk/delta_rule.h"

#ifdef TREE_RECURRENCE_WITH_CUDA
#include "gdn_fused/gdn_fused.h"
#endif

namespace tree_recurrence::gdn {
namespace {

void check(const GdnArgs& a) {
  const at::Tensor &q = a.q, &v = a.v, &gather = a.tables.gather, &scatter = a.tables.scatter;
  GdnArgs::each_input(a, [](const char* name, const at::Tensor& t) {
    TR_CHECK_TYPE(at::isFloatingType(t.scalar_type()), "gdn_tree_scan: ", name, " has dtype ", t.scalar_type(),
                  ", expected float32, float64, bfloat16 or float16");
  });
  TR_CHECK_VALUE(q.dim() == 3 && a.k.sizes() == q.sizes(), "gdn_tree_scan: q and k must be (tokens, heads, key_dim) alike, got ",
                 q.sizes(), " and ", a.k.sizes());
  const int64_t T = q.size(0);
  TR_CHECK_VALUE(v.dim() == 3 && v.size(0) == T, "gdn_tree_scan: v must be (tokens=", T, ", value_heads, value_dim), got ",
                 v.sizes());
  TR_CHECK_VALUE(q.size(1) > 0 && v.size(1) % q.size(1) == 0, "gdn_tree_scan: value heads ", v.size(1),
                 " must be a multiple of key heads ", q.size(1));
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"g", &a.g}, {"beta", &a.beta}})
    TR_CHECK_VALUE(t->dim() == 2 && t->size(0) == T && t->size(1) == v.size(1), "gdn_tree_scan: ", name,
                   " must be (tokens, value_heads)=(", T, ", ", v.size(1), "), got ", t->sizes());
  check_gather_scatter("gdn_tree_scan", gather, scatter, T);
  const auto on_q_device = [&](const char* name, const at::Tensor& t) {
    TR_CHECK_VALUE(t.device() == q.device(), "gdn_tree_scan: ", name, " is on ", t.device(), " but q is on ", q.device(),
                   " (the plan's tables: TreePlan.chunk_tables(chunk, device))");
  };
  GdnArgs::each_input(a, on_q_device);
  on_q_device("gather", gather);
  on_q_device("scatter", scatter);
}

}  // namespace

at::Tensor chunked_scan(const GdnArgs& a) {
  check(a);
#ifdef TREE_RECURRENCE_WITH_CUDA
  // The fused bf16 / fp16 tensor-core kernels (csrc/gdn_fused/gdn_fused.h) when they take the call.
  if (fused::supported(a)) return fused::scan(a);
#endif
  return composite_scan(a);
}

at::Tensor composite_scan(const GdnArgs& a) {
  check(a);
  const at::Tensor &q_in = a.q, &v_in = a.v, &gather = a.tables.gather;
  const int64_t T = q_in.size(0), HK = q_in.size(1), K = q_in.size(2), HV = v_in.size(1), V = v_in.size(2);
  const int64_t groups = HV / HK, NC = gather.size(0), C = gather.size(1);
  const auto f = v_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;

  at::Tensor q = q_in.to(f), k = a.k.to(f);
  if (a.use_qk_l2norm) {
    q = l2norm(q);
    k = l2norm(k);
  }
  q = q * a.resolved_scale();

  // Chunk-major views (NC, heads, C, ...); padding reads an appended zero row (index T).
  const at::Tensor index = at::where(gather < 0, at::full({}, T, gather.options()), gather).reshape({-1});
  auto chunks = [&](const at::Tensor& t) {
    at::Tensor padded = at::cat({t, at::zeros(t.narrow(0, 0, 1).sizes(), t.options())}, 0);
    std::vector<int64_t> shape{NC, C};
    for (int64_t d = 1; d < t.dim(); ++d) shape.push_back(t.size(d));
    at::Tensor out = padded.index_select(0, index).view(shape);
    return (t.dim() == 2 ? out.transpose(1, 2) : out.permute({0, 2, 1, 3})).contiguous();
  };
  const at::Tensor qc = chunks(q), kc = chunks(k);      // (NC, HK, C, K)
  const at::Tensor vc = chunks(v_in.to(f));             // (NC, HV, C, V)
  const at::Tensor gc = chunks(a.g.to(f));             // (NC, HV, C)
  const at::Tensor bc = chunks(a.beta.to(f));          // (NC, HV, C)

  // Decays. G (NC, HV, C) is <= 0 and non-increasing. The differences D_ij = G_i - G_j (j <= i) are
  // summed directly, D_ij = sum_{j<m<=i} g_m (a cumsum of the masked g), not subtracted: with
  // strong decays |G| reaches hundreds and G_i - G_j in fp32 would lose ~1e-4 of every factor.
  // E_ij = exp(D_ij) for j <= i, 0 above (masked to -inf before the exp).
  const at::Tensor G = at::cumsum(gc, -1);
  const at::Tensor ones = at::ones({C, C}, gather.options().dtype(at::kBool));
  const at::Tensor not_below = ones.triu(), above = ones.triu(1);
  const at::Tensor D = at::cumsum(gc.unsqueeze(-1).expand({NC, HV, C, C}).masked_fill(not_below, 0.0), -2);
  const at::Tensor E = at::exp(D.masked_fill(above, -std::numeric_limits<double>::infinity()));
  const at::Tensor to_last = D.narrow(-2, C - 1, 1).squeeze(-2);  // (NC, HV, C): G_last - G_j
  const at::Tensor E5 = E.reshape({NC, HK, groups, C, C});

  // Key-head products, shared by the value heads of a group (no repeat of q or k).
  const at::Tensor kk = at::matmul(kc, kc.transpose(-1, -2)).unsqueeze(2);  // (NC, HK, 1, C, C)
  const at::Tensor qk = at::matmul(qc, kc.transpose(-1, -2)).unsqueeze(2);
  const at::Tensor k5 = kc.unsqueeze(2);                                       // (NC, HK, 1, C, K)

  // The UT transform: A strictly lower, (I + A) [w u] = [beta exp(G) k, beta v].
  const at::Tensor A = (kk * E5).reshape({NC, HV, C, C}).tril(-1) * bc.unsqueeze(-1);
  const at::Tensor bk = (k5 * (bc * at::exp(G)).reshape({NC, HK, groups, C, 1})).reshape({NC, HV, C, K});
  const at::Tensor rhs = at::cat({bk, vc * bc.unsqueeze(-1)}, -1);  // (NC, HV, C, K + V)
  const at::Tensor wu = at::linalg_solve_triangular(A, rhs, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  const at::Tensor w = wu.narrow(-1, 0, K).contiguous(), u = wu.narrow(-1, K, V).contiguous();
  const at::Tensor kd = (k5 * at::exp(to_last).reshape({NC, HK, groups, C, 1})).reshape({NC, HV, C, K});
  const at::Tensor decay = at::exp(G.narrow(-1, C - 1, 1).squeeze(-1)).contiguous();  // (NC, HV)

  // The state pass over the trie: h (NC, HV, K, V), the state entering each chunk; v_new = u - w h.
  const auto h0 = chunked_initial_state("gdn_tree_scan", a.initial_state, {HV, K, V}, {"value_heads", "key_dim", "value_dim"},
                                        "q", q_in.device(), f);
  auto [h, v_new] = chunk_state_pass(w, u, kd.contiguous(), decay, h0, a.tables);

  // Outputs: the entering state seen through exp(G) q, plus the chunk's own corrected values.
  const at::Tensor qg = (qc.unsqueeze(2) * at::exp(G).reshape({NC, HK, groups, C, 1})).reshape({NC, HV, C, K});
  const at::Tensor scores = (qk * E5).reshape({NC, HV, C, C});
  const at::Tensor o = at::matmul(qg, h.to(f)) + at::matmul(scores, v_new.to(f));  // (NC, HV, C, V)
  return o.permute({0, 2, 1, 3}).reshape({NC * C, HV, V}).index_select(0, a.tables.scatter).to(v_in.scalar_type());
}

}  // namespace tree_recurrence::gdn
