// The fused GDN backward (issue 19), host side: checks, allocation and the launches in order:
//   (a) kernels/dv_local_bwd.cu   dv_local, q_g (and dO chunk-major, do_c, only with
//                                 TREE_RECURRENCE_GDN_BWD_DO_TOKENS=0: else the readers gather grad_o)
//   the SDK's reverse tree state pass (chunk_state_pass_tc_backward): dS per chunk, dv_total,
//       the roots' initial-state gradients
//   (b) kernels/dqk_bwd.cu        dq^ per key head (summed over its value heads; or per value head),
//                                 dk^ per value head (fp32), dG
//   (c) kernels/wy_bwd.cu         the WY backward: dv, dbeta, dk^ +=, dG (total), dg
//   (d) kernels/finalize_bwd.cu   dq, dk at the tokens (group sum, scale, l2norm backward)
// No host sync: the only host table is level_offsets. Math: tests/python/gdn_bwd_reference.py.
// Memory (GRPO, T = 49,152, HV = 32, HK = 16, K = V = 128, bf16): every buffer lives from right before
// its writer to right after its last reader; the saved w, kd go after the state pass and Ainv, h,
// v_new after (c) when the caller hands them over (ScanFunction without retain_graph). The peak is at
// the state pass: the saved buffers, dv_local (= dv_total), q_g, grad_state_out, the workspace (no do_c:
// the pass and (b) read grad_o at the tokens).
#include "gdn_fused_bwd.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gdn_fused.h"
#include "tree_recurrence/sdk/op_library.h"

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/params_bwd.h"
#include "fused_host.h"
#endif

