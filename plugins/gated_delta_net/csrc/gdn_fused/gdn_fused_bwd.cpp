// The fused GDN backward, host side: checks, allocation and the launches in order:
//   (a) kernels/dv_local_bwd.cu   dv_local, q_g
//   the SDK's reverse tree state pass (chunk_state_pass_tc_backward): dS per chunk, dv_total written
//       over dv_local (the pass reads each (chunk, head, V tile) of dv_local into shared memory, in the
//       CTA that alone writes that tile of dv_total, before writing it), the roots' initial-state
//       gradients
//   (b) kernels/dqk_bwd.cu        dq^ per key head (summed over its value heads in order, fp32),
//                                 dk^ per value head (fp32), dG
//   (c) kernels/wy_bwd.cu         the WY backward: dv, dbeta, dk^ +=, dG (total), dg
//   (d) kernels/finalize_bwd.cu   dq, dk at the tokens (group sum, scale, l2norm backward)
// (a), the state pass and (b) read dO at the tokens (grad_o through the gather table, pads zero): no
// chunk-major copy of dO. No host sync: the only host table is level_offsets. Math:
// tests/python/gdn_bwd_reference.py.
// Memory (GRPO, T = 49,152, HV = 32, HK = 16, K = V = 128, bf16): every buffer lives from right before
// its writer to right after its last reader; the saved w, kd go after the state pass and Ainv, h,
// v_new after (c) when the caller hands them over (ScanFunction without retain_graph). The peak is at
// the state pass: the saved buffers, dv_local (= dv_total), q_g, grad_state_out, the workspace.
#include "gdn_fused_bwd.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include "gdn_fused.h"

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/params_bwd.h"
#include "fused_host.h"
#endif

namespace tree_recurrence::gdn::fused {
namespace {

// Every intermediate and final gradient, in the order the stages op returns them.
struct Stages {
  at::Tensor dv_local, q_g, grad_state_out, dv_total, d_root, dq_hv, dk_b, dG_b, dk_hv, dG, dv, dbeta, dg, dq, dk;
  at::Tensor d_initial_state;
};

#ifndef TREE_RECURRENCE_WITH_CUDA
Stages run(const at::Tensor&, const GdnArgs&, Saved&, bool) {
  TR_CHECK(false, "fused GDN backward: this build has no CUDA kernels");
}
#else
static_assert(HasScale<kernels::GdnBwdParams>::value, "set_scalars: the backward takes the resolved scale");

void check_launch(const char* err, const char* stage) {
  fused::check_launch(err, "fused GDN backward (", stage);
}

void check_buffer(const at::Tensor& t, const char* name, at::IntArrayRef shape, at::ScalarType dtype, const at::Device& dev) {
  TR_CHECK_VALUE(t.defined(), "fused GDN backward: saved buffer ", name, " is missing");
  TR_CHECK_VALUE(t.sizes() == shape, "fused GDN backward: saved buffer ", name, " must be ", shape, ", got ", t.sizes());
  TR_CHECK_TYPE(t.scalar_type() == dtype, "fused GDN backward: saved buffer ", name, " must be ", dtype, ", got ",
                   t.scalar_type());
  TR_CHECK_VALUE(t.device() == dev, "fused GDN backward: saved buffer ", name, " is on ", t.device(), ", expected ", dev);
}

// keep_stages: clone (b)'s dk^ and dG before (c) adds to them, and dv_local before the state pass
// overwrites it (the stages op only). `saved` is released buffer by buffer after its last reader (each
// launch is enqueued before the release; the caching allocator reuses the block on this stream, in
// order): w, kd after the state pass, Ainv, h, v_new after (c). What the caller still holds stays alive.
Stages run(const at::Tensor& grad_o, const GdnArgs& a, Saved& saved, bool keep_stages) {
  const Tables& tables = a.tables;
  check_inputs(a, "fused GDN backward");
  static_assert(kernels::kBwdChunk == 64, "check_inputs checks chunk 64");
  const auto dt = a.v.scalar_type();
  const int64_t T = a.q.size(0), HK = a.q.size(1), K = a.q.size(2), HV = a.v.size(1), V = a.v.size(2);
  const int64_t NC = tables.gather.size(0), C = tables.gather.size(1), S = tables.parents.size(0);
  TR_CHECK_VALUE(grad_o.dim() == 3 && grad_o.size(0) == T && grad_o.size(1) == HV && grad_o.size(2) == V,
                    "fused GDN backward: grad_o must be (", T, ", ", HV, ", ", V, "), got ", grad_o.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"g", &a.g}, {"beta", &a.beta}})
    TR_CHECK_VALUE(t->dim() == 2 && t->size(0) == T && t->size(1) == HV, "fused GDN backward: ", name, " must be (", T,
                      ", ", HV, "), got ", t->sizes());
  const int64_t L = static_cast<int64_t>(tables.level_offsets.size()) - 1;
  TR_CHECK_VALUE(L >= 1 || S == 0, "fused GDN backward: level_offsets must have num_levels + 1 entries");
  const int64_t R = L >= 1 ? tables.level_offsets[1] - tables.level_offsets[0] : 0;
  const auto dev = a.q.device();
  check_buffer(saved.G, "G", {NC, HV, C}, at::kFloat, dev);
  check_buffer(saved.Ainv, "Ainv", {NC, HV, C, C}, dt, dev);
  check_buffer(saved.w, "w", {NC, HV, C, K}, dt, dev);
  check_buffer(saved.kd, "kd", {NC, HV, C, K}, dt, dev);
  check_buffer(saved.h, "h", {NC, HV, K, V}, dt, dev);
  check_buffer(saved.v_new, "v_new", {NC, HV, C, V}, dt, dev);
  check_buffer(saved.rq, "rq", {T, HK}, at::kFloat, dev);
  check_buffer(saved.rk, "rk", {T, HK}, at::kFloat, dev);

