// The fused GDN forward, host side: checks, allocation, and the three stages
// (kernels/prep_fwd.cu, the SDK's tensor-core tree state pass, kernels/out_fwd.cu). No host sync:
// the only host table is level_offsets.
#include <ATen/ATen.h>
#include "tree_recurrence/sdk/check.h"
#include "tree_recurrence/sdk/element_type.h"
#include <ATen/core/grad_mode.h>

#include "gdn_fused.h"

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/params.h"
#include "fused_host.h"
#endif

namespace tree_recurrence::gdn::fused {

std::vector<at::Tensor> stages(const GdnArgs& a) {
  at::AutoGradMode no_grad(false);
  auto [o, sv] = forward(a);
  return {o, sv.G, sv.Ainv, sv.w, sv.u, sv.kd, sv.decay, sv.h, sv.v_new, sv.final_state, sv.rq, sv.rk};
}

#ifndef TREE_RECURRENCE_WITH_CUDA
std::pair<at::Tensor, Saved> forward(const GdnArgs&) {
  TR_CHECK(false, "gdn_tree_scan (fused): this build has no CUDA kernels");
}
#else
namespace {

// set_scalars fills a scale only where the block has one: the out stage's, not prep's (which reads no q).
static_assert(HasScale<kernels::OutParams>::value && !HasScale<kernels::PrepParams>::value,
              "set_scalars: the out stage takes the resolved scale");

void check_launch(const char* err, const char* stage) {
  fused::check_launch(err, "gdn_tree_scan (fused forward, ", stage);
}

// The fields the prep and the out stages' parameters share.
template <typename P>
P tile_params(const GdnArgs& a, int64_t NC, kernels::InType it, const at::Tensor& gather) {
  P p;
  p.num_chunks = NC;
  p.tokens = a.q.size(0);
  p.key_heads = static_cast<int>(a.q.size(1));
  p.value_heads = static_cast<int>(a.v.size(1));
  p.k_dim = static_cast<int>(a.q.size(2));
  p.v_dim = static_cast<int>(a.v.size(2));
  set_scalars(p, a);
  p.in = it;
  p.gather = gather.data_ptr<int64_t>();
  return p;
}

}  // namespace

std::pair<at::Tensor, Saved> forward(const GdnArgs& a) {
  const Tables& tables = a.tables;
  check_inputs(a, "gdn_tree_scan (fused)");
  static_assert(kernels::kChunk == 64, "check_inputs checks chunk 64");
  const auto dt = a.v.scalar_type();
  const int64_t T = a.q.size(0), HK = a.q.size(1), K = a.q.size(2), HV = a.v.size(1), V = a.v.size(2);
  const int64_t NC = tables.gather.size(0), C = tables.gather.size(1);
  const int64_t S = tables.parents.size(0);
  const int64_t L = static_cast<int64_t>(tables.level_offsets.size()) - 1;
  TR_CHECK_VALUE(L >= 0 || S == 0, "gdn_tree_scan (fused): level_offsets must have num_levels + 1 entries");
  const int64_t R = L >= 1 ? tables.level_offsets[1] : 0;

  c10::cuda::CUDAGuard guard(a.q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const at::Tensor q = aligned(a.q), k = aligned(a.k), v = aligned(a.v);
  // g, beta as they come (fp32 or the inputs' 16-bit type, fused::supported): prep widens them, no cast copy
  const auto row_input = [](const at::Tensor& x) {
    const auto kt = sdk::kernel_dtype<tree_recurrence::kernels::DType>(x.scalar_type());
    return kt && *kt != tree_recurrence::kernels::DType::Float64 ? x.contiguous() : x.to(at::kFloat).contiguous();
  };
  const at::Tensor g = row_input(a.g), beta = row_input(a.beta);
  const at::Tensor gather = tables.gather.contiguous();
  const auto f32 = q.options().dtype(at::kFloat), in = v.options();
  const kernels::InType it = dt == at::kBFloat16 ? kernels::InType::BFloat16 : kernels::InType::Float16;

  Saved sv;
  sv.G = at::empty({NC, HV, C}, f32);
  sv.Ainv = at::empty({NC, HV, C, C}, in);
  sv.w = at::empty({NC, HV, C, K}, in);
  sv.u = at::empty({NC, HV, C, V}, in);
  sv.kd = at::empty({NC, HV, C, K}, in);
  sv.decay = at::empty({NC, HV}, f32);
  sv.rq = at::empty({T, HK}, f32);
  sv.rk = at::empty({T, HK}, f32);
  sv.h = at::empty({NC, HV, K, V}, in);
  sv.v_new = at::empty({NC, HV, C, V}, in);
  sv.final_state = at::empty({S, HV, K, V}, f32);
  at::Tensor o = at::empty({T, HV, V}, in);
  if (NC == 0 || T == 0) return {o, sv};

  // 1. prep
  auto pp = tile_params<kernels::PrepParams>(a, NC, it, gather);
  pp.k = k.data_ptr();
  pp.v = v.data_ptr();
  pp.g = g.data_ptr();
  pp.beta = beta.data_ptr();
  pp.g_type = *sdk::kernel_dtype<tree_recurrence::kernels::DType>(g.scalar_type());
  pp.beta_type = *sdk::kernel_dtype<tree_recurrence::kernels::DType>(beta.scalar_type());
  pp.G = sv.G.data_ptr<float>();
  pp.Ainv = sv.Ainv.data_ptr();
  pp.w = sv.w.data_ptr();
  pp.u = sv.u.data_ptr();
  pp.kd = sv.kd.data_ptr();
  pp.decay = sv.decay.data_ptr<float>();
  pp.rk = sv.rk.data_ptr<float>();
  check_launch(kernels::launch_prep_fwd(pp, stream), "prep");

  // 2. the tree state pass on tensor cores
  at::Tensor h0;
  bool per_root = false;
  if (a.has_initial_state()) {
    at::Tensor s0 = *a.initial_state;
    if (s0.dim() == 4 && s0.size(0) == 1) s0 = s0[0];
    TR_CHECK_VALUE((s0.dim() == 3 || (s0.dim() == 4 && s0.size(0) == R)) && s0.size(-3) == HV && s0.size(-2) == K &&
                          s0.size(-1) == V,
                      "gdn_tree_scan: initial_state must be (value_heads=", HV, ", key_dim=", K, ", value_dim=", V,
                      ") or (roots=", R, ", ", HV, ", ", K, ", ", V, "), got ", a.initial_state->sizes());
    per_root = s0.dim() == 4;
    h0 = s0.to(at::kFloat).contiguous();
  }
  PassTables pass_tables;
  auto sp = state_pass_params(tables, pass_tables, NC, HV, K, V, R, dt);
  sp.w = sv.w.data_ptr();
  sp.u = sv.u.data_ptr();
  sp.kd = sv.kd.data_ptr();
  sp.decay = sv.decay.data_ptr<float>();
  sp.initial_state = h0.defined() ? h0.data_ptr<float>() : nullptr;
  sp.initial_per_root = per_root;
  sp.h = sv.h.data_ptr();
  sp.v_new = sv.v_new.data_ptr();
  sp.final_state = sv.final_state.data_ptr<float>();
  check_launch(tree_recurrence::kernels::chunk_state_pass_tc_forward(sp, stream), "tree state pass");

  // 3. outputs
  auto op = tile_params<kernels::OutParams>(a, NC, it, gather);
  op.q = q.data_ptr();
  op.k = k.data_ptr();
  op.G = sv.G.data_ptr<float>();
  op.h = sv.h.data_ptr();
  op.v_new = sv.v_new.data_ptr();
  op.o = o.data_ptr();
  op.rq = sv.rq.data_ptr<float>();  // q's norms: the out stage loads q (prep does not)
  check_launch(kernels::launch_out_fwd(op, stream), "outputs");
  return {o, sv};
}
#endif  // TREE_RECURRENCE_WITH_CUDA

}  // namespace tree_recurrence::gdn::fused
