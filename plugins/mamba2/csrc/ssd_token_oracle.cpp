#include "ssd_token_oracle.h"
#include "ssd_chunked.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include <vector>

#include "tree_recurrence/sdk/segment_walk.h"

namespace tree_recurrence::ssd {
namespace {

void check(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C, const at::Tensor& seg_offsets,
           const at::Tensor& parents, const at::Tensor& A, const std::optional<at::Tensor>& D,
           const std::optional<at::Tensor>& dt_bias, at::ArrayRef<double> dt_limit) {
  check_scan_args("ssd_token_scan", x, dt, B, C, A, D, dt_bias, dt_limit);
  check_token_tables("ssd_token_scan", seg_offsets, parents, x.size(0));
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
  return gate_by_z("ssd_token_scan", y, z_in, x_in.sizes(), f);
}

}  // namespace tree_recurrence::ssd