  c10::cuda::CUDAGuard guard(dev);
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  at::Tensor go = aligned(grad_o.to(dt));
  const at::Tensor q = aligned(a.q), k = aligned(a.k), v = aligned(a.v);
  const at::Tensor beta = a.beta.to(at::kFloat).contiguous();
  const at::Tensor G = saved.G.contiguous(), rq = saved.rq.contiguous(), rk = saved.rk.contiguous();
  at::Tensor Ainv = aligned(saved.Ainv), w = aligned(saved.w), kd = aligned(saved.kd), h = aligned(saved.h),
             v_new = aligned(saved.v_new);
  // drops a saved buffer: this function's reference and the one in `saved`
  auto release = [](at::Tensor& local, at::Tensor& owner) {
    local = at::Tensor();
    owner = at::Tensor();
  };
  const at::Tensor gather = tables.gather.contiguous(), scatter = tables.scatter.contiguous();
  const auto in_opt = q.options(), f32 = q.options().dtype(at::kFloat);

  // Buffers are allocated right before the stage that writes them and (outside the stages op)
  // released after the last stage that reads them, so the peak holds only the live ones (the
  // caching allocator reuses them on this stream, in order).
  Stages st;
  st.dv_local = at::empty({NC, HV, C, V}, in_opt);
  st.q_g = at::empty({NC, HV, C, K}, in_opt);
  at::Tensor decay = G.select(2, C - 1).exp().contiguous();

  kernels::GdnBwdParams p;
  p.num_chunks = NC;
  p.tokens = T;
  p.hk = HK;
  p.hv = HV;
  p.k_dim = K;
  p.v_dim = V;
  set_scalars(p, a);
  p.in = dt == at::kBFloat16 ? kernels::BwdDType::BFloat16 : kernels::BwdDType::Float16;
  p.gather = gather.data_ptr<int64_t>();
  p.scatter = scatter.data_ptr<int64_t>();
  p.q = q.data_ptr();  // each of q, k next to its norm factor
  p.rq = rq.data_ptr<float>();
  p.k = k.data_ptr();
  p.rk = rk.data_ptr<float>();
  p.v = v.data_ptr();
  p.grad_o = go.data_ptr();
  p.beta = beta.data_ptr<float>();
  p.G = G.data_ptr<float>();
  p.Ainv = Ainv.data_ptr();
  p.w = nullptr;  // no backward kernel of this file reads w (the state pass does, through sp.w)
  p.h = h.data_ptr();
  p.v_new = v_new.data_ptr();
  p.dv_local = st.dv_local.data_ptr();
  p.q_g = st.q_g.data_ptr();

  // (a)
  check_launch(kernels::gdn_bwd_dv_local(p, stream), "dv_local");

  st.grad_state_out = at::empty({NC, HV, K, V}, in_opt);
  st.dv_total = st.dv_local;  // the state pass writes dv_total over dv_local
  if (keep_stages) st.dv_local = st.dv_local.clone();
  st.d_root = at::zeros({R, HV, K, V}, f32);
  p.grad_state_out = st.grad_state_out.data_ptr();
  p.dv_total = st.dv_total.data_ptr();

