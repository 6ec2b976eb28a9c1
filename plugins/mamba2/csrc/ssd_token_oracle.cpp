#include "ssd_token_oracle.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include <vector>

#include "tree_recurrence/sdk/segment_walk.h"

namespace tree_recurrence::ssd {
namespace {

void check(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C, const at::Tensor& seg_offsets,
           const at::Tensor& parents, const at::Tensor& A, const std::optional<at::Tensor>& D,
           const std::optional<at::Tensor>& dt_bias, at::ArrayRef<double> dt_limit) {
  TR_CHECK_VALUE(x.dim() == 3, "ssd_token_scan: x must be (tokens, heads, head_dim), got ", x.sizes());
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2);
  TR_CHECK_VALUE(dt.dim() == 2 && dt.size(0) == T && dt.size(1) == H, "ssd_token_scan: dt must be (tokens, heads)=", T, "x",
                    H, ", got ", dt.sizes());
  TR_CHECK_VALUE(B.dim() == 3 && B.size(0) == T && C.sizes() == B.sizes(),
                    "ssd_token_scan: B and C must be (tokens, groups, state) alike, got ", B.sizes(), " and ", C.sizes());
  TR_CHECK_VALUE(B.size(1) > 0 && H % B.size(1) == 0, "ssd_token_scan: heads ", H, " must be a multiple of groups ",
                    B.size(1));
  TR_CHECK_VALUE(A.dim() == 1 && A.size(0) == H, "ssd_token_scan: A must be (heads=", H, "), got ", A.sizes());
  if (D)
    TR_CHECK_VALUE((D->dim() == 1 && D->size(0) == H) || (D->dim() == 2 && D->size(0) == H && D->size(1) == P),
                      "ssd_token_scan: D must be (heads=", H, ") or (heads, head_dim=", P, "), got ", D->sizes());
  if (dt_bias)
    TR_CHECK_VALUE(dt_bias->dim() == 1 && dt_bias->size(0) == H, "ssd_token_scan: dt_bias must be (heads=", H, "), got ",
                      dt_bias->sizes());
  TR_CHECK_VALUE(dt_limit.size() == 2 && dt_limit[0] <= dt_limit[1],
                    "ssd_token_scan: dt_limit must be (low, high) with low <= high");
  TR_CHECK_VALUE(seg_offsets.is_cpu() && parents.is_cpu() && seg_offsets.scalar_type() == at::kLong &&
                        parents.scalar_type() == at::kLong,
                    "ssd_token_scan: seg_offsets and parents must be int64 CPU tensors (the plan's host arrays)");
  TR_CHECK_VALUE(seg_offsets.numel() == parents.numel() + 1, "ssd_token_scan: seg_offsets must have one more entry than parents");
  TR_CHECK_VALUE(seg_offsets.numel() >= 2 && seg_offsets.data_ptr<int64_t>()[seg_offsets.numel() - 1] == T,
                    "ssd_token_scan: seg_offsets must end at the number of tokens ", T);
}

}  // namespace

at::Tensor token_oracle(const at::Tensor& x_in, const at::Tensor& dt_in, const at::Tensor& B_in, const at::Tensor& C_in,
                     const at::Tensor& seg_offsets, const at::Tensor& parents, const std::optional<at::Tensor>& initial_state,
                     const at::Tensor& A_in, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                     const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z_in) {
  check(x_in, dt_in, B_in, C_in, seg_offsets, parents, A_in, D, dt_bias, dt_limit);
  const int64_t H = x_in.size(1), P = x_in.size(2), N = B_in.size(2);
  const int64_t heads_per_group = H / B_in.size(1);

  // dt as the reference prepares it: bias, softplus and clamp in dt's own dtype, then fp32.
  at::Tensor dt = dt_in;
  if (dt_bias) dt = dt + dt_bias->to(dt.scalar_type());
  if (dt_softplus) dt = at::softplus(dt, /*beta=*/1, /*threshold=*/20);
  const auto f = x_in.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  dt = at::clamp(dt, dt_limit[0], dt_limit[1]).to(f);  // (T, H)

  const at::Tensor x = x_in.to(f);
  at::Tensor B = B_in.to(f), C = C_in.to(f);
  if (heads_per_group > 1) {
    B = B.repeat_interleave(heads_per_group, 1);  // (T, H, N)
    C = C.repeat_interleave(heads_per_group, 1);
  }
  const at::Tensor decay = (dt * A_in.to(f)).exp();  // (T, H)
  const at::Tensor dx = x * dt.unsqueeze(-1);                 // (T, H, P)

  std::vector<at::Tensor> outputs(x.size(0));
  walk_segments("ssd_token_scan", seg_offsets, parents, initial_state, {H, P, N}, x.options(), [&](at::Tensor state, int64_t t) {
    state = state * decay[t].view({H, 1, 1}) + dx[t].unsqueeze(-1) * B[t].unsqueeze(1);  // (H, P, N)
    outputs[t] = (state * C[t].unsqueeze(1)).sum(-1);                                      // (H, P)
    return state;
  });
  at::Tensor y = at::stack(outputs);  // (T, H, P) fp32
  if (D) y = y + (D->dim() == 1 ? D->view({H, 1}) : *D) * x;
  if (z_in) {
    at::Tensor z = *z_in;
    if (z.dim() == 4) {
      TR_CHECK_VALUE(z.size(0) == 1, "ssd_token_scan: z must be (tokens, heads, head_dim) or (1, tokens, ...), got ", z.sizes());
      z = z[0];
    }
    TR_CHECK_VALUE(z.sizes() == x_in.sizes(), "ssd_token_scan: z must be shaped like x ", x_in.sizes(), ", got ", z.sizes());
    y = y * at::silu(z.to(f));
  }
  return y;
}

}  // namespace tree_recurrence::ssd
