#include "ssd_chunked.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include <limits>

#include "ssd_fused/ssd_fused.h"
#include "tree_recurrence/sdk/chunk_state_op.h"

namespace tree_recurrence::ssd {
namespace {

void check(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C, const at::Tensor& gather,
           const at::Tensor& scatter, const at::Tensor& A, const std::optional<at::Tensor>& D,
           const std::optional<at::Tensor>& dt_bias, at::ArrayRef<double> dt_limit) {
  TR_CHECK_TYPE(at::isFloatingType(x.scalar_type()), "ssd_tree_scan: x has dtype ", x.scalar_type(),
                   ", expected float32, float64, bfloat16 or float16");
  check_scan_args("ssd_tree_scan", x, dt, B, C, A, D, dt_bias, dt_limit);
  const int64_t T = x.size(0);
  check_gather_scatter("ssd_tree_scan", gather, scatter, T);
  for (const at::Tensor* t : {&dt, &B, &C, &gather, &scatter, &A})
    TR_CHECK_VALUE(t->device() == x.device(), "ssd_tree_scan: every tensor must be on x's device ", x.device(),
                      ", got one on ", t->device(), " (the plan's tables: TreePlan.chunk_tables(chunk, device))");
}

}  // namespace

void check_scan_args(const char* op, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                     const at::Tensor& A, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
                     at::ArrayRef<double> dt_limit) {
  TR_CHECK_VALUE(x.dim() == 3, op, ": x must be (tokens, heads, head_dim), got ", x.sizes());
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  TR_CHECK_VALUE(dt.dim() == 2 && dt.size(0) == T && dt.size(1) == H, op, ": dt must be (tokens, heads)=", T, "x",
                    H, ", got ", dt.sizes());
  TR_CHECK_VALUE(B.dim() == 3 && B.size(0) == T && C.sizes() == B.sizes(),
                    op, ": B and C must be (tokens, groups, state) alike, got ", B.sizes(), " and ", C.sizes());
  TR_CHECK_VALUE(B.size(1) > 0 && H % B.size(1) == 0, op, ": heads ", H, " must be a multiple of groups ",
                    B.size(1));
  TR_CHECK_VALUE(A.dim() == 1 && A.size(0) == H, op, ": A must be (heads=", H, "), got ", A.sizes());
  if (D)
    TR_CHECK_VALUE((D->dim() == 1 && D->size(0) == H) || (D->dim() == 2 && D->size(0) == H && D->size(1) == P),
                      op, ": D must be (heads=", H, ") or (heads, head_dim=", P, "), got ", D->sizes());
  if (dt_bias)
    TR_CHECK_VALUE(dt_bias->dim() == 1 && dt_bias->size(0) == H, op, ": dt_bias must be (heads=", H, "), got ",
                      dt_bias->sizes());
  TR_CHECK_VALUE(dt_limit.size() == 2 && dt_limit[0] <= dt_limit[1],
                    op, ": dt_limit must be (low, high) with low <= high");
}

at::Tensor gate_by_z(const char* op, at::Tensor y, const std::optional<at::Tensor>& z_in, at::IntArrayRef x_sizes,
                     at::ScalarType f) {
  if (!z_in) return y;
  at::Tensor z = *z_in;
  if (z.dim() == 4) {
    TR_CHECK_VALUE(z.size(0) == 1, op, ": z must be (tokens, heads, head_dim) or (1, tokens, ...), got ", z.sizes());
    z = z[0];
  }
  TR_CHECK_VALUE(z.sizes() == x_sizes, op, ": z must be shaped like x ", x_sizes, ", got ", z.sizes());
  return y * at::silu(z.to(f));
}

at::Tensor composite_scan(const at::Tensor& x_in, const at::Tensor& dt_in, const at::Tensor& B_in, const at::Tensor& C_in,
                          TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                          const at::Tensor& A_in, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                          const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z_in) {
  check(x_in, dt_in, B_in, C_in, gather, scatter, A_in, D, dt_bias, dt_limit);
  const int64_t T = x_in.size(0), H = x_in.size(1), P = x_in.size(2);
  const int64_t G = B_in.size(1), N = B_in.size(2), hpg = H / G;
  const int64_t NC = gather.size(0), L = gather.size(1);
  const auto f = x_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;

  // dt as mamba-ssm's kernels prepare it: bias, softplus (threshold 20) and clamp in fp32.
  at::Tensor dt = dt_in.to(f);
  if (dt_bias) dt = dt + dt_bias->to(f);
  if (dt_softplus) dt = at::softplus(dt, /*beta=*/1, /*threshold=*/20);
  dt = at::clamp(dt, dt_limit[0], dt_limit[1]);  // (T, H)

  // Chunk-major views. Padding positions (gather -1) get dt = 0 (an appended zero row), which leaves
  // the state alone and zeroes u there; x, B and C are gathered at a clamped index (padding reads
  // token 0, multiplied by dt = 0 or never read back), in their own dtype, widened after the gather.
  const at::Tensor flat = gather.reshape({-1});
  const at::Tensor index = at::where(flat < 0, at::full({}, T, flat.options()), flat);
  const at::Tensor clamped = flat.clamp_min(0);
  auto chunks = [&](const at::Tensor& t, const at::Tensor& idx) {
    std::vector<int64_t> shape{NC, L};
    for (int64_t d = 1; d < t.dim(); ++d) shape.push_back(t.size(d));
    return t.index_select(0, idx).view(shape);
  };
  const at::Tensor dtc = chunks(at::cat({dt, at::zeros({1, H}, dt.options())}, 0), index).permute({0, 2, 1});  // (NC, H, L)
  const at::Tensor xc = chunks(x_in, clamped).permute({0, 2, 1, 3});         // (NC, H, L, P), x's dtype
  const at::Tensor Bc = chunks(B_in, clamped).to(f).permute({0, 2, 1, 3});   // (NC, G, L, N)
  const at::Tensor Cc = chunks(C_in, clamped).to(f).permute({0, 2, 1, 3});   // (NC, G, L, N)

  const at::Tensor Gc = at::cumsum(dtc * A_in.to(f).view({1, H, 1}), -1);  // (NC, H, L), <= 0 and decreasing
  const at::Tensor G_last = Gc.narrow(-1, L - 1, 1);                        // (NC, H, 1)
  const at::Tensor u = (dtc.unsqueeze(-1) * xc.to(f)).contiguous();        // (NC, H, L, P)
  const at::Tensor kd = (Bc.unsqueeze(2) * at::exp(G_last - Gc).view({NC, G, hpg, L, 1})).view({NC, H, L, N});
  const at::Tensor decay = at::exp(G_last.squeeze(-1)).contiguous();       // (NC, H)

  // The state pass over the trie: h (NC, H, N, P) fp32 entering each chunk.
  std::optional<at::Tensor> h0 =
      chunked_initial_state("ssd_tree_scan", initial_state, {H, P, N}, {"heads", "head_dim", "state"}, "x", x_in.device(), f);
  if (h0) h0 = h0->transpose(-1, -2).contiguous();  // (..., H, N, P): the state pass's (K, V) layout
  const at::Tensor h = std::get<0>(chunk_state_pass(std::nullopt, u, kd.contiguous(), decay, h0, seg_chunk_offsets, parents,
                                                    root_index, level_segments, level_offsets, child_offsets, children))
                           .to(f);

  // Outputs of the chunk's own tokens and of the entering state, grouped matmuls (B, C per group).
  const at::Tensor hg = h.view({NC, G, hpg, N, P}).permute({0, 1, 3, 2, 4}).reshape({NC, G, N, hpg * P});
  at::Tensor y_state = at::matmul(Cc, hg).view({NC, G, L, hpg, P}).permute({0, 1, 3, 2, 4}).reshape({NC, H, L, P}) *
                             at::exp(Gc).unsqueeze(-1);
  // exp(G_i - G_j) below the diagonal, 0 above: masked to -inf before exp (in place: one (NC, H, L, L)
  // buffer instead of three), never exp of a positive number.
  const at::Tensor causal = at::ones({L, L}, gather.options().dtype(at::kBool)).tril();
  const at::Tensor decays = (Gc.unsqueeze(-1) - Gc.unsqueeze(-2))
                                .masked_fill_(causal.logical_not(), -std::numeric_limits<double>::infinity())
                                .exp_();
  const at::Tensor scores = (at::matmul(Cc, Bc.transpose(-1, -2)).unsqueeze(2) * decays.view({NC, G, hpg, L, L}))
                                .view({NC, H, L, L});
  at::Tensor y = y_state.add_(at::matmul(scores, u)).permute({0, 2, 1, 3}).reshape({NC * L, H, P}).index_select(0, scatter);

  if (D) y = y + (D->dim() == 1 ? D->to(f).view({H, 1}) : D->to(f)) * x_in.to(f);
  return gate_by_z("ssd_tree_scan", y, z_in, x_in.sizes(), f);
}

at::Tensor chunked_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                        TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                        const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                        const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z) {
#ifdef TREE_RECURRENCE_WITH_CUDA
  // bf16 / fp16 on CUDA: the fused tensor-core kernels (ssd_fused/ssd_fused.h) when they take the call.
  if (x.is_cuda()) {
    check(x, dt, B, C, gather, scatter, A, D, dt_bias, dt_limit);
    auto [args, tables] = fused::bind(x, dt, B, C, TREE_RECURRENCE_CHUNK_TABLE_ARGS, initial_state, A, dt_limit, D, dt_bias,
                                      dt_softplus, z);
    if (fused::supported(args, tables)) return fused::scan(args, tables);
  }
#endif
  return composite_scan(x, dt, B, C, TREE_RECURRENCE_CHUNK_TABLE_ARGS, initial_state, A, dt_limit, D, dt_bias, dt_softplus,
                        z);
}

}  // namespace tree_recurrence::ssd