namespace tree_recurrence::gdn::fused {
namespace {

// Every intermediate and final gradient, in the order the stages op returns them.
struct Stages {
  at::Tensor dv_local, q_g, do_c, grad_state_out, dv_total, d_root, dq_hv, dk_b, dG_b, dk_hv, dG, dv, dbeta, dg, dq, dk;
  at::Tensor d_initial_state;
};

#ifndef TREE_RECURRENCE_WITH_CUDA
Stages run(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
           const Tables&, const std::optional<at::Tensor>&, double, bool, Saved&, bool, int64_t) {
  TR_CHECK(false, "fused GDN backward: this build has no CUDA kernels");
}
#else
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

// The switches of the memory-lean backward, each read once ("0": the previous path, kept until the GPU
// confirms the new one):
//   TREE_RECURRENCE_GDN_BWD_DQ_SUM      (b) sums dq^ over the value heads of each key head into an
//                                       (NC, HK, C, K) fp32 buffer (kernels/dqk_bwd.cu), instead of an
//                                       (NC, HV, C, K) one summed by (d)
//   TREE_RECURRENCE_GDN_BWD_DV_INPLACE  the state pass writes dv_total over dv_local (it reads each
//                                       (chunk, head, V tile) of dv_local into shared memory, in the CTA
//                                       that alone writes that tile of dv_total, before writing it)
//   TREE_RECURRENCE_GDN_BWD_DO_TOKENS   the state pass and (b) read dO at the tokens (grad_o through the
//                                       gather table, pads zero) instead of a chunk-major copy do_c
//                                       written by (a): the same tiles, 0.40 GB less at GRPO
// TREE_RECURRENCE_GDN_MEMTRACE=1 (read once): after each stage's launch, the caching allocator's current
// and peak allocated bytes of the device to stderr (host-side counters, no sync).
bool env_on(const char* name) {
  const char* e = std::getenv(name);
  return !(e != nullptr && std::strcmp(e, "0") == 0);
}
bool env_dq_sum() {
  static const bool on = env_on("TREE_RECURRENCE_GDN_BWD_DQ_SUM");
  return on;
}
bool env_dv_inplace() {
  static const bool on = env_on("TREE_RECURRENCE_GDN_BWD_DV_INPLACE");
  return on;
}
bool env_do_tokens() {
  static const bool on = env_on("TREE_RECURRENCE_GDN_BWD_DO_TOKENS");
  return on;
}
bool env_memtrace() {
  static const bool on = [] {
    const char* e = std::getenv("TREE_RECURRENCE_GDN_MEMTRACE");
    return e != nullptr && std::strcmp(e, "1") == 0;
  }();
  return on;
}
void memtrace(const char* stage, c10::DeviceIndex dev) {
  if (!env_memtrace()) return;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(dev);
  const auto& a = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
  std::fprintf(stderr, "[gdn bwd memtrace] %-34s allocated %10.1f MiB  peak %10.1f MiB\n", stage,
               static_cast<double>(a.current) / 1048576.0, static_cast<double>(a.peak) / 1048576.0);
}

// keep_stages: clone (b)'s dk^ and dG before (c) adds to them, and dv_local before the state pass
// overwrites it (the stages op only). mode: -1 the switches above; else bit 0 dq^ per key head, bit 1
// dv_total in place. `saved` is released buffer by buffer after its last reader (each launch is
// enqueued before the release; the caching allocator reuses the block on this stream, in order):
// w, kd after the state pass, Ainv, h, v_new after (c). What the caller still holds stays alive.
Stages run(const at::Tensor& grad_o, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
           const at::Tensor& g_in, const at::Tensor& beta_in, const Tables& tables,
           const std::optional<at::Tensor>& initial_state, double scale, bool use_qk_l2norm, Saved& saved,
           bool keep_stages, int64_t mode) {
  check_inputs(q_in, k_in, v_in, tables, "fused GDN backward");
  static_assert(kernels::kBwdChunk == 64, "check_inputs checks chunk 64");
  const auto dt = v_in.scalar_type();
  const int64_t T = q_in.size(0), HK = q_in.size(1), K = q_in.size(2), HV = v_in.size(1), V = v_in.size(2);
  const int64_t NC = tables.gather.size(0), C = tables.gather.size(1), S = tables.parents.size(0);
  TR_CHECK_VALUE(grad_o.dim() == 3 && grad_o.size(0) == T && grad_o.size(1) == HV && grad_o.size(2) == V,
                    "fused GDN backward: grad_o must be (", T, ", ", HV, ", ", V, "), got ", grad_o.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"g", &g_in}, {"beta", &beta_in}})
    TR_CHECK_VALUE(t->dim() == 2 && t->size(0) == T && t->size(1) == HV, "fused GDN backward: ", name, " must be (", T,
                      ", ", HV, "), got ", t->sizes());
  const int64_t L = static_cast<int64_t>(tables.level_offsets.size()) - 1;
  TR_CHECK_VALUE(L >= 1 || S == 0, "fused GDN backward: level_offsets must have num_levels + 1 entries");
  TR_CHECK_VALUE(mode >= -1 && mode <= 7, "fused GDN backward: mode must be -1 (the switches) or 0..7, got ", mode);
  const int64_t R = L >= 1 ? tables.level_offsets[1] - tables.level_offsets[0] : 0;
  const auto dev = q_in.device();
  check_buffer(saved.G, "G", {NC, HV, C}, at::kFloat, dev);
  check_buffer(saved.Ainv, "Ainv", {NC, HV, C, C}, dt, dev);
  check_buffer(saved.w, "w", {NC, HV, C, K}, dt, dev);
  check_buffer(saved.kd, "kd", {NC, HV, C, K}, dt, dev);
  check_buffer(saved.h, "h", {NC, HV, K, V}, dt, dev);
  check_buffer(saved.v_new, "v_new", {NC, HV, C, V}, dt, dev);
  check_buffer(saved.rq, "rq", {T, HK}, at::kFloat, dev);
  check_buffer(saved.rk, "rk", {T, HK}, at::kFloat, dev);
  const bool dq_sum = mode < 0 ? env_dq_sum() : (mode & 1) != 0;
  const bool dv_inplace = mode < 0 ? env_dv_inplace() : (mode & 2) != 0;
  const bool do_tokens = mode < 0 ? env_do_tokens() : (mode & 4) != 0;