  // the reverse tree state pass
  {
    PassTables pass_tables;
    auto sp = state_pass_params(tables, pass_tables, NC, HV, K, V, R, dt);
    sp.w = w.data_ptr();
    sp.kd = kd.data_ptr();
    sp.decay = decay.data_ptr<float>();
    // dv_local's buffer is dv_total's own (st.dv_local is then a copy, or the same tensor)
    sp.dv_local = st.dv_total.data_ptr();
    sp.q_g = st.q_g.data_ptr();
    sp.grad_out = go.data_ptr();  // dO at the tokens, through gather
    sp.grad_out_rows = gather.data_ptr<int64_t>();
    sp.grad_state_out = st.grad_state_out.data_ptr();
    sp.dv_total = st.dv_total.data_ptr();
    sp.grad_initial = st.d_root.data_ptr<float>();
    const at::Tensor workspace = at::empty({S, HV, K, V}, f32);
    sp.workspace = workspace.data_ptr<float>();
    if (S > 0) check_launch(tree_recurrence::kernels::chunk_state_pass_tc_backward(sp, stream), "state pass");
  }  // workspace, the pass's tables
  // w, kd, decay: the state pass was their last reader
  release(w, saved.w);
  release(kd, saved.kd);
  decay = at::Tensor();
  if (!keep_stages) {
    st.dv_local = at::Tensor();  // dv_total keeps the buffer
    st.q_g = at::Tensor();
    p.dv_local = p.q_g = nullptr;
  }

  // (b)
  st.dq_hv = at::empty({NC, HK, C, K}, f32);
  st.dk_hv = at::empty({NC, HV, C, K}, f32);
  st.dG = at::empty({NC, HV, C}, f32);
  p.dq_hv = st.dq_hv.data_ptr<float>();
  p.dk_hv = st.dk_hv.data_ptr<float>();
  p.dG = st.dG.data_ptr<float>();
  check_launch(kernels::gdn_bwd_dqk(p, stream), "dq/dk");
  if (keep_stages) {
    st.dk_b = st.dk_hv.clone();
    st.dG_b = st.dG.clone();
  } else {
    go = at::Tensor();  // (b) was its last reader
    st.grad_state_out = at::Tensor();
    p.grad_o = nullptr;
    p.grad_state_out = nullptr;
  }
  // (c)
  st.dv = at::empty({T, HV, V}, in_opt);
  st.dbeta = at::empty({T, HV}, f32);
  st.dg = at::empty({T, HV}, f32);
  p.dv = st.dv.data_ptr();
  p.dbeta = st.dbeta.data_ptr<float>();
  p.dg = st.dg.data_ptr<float>();
  check_launch(kernels::gdn_bwd_wy(p, stream), "WY backward");
  if (!keep_stages) st.dv_total = at::Tensor();
  // Ainv, h, v_new: (c) was their last reader
  release(Ainv, saved.Ainv);
  release(h, saved.h);
  release(v_new, saved.v_new);
  p.Ainv = p.h = p.v_new = p.dv_total = nullptr;
  // (d)
  st.dq = at::empty({T, HK, K}, in_opt);
  st.dk = at::empty({T, HK, K}, in_opt);
  p.dq = st.dq.data_ptr();
  p.dk = st.dk.data_ptr();
  check_launch(kernels::gdn_bwd_finalize(p, stream), "finalize");
  if (!keep_stages) {
    st.dq_hv = at::Tensor();
    st.dk_hv = at::Tensor();
    st.dG = at::Tensor();
  }

  if (a.has_initial_state()) {
    const at::Tensor& s0 = *a.initial_state;
    if (s0.dim() == 3)
      st.d_initial_state = st.d_root.sum(0);
    else if (s0.dim() == 4 && s0.size(0) == 1)
      st.d_initial_state = st.d_root.sum(0, /*keepdim=*/true);
    else
      st.d_initial_state = st.d_root;
    st.d_initial_state = st.d_initial_state.to(s0.scalar_type());
  }
  return st;
}
#endif

}  // namespace

Grads backward(const at::Tensor& grad_o, const GdnArgs& a, Saved&& saved) {
  at::NoGradGuard no_grad;
  Saved sv = std::move(saved);  // released buffer by buffer inside run
  Stages st = run(grad_o, a, sv, /*keep_stages=*/false);
  Grads gr;  // each fp32 result released right after its cast
  gr.dq = st.dq.to(a.q.scalar_type());
  st.dq = at::Tensor();
  gr.dk = st.dk.to(a.k.scalar_type());
  st.dk = at::Tensor();
  gr.dv = st.dv.to(a.v.scalar_type());
  st.dv = at::Tensor();
  gr.dg = st.dg.to(a.g.scalar_type());
  gr.dbeta = st.dbeta.to(a.beta.scalar_type());
  gr.d_initial_state = st.d_initial_state;
  return gr;
}

std::vector<at::Tensor> backward_stages(const at::Tensor& grad_o, const GdnArgs& a, Saved saved) {
  at::NoGradGuard no_grad;
  Stages st = run(grad_o, a, saved, /*keep_stages=*/true);
  return {st.dv_local, st.q_g, st.grad_state_out, st.dv_total, st.d_root, st.dq_hv, st.dk_b, st.dG_b, st.dk_hv, st.dG,
          st.dv,       st.dbeta, st.dg,         st.dq,       st.dk,
          st.d_initial_state.defined() ? st.d_initial_state : at::empty({0}, st.dq.options())};
}

}  // namespace tree_recurrence::gdn::fused