  c10::cuda::CUDAGuard guard(dev);
  const auto di = dev.index();
  const auto stream = c10::cuda::getCurrentCUDAStream().stream();
  memtrace("start", di);
  at::Tensor go = aligned(grad_o.to(dt));
  const at::Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  const at::Tensor beta = beta_in.to(at::kFloat).contiguous();
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
  if (!do_tokens) st.do_c = at::empty({NC, HV, C, V}, in_opt);
  at::Tensor decay = G.select(2, C - 1).exp().contiguous();

  kernels::GdnBwdParams p;
  p.num_chunks = NC;
  p.tokens = T;
  p.hk = HK;
  p.hv = HV;
  p.k_dim = K;
  p.v_dim = V;
  p.scale = static_cast<float>(scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(K)));
  p.use_qk_l2norm = use_qk_l2norm;
  p.dq_key_heads = dq_sum;
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
  p.do_c = do_tokens ? nullptr : st.do_c.data_ptr();

  // (a)
  check_launch(kernels::gdn_bwd_dv_local(p, stream), "dv_local");
  memtrace("(a) dv_local", di);
  if (!do_tokens) {
    go = at::Tensor();  // (a) was its only reader (a cast copy, if any, goes here)
    p.grad_o = nullptr;
  } else if (keep_stages) {  // the stages op's do_c: dO at the chunk rows, pads zero (what (a) would write)
    const at::Tensor rows = gather.view({-1});
    const at::Tensor picked = go.index_select(0, rows.clamp_min(0)).masked_fill(rows.lt(0).view({-1, 1, 1}), 0);
    st.do_c = picked.view({NC, C, HV, V}).permute({0, 2, 1, 3}).contiguous();
  }

  st.grad_state_out = at::empty({NC, HV, K, V}, in_opt);
  if (dv_inplace) {
    st.dv_total = st.dv_local;  // written over dv_local (see env_dv_inplace above)
    if (keep_stages) st.dv_local = st.dv_local.clone();
  } else {
    st.dv_total = at::empty({NC, HV, C, V}, in_opt);
  }
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
    // dv_local's buffer: dv_total's own when in place (st.dv_local is then a copy, or the same tensor)
    sp.dv_local = dv_inplace ? st.dv_total.data_ptr() : st.dv_local.data_ptr();
    sp.q_g = st.q_g.data_ptr();
    sp.grad_out = do_tokens ? go.data_ptr() : st.do_c.data_ptr();
    sp.grad_out_rows = do_tokens ? gather.data_ptr<int64_t>() : nullptr;
    sp.grad_state_out = st.grad_state_out.data_ptr();
    sp.dv_total = st.dv_total.data_ptr();
    sp.grad_initial = st.d_root.data_ptr<float>();
    const at::Tensor workspace = at::empty({S, HV, K, V}, f32);
    sp.workspace = workspace.data_ptr<float>();
    if (S > 0) check_launch(tree_recurrence::kernels::chunk_state_pass_tc_backward(sp, stream), "state pass");
    memtrace("state pass", di);
  }  // workspace, the pass's tables
  // w, kd, decay: the state pass was their last reader
  release(w, saved.w);
  release(kd, saved.kd);
  decay = at::Tensor();
  if (!keep_stages) {
    st.dv_local = at::Tensor();  // (in place: dv_total keeps the buffer)
    st.q_g = at::Tensor();
    p.dv_local = p.q_g = nullptr;
  }
  memtrace("state pass: w, kd, q_g released", di);

  // (b)
  st.dq_hv = at::empty({NC, dq_sum ? HK : HV, C, K}, f32);
  st.dk_hv = at::empty({NC, HV, C, K}, f32);
  st.dG = at::empty({NC, HV, C}, f32);
  p.dq_hv = st.dq_hv.data_ptr<float>();
  p.dk_hv = st.dk_hv.data_ptr<float>();
  p.dG = st.dG.data_ptr<float>();
  check_launch(kernels::gdn_bwd_dqk(p, stream), "dq/dk");
  memtrace("(b) dq/dk", di);
  if (keep_stages) {
    st.dk_b = st.dk_hv.clone();
    st.dG_b = st.dG.clone();
  } else {
    st.do_c = at::Tensor();
    go = at::Tensor();  // (b) was the last reader of either
    st.grad_state_out = at::Tensor();
    p.do_c = nullptr;
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
  memtrace("(c) WY backward", di);
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
  memtrace("(d) finalize", di);
  if (!keep_stages) {
    st.dq_hv = at::Tensor();
    st.dk_hv = at::Tensor();
    st.dG = at::Tensor();
  }

  if (initial_state && initial_state->defined()) {
    const at::Tensor& s0 = *initial_state;
    if (s0.dim() == 3)
      st.d_initial_state = st.d_root.sum(0);
    else if (s0.dim() == 4 && s0.size(0) == 1)
      st.d_initial_state = st.d_root.sum(0, /*keepdim=*/true);
    else
      st.d_initial_state = st.d_root;
    st.d_initial_state = st.d_initial_state.to(s0.scalar_type());
  }
  memtrace("end", di);
  return st;
}
#endif

}  // namespace

Grads backward(const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
               const at::Tensor& beta, const Tables& tables, const std::optional<at::Tensor>& initial_state, double scale,
               bool use_qk_l2norm, Saved&& saved) {
  at::NoGradGuard no_grad;
  Saved sv = std::move(saved);  // released buffer by buffer inside run
  Stages st = run(grad_o, q, k, v, g, beta, tables, initial_state, scale, use_qk_l2norm, sv, /*keep_stages=*/false,
                  /*mode=*/-1);
  Grads gr;  // each fp32 result released right after its cast
  gr.dq = st.dq.to(q.scalar_type());
  st.dq = at::Tensor();
  gr.dk = st.dk.to(k.scalar_type());
  st.dk = at::Tensor();
  gr.dv = st.dv.to(v.scalar_type());
  st.dv = at::Tensor();
  gr.dg = st.dg.to(g.scalar_type());
  gr.dbeta = st.dbeta.to(beta.scalar_type());
  gr.d_initial_state = st.d_initial_state;
  return gr;
}

namespace {

// The op gdn_fused_backward_stages (gdn_fused_bwd.h): the stages' outputs from given saved buffers.
std::vector<at::Tensor> backward_stages(const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                        TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                                        double scale, bool use_qk_l2norm, const at::Tensor& G, const at::Tensor& Ainv,
                                        const at::Tensor& w, const at::Tensor& kd, const at::Tensor& h,
                                        const at::Tensor& v_new, const at::Tensor& rq, const at::Tensor& rk, int64_t mode) {
  const Tables t = Tables::of(TREE_RECURRENCE_CHUNK_TABLE_ARGS);
  Saved sv{G, Ainv, w, kd, h, v_new, rq, rk};  // the backward's saved buffers (the forward-only ones undefined)
  at::NoGradGuard no_grad;
  Stages st = run(grad_o, q, k, v, g, beta, t, initial_state, scale, use_qk_l2norm, sv, /*keep_stages=*/true, mode);
  return {st.dv_local, st.q_g,   st.do_c, st.grad_state_out, st.dv_total, st.d_root, st.dq_hv, st.dk_b, st.dG_b,
          st.dk_hv,    st.dG,    st.dv,   st.dbeta,          st.dg,       st.dq,     st.dk,
          st.d_initial_state.defined() ? st.d_initial_state : at::empty({0}, st.dq.options())};
}

}  // namespace

void register_backward_stages_op() {
  op_library(torch::Library::FRAGMENT)
      .def("gdn_fused_backward_stages(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor gather, "
           "Tensor scatter, Tensor seg_chunk_offsets, Tensor parents, Tensor root_index, Tensor level_segments, "
           "int[] level_offsets, Tensor child_offsets, Tensor children, Tensor? initial_state, float scale, "
           "bool use_qk_l2norm, Tensor G, Tensor Ainv, Tensor w, Tensor kd, Tensor h, Tensor v_new, Tensor rq, "
           "Tensor rk, int mode=-1) -> Tensor[]");
  op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd)
      .impl("gdn_fused_backward_stages", &backward_stages);
}

}  // namespace tree_recurrence::gdn::fused
