// fused::backward (ssd_fused.h): the fused SSD backward from the forward's saved buffers, and the test-only op
// ssd_fused_backward_stages (ssd_fused_bwd.h) that runs it from given buffers and returns every stage's output.
//
// The kernel plan (BwdPlan, plan_backward) picks one route per call, from the shapes, dtypes and alignment of the
// inputs (kernels/params_bwd.h has the kernels' layouts):
//   Half: x / B / C / grad_out / states (/ z, y) of one 16-bit type, chunk 64, P and N multiples of 8 up to 128
//     within the tensor-core shared-memory plan (the route of bf16 / fp16 models). Either the fused reverse
//     local + state pass (kernels/ssd_state_pass_bwd.cu, ds_local never stored) where the segments are short
//     (fused_passes_suit: a trie), or local_bf16 (kernels/ssd_local_bwd.cu) + the reverse state pass on long
//     segments (one flat row: the fused pass walks each (segment, head) chunk by chunk, so one long segment
//     leaves it H CTAs where local_bf16 runs NC x H at once); then post_bf16 (kernels/ssd_post_bwd.cu). ds is kept
//     in x's 16-bit type; dy is formed from dout / z inside the kernels (no gate kernel, no fp32 dy).
//   TensorCore: chunk-64 inputs the 16-bit kernels refuse (a z of another dtype, unaligned views, the fp32 stage
//     tests): gate -> local_tc -> reverse state pass -> post_tc (kernels/ssd_tc_bwd.cu, fp32 operands split into
//     bf16 hi + lo); fp32 ds.
//   CudaCore: chunk 128 / 256, or P / N beyond the tensor-core plan. The forward takes these shapes and the
//     composite's state pass takes chunk <= 64 only, so these fp32 CUDA-core kernels (kernels/ssd_bwd.cu) are
//     their only backward: gate -> C B^T -> dy x^T -> local -> reverse state pass -> rows -> dB / dC -> d(dt A).
// Every route: the reverse state pass runs one launch per trie level, deepest first, from the host list
// level_offsets (no host synchronisation) and writes per-warp partials of ddecay, summed in a fixed order by
// ddecay_finish; fixed-order ATen sums follow (dA, dD, ddt_bias, a shared initial state's gradient).
// Saved states are used as the forward stored them (in-type, rounded), as mamba-ssm's backward does with its bf16
// states: recomputing them in fp32 would cost another state pass, and their rounding enters only dC (through C s)
// and ddecay, at the in-type's precision.
#include "ssd_fused_bwd.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "kernels/params_bwd.h"
#include "ssd_fused.h"
#include "tree_recurrence/sdk/check.h"
#include "tree_recurrence/sdk/op_library.h"
#include "tree_recurrence/sdk/settings.h"

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace tree_recurrence::ssd::fused {
namespace {

namespace k = kernels;

// The workspaces the plan's support checks look at (ds, ws, d_roots) are allocated after the plan: the checks see
// this address for them. Fresh caching-allocator blocks are at least 512-byte aligned, all the checks ask of them.
void* const kFreshBuffer = reinterpret_cast<void*>(uintptr_t{512});

// p: dims, dtypes and input pointers set (grad_out's, z's, y's as the backward will read them).
BwdPlan plan_backward(const k::BwdParams& p, bool y_missing, const BwdPlanOverride& o) {
  TR_CHECK_VALUE(o.route >= -1 && o.route <= 2 && o.fused_pass >= -1 && o.fused_pass <= 1,
                 "ssd_fused_backward_stages: route must be -1 (the plan's), 0, 1 or 2 and fused_pass -1, 0 or 1, got ",
                 o.route, " and ", o.fused_pass);
  const bool tc = k::ssd_bwd_tc_supported(p);
  k::BwdParams q = p;
  q.ds16 = kFreshBuffer;
  q.ds16_type = q.x_type;
  q.ws = static_cast<float*>(kFreshBuffer);
  q.dx_type = q.x_type;
  q.recompute_y = y_missing;
  const bool half = tc && k::ssd_bwd_local_bf16_supported(q) && k::ssd_bwd_post_bf16_supported(q);
  BwdPlan plan;
  plan.route = half ? BwdRoute::Half : tc ? BwdRoute::TensorCore : BwdRoute::CudaCore;
  if (o.route >= 0) {
    const auto want = static_cast<BwdRoute>(o.route);
    const bool ok = want == BwdRoute::CudaCore || (want == BwdRoute::TensorCore && tc) || (want == BwdRoute::Half && half);
    TR_CHECK_VALUE(ok, "ssd_fused_backward_stages: route ", o.route,
                   " (0 CUDA cores, 1 tensor cores, 2 16-bit) does not take these inputs");
    plan.route = want;
  }
  const bool half_route = plan.route == BwdRoute::Half;
  const bool pass_ok = half_route && k::ssd_bwd_fused_pass_supported(q);
  TR_CHECK_VALUE(o.fused_pass != 1 || pass_ok,
                 "ssd_fused_backward_stages: the fused reverse pass (Half route only) does not take these inputs");
  plan.recompute_y = half_route && y_missing;
  plan.fused_pass = pass_ok && (o.fused_pass >= 0 ? o.fused_pass == 1 : fused_passes_suit(p.num_chunks, p.num_segments));
  return plan;
}

struct Stages {
  at::Tensor dy, dz, cb, local, ds_leave, ddecay, d_roots, q, v, ddt_direct, d_dtA, ddt, ddt_raw, dA_part;
  Grads grads;
};

void check_launch(int err, const char* what) {
  TR_CHECK(err == 0, "fused SSD backward: the ", what, " kernel failed to launch: ", k::ssd_bwd_error_string(err));
}

// a reverse pass over the trie: one launch per level, deepest first (level_offsets is the host list: no sync)
using LevelLaunch = int (*)(const k::BwdParams&, int64_t begin, int64_t count, void* stream);
void launch_levels(LevelLaunch launch, const k::BwdParams& p, const Tables& t, void* stream, const char* what) {
  for (int64_t lv = static_cast<int64_t>(t.level_offsets.size()) - 2; lv >= 0; --lv) {
    const int64_t begin = t.level_offsets[lv], count = t.level_offsets[lv + 1] - begin;
    TR_CHECK_VALUE(count >= 0 && begin >= 0 && begin + count <= p.num_segments, "fused SSD backward: level_offsets ", lv,
                   " is out of range");
    check_launch(launch(p, begin, count, stream), what);
  }
}

Stages run(const at::Tensor& grad_out, const Args& a, const Tables& t, const Saved& saved, bool keep_stages,
           const BwdPlanOverride& o) {
#ifndef TREE_RECURRENCE_WITH_CUDA
  (void)grad_out; (void)a; (void)t; (void)saved; (void)keep_stages; (void)o;
  TR_CHECK(false, "fused SSD backward: this build has no CUDA kernels");
#else
  bool shared_h0 = false;
  const int64_t R = check_backward_inputs(grad_out, a, t, saved, shared_h0);
  const int64_t T = a.x.size(0), H = a.x.size(1), P = a.x.size(2), G = a.B.size(1), N = a.B.size(2);
  const int64_t NC = t.gather.size(0), L = t.gather.size(1), S = t.parents.size(0);
  c10::cuda::CUDAGuard guard(a.x.device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto f32 = a.x.options().dtype(at::kFloat);
  BwdInputs in;
  k::BwdParams p;
  bind_backward_params(p, in, grad_out, a, t, saved);
  const bool y_missing = a.z && !in.y.defined();
  const BwdPlan plan = plan_backward(p, y_missing, o);
  const bool half = plan.route == BwdRoute::Half, cuda_core = plan.route == BwdRoute::CudaCore;
  if (cuda_core && L > k::kTcBwdChunk)
    TORCH_WARN_ONCE(::tree_recurrence::sdk::message::str(
        "ssd_tree_scan: the fused backward's tensor-core kernels take chunk ", k::kTcBwdChunk, " only; these chunk-", L,
        " tables run its fp32 CUDA-core kernels, about 100x slower at model shapes. Build the chunk tables at 64 "
        "(TreePlan.chunk_tables(64)): the results agree to rounding."));
  p.recompute_y = plan.recompute_y;
  // the gate kernel (dy, dz in fp32): every route but Half reads its dy; on Half only the stage op's outputs
  const bool need_gate = !half || keep_stages;
  if (need_gate && y_missing) {
    // the gate reads y: y from the forward kernels, bit for bit the forward's (on Half the post kernel still
    // recomputes its own: p.recompute_y)
    in.y = forward(a, t, /*save_y=*/true).second.y;
    p.y = in.y.data_ptr();
    p.y_type = bwd_type(in.y, "recomputed y");
  }

  Stages st;
  at::Tensor ws = at::empty({std::max<int64_t>(S, 1), H, P, N}, f32);
  if (a.initial_state) st.d_roots = at::zeros({std::max<int64_t>(R, 1), H, P, N}, f32);
  st.ddecay = at::empty({NC, H}, f32);
  st.ddt = at::empty({T, H}, f32);
  st.ddt_raw = at::empty({T, H}, f32);
  st.dA_part = at::empty({NC, H}, f32);
  p.ws = ws.data_ptr<float>();
  p.droots = a.initial_state ? st.d_roots.data_ptr<float>() : nullptr;
  p.ddecay = st.ddecay.data_ptr<float>();
  p.ddt = st.ddt.data_ptr<float>();
  p.ddt_raw = st.ddt_raw.data_ptr<float>();
  p.dA_part = st.dA_part.data_ptr<float>();
  at::Tensor dyx, ds16, dD_part, dx, dB, dC, dz_out, y_scratch;
  if (cuda_core) {
    dyx = at::empty({NC, H, L, L}, f32);
    p.dyx = dyx.data_ptr<float>();
  } else {
    p.dx_type = p.x_type;  // the tensor-core kernels write dx in x's dtype: no fp32 (T, H, P) buffer
  }
  if (half) {  // ds (ds_local, then ds_leave in place) in x's 16-bit type; the state pass carries in fp32
    ds16 = at::empty({NC, H, P, N}, in.x.options());
    p.ds16 = ds16.data_ptr();
    p.ds16_type = p.x_type;
    if (a.D) {  // post_bf16 forms dy from dout / z itself: the dD partials from it
      dD_part = at::empty({NC, H, P}, f32);
      p.dD_part = dD_part.data_ptr<float>();
    }
  } else {
    st.ds_leave = at::empty({NC, H, P, N}, f32);
    p.ds = st.ds_leave.data_ptr<float>();
  }
  // post_bf16's outputs: dx, 16-bit dB / dC (no fp32 buffers, no cast), dz; outside the stage op allocated after the
  // state pass, once its carries (ws) are released: the two are not in memory together at the peak
  const bool late_outputs = half && !keep_stages;
  const auto alloc_outputs = [&] {
    dx = at::empty({T, H, P}, cuda_core ? f32 : in.x.options());
    if (cuda_core) p.dx = dx.data_ptr<float>(); else p.dx_out = dx.data_ptr();
    if (half) {
      dB = at::empty({T, G, N}, in.B.options());
      dC = at::empty({T, G, N}, in.B.options());
      p.dB_out = dB.data_ptr();
      p.dC_out = dC.data_ptr();
    } else {
      dB = at::empty({T, G, N}, f32);
      dC = at::empty({T, G, N}, f32);
      p.dB = dB.data_ptr<float>();
      p.dC = dC.data_ptr<float>();
    }
    if (half && a.z) {
      // dz over y (in place) when y is this backward's own: the post kernel reads each y element once, in the thread
      // that then writes its dz (L2 loads, not the read-only path), and nothing reads y after it. The saved y only
      // without retain_graph (Saved::y_consumable); a y this backward recomputed, always. One (T, H, P) buffer less
      // at the peak.
      const at::Tensor& y = in.y;
      const bool own_y = y.defined() && !p.recompute_y && (saved.y_consumable || !y.is_same(saved.y));
      dz_out = own_y && !keep_stages && y.scalar_type() == in.z.scalar_type() && y.is_contiguous()
                   ? y
                   : at::empty({T, H, P}, in.z.options());
      p.dz_out = dz_out.data_ptr();
    }
    if (half && p.recompute_y) {  // the post kernel's per-CTA y scratch (NC G x L x P)
      y_scratch = at::empty({NC * G, L, P}, in.x.options());
      p.y_scratch = y_scratch.data_ptr();
    }
  };
  if (!half || keep_stages) {  // stage buffers (post_bf16 keeps C B^T and the row stages on chip)
    st.cb = at::empty({NC, G, L, L}, f32);
    st.q = at::empty({NC, H, L}, f32);
    st.v = at::empty({NC, H, L}, f32);
    st.ddt_direct = at::empty({NC, H, L}, f32);
    st.d_dtA = at::empty({NC, H, L}, f32);
    p.cb = st.cb.data_ptr<float>();
    p.q = st.q.data_ptr<float>();
    p.v = st.v.data_ptr<float>();
    p.ddt_direct = st.ddt_direct.data_ptr<float>();
    p.d_dtA = st.d_dtA.data_ptr<float>();
  }
  if (!late_outputs) alloc_outputs();
  if (need_gate) {
    st.dy = at::empty({T, H, P}, f32);
    p.dy = st.dy.data_ptr<float>();
    if (a.z) {
      st.dz = at::empty({T, H, P}, f32);
      p.dz = st.dz.data_ptr<float>();
    }
  }
  // ddecay: per-warp partials written by the reverse pass (their count depends on the pass and the pointers above)
  const int64_t parts = plan.fused_pass ? k::ssd_bwd_fused_pass_ddecay_parts(p) : k::ssd_bwd_ddecay_parts(p);
  at::Tensor ddecay_part = at::empty({NC, H, parts}, f32);
  p.ddecay_part = ddecay_part.data_ptr<float>();
  p.ddecay_parts = parts;

  // the local entering-state gradient and the reverse state pass
  if (need_gate) check_launch(k::ssd_bwd_gate(p, stream), "gate (dy, dz)");
  if (plan.fused_pass) {
    if (keep_stages) {  // the stage op's local stage: local_bf16 into a buffer of its own (the pass never stores it)
      k::BwdParams q = p;
      at::Tensor tmp = at::empty({NC, H, P, N}, in.x.options());
      q.ds16 = tmp.data_ptr();
      check_launch(k::ssd_bwd_local_bf16(q, stream), "16-bit local state gradient (stage output)");
      st.local = tmp.to(at::kFloat);
    }
    launch_levels(k::ssd_bwd_fused_pass, p, t, stream, "fused reverse local + state pass");
  } else {
    if (half) {
      check_launch(k::ssd_bwd_local_bf16(p, stream), "16-bit local state gradient");
    } else if (!cuda_core) {
      check_launch(k::ssd_bwd_local_tc(p, stream), "tensor-core local state gradient");
    } else {
      check_launch(k::ssd_bwd_cb(p, stream), "C B^T");
      check_launch(k::ssd_bwd_dyx(p, stream), "dy x^T");
      check_launch(k::ssd_bwd_local(p, stream), "local state gradient");
    }
    if (keep_stages) st.local = half ? ds16.to(at::kFloat) : st.ds_leave.clone();  // widened: exact
    launch_levels(k::ssd_bwd_state_pass, p, t, stream, "reverse state pass");
  }
  check_launch(k::ssd_bwd_ddecay_finish(p, stream), "ddecay (sum of the state pass's partials)");
  if (!keep_stages) {
    // the segments' carries (S, H, P, N) fp32: the state pass was their last reader; back to the caching allocator
    // (stream order) before the post kernel's outputs are allocated (late_outputs)
    ws = at::Tensor();
    p.ws = nullptr;
  }
  if (late_outputs) alloc_outputs();

  // the chunk gradients: dx, ddt, dB, dC, d(dt A) (and on Half dz, the dD partials)
  if (half) {
    p.post_bf16_checked = true;  // the plan checked it; the buffers allocated since are fresh (aligned)
    check_launch(k::ssd_bwd_post_bf16(p, stream), "16-bit chunk gradients (dx, dz, ddt, dB, dC, d(dt A), dD)");
  } else if (!cuda_core) {
    check_launch(k::ssd_bwd_post_tc(p, stream), "tensor-core chunk gradients (cb, dx, ddt, dB, dC, d(dt A))");
  } else {
    check_launch(k::ssd_bwd_rows(p, stream), "rows (dx, ddt)");
    check_launch(k::ssd_bwd_dbdc(p, stream), "dB / dC");
    check_launch(k::ssd_bwd_dtA(p, stream), "d(dt A)");
  }

  if (keep_stages && half) st.ds_leave = ds16.to(at::kFloat);  // the stage op's fp32 ds_leave, exact
  if (!keep_stages) {
    // the kernels' workspaces are dead now: back to the caching allocator before the ATen tail allocates (stream
    // order keeps the reuse safe)
    for (at::Tensor* v : {&st.ds_leave, &ds16, &st.cb, &st.q, &st.v, &st.ddt_direct, &st.d_dtA, &st.ddecay, &ws, &dyx,
                          &ddecay_part})
      *v = at::Tensor();
  }
  Grads& g = st.grads;
  g.dx = dx.to(a.x.scalar_type());
  g.ddt = st.ddt_raw.to(a.dt.scalar_type());
  g.dB = dB.to(a.B.scalar_type());
  g.dC = dC.to(a.C.scalar_type());
  g.dA = st.dA_part.sum(0).to(a.A.scalar_type());
  if (a.D) {
    if (dD_part.defined()) {  // (NC, H, P) partials: fixed-order ATen sums
      const at::Tensor hp = dD_part.sum(0);
      g.dD = (a.D->dim() == 1 ? hp.sum(1) : hp).to(a.D->scalar_type());
    } else {
      TR_CHECK(st.dy.defined(), "fused SSD backward: dD needs dy or the post kernel's dD partials");
      const at::Tensor xy = st.dy * in.x.to(at::kFloat);
      g.dD = (a.D->dim() == 1 ? xy.sum(at::IntArrayRef{0, 2}) : xy.sum(0)).to(a.D->scalar_type());
    }
  }
  if (a.dt_bias) g.ddt_bias = st.ddt_raw.sum(0).to(a.dt_bias->scalar_type());
  if (a.z) {
    if (dz_out.defined()) {
      g.dz = dz_out.to(a.z->scalar_type());  // written in z's dtype: no copy
    } else {
      TR_CHECK(st.dz.defined(), "fused SSD backward: dz needs the gate or the post kernel's dz");
      g.dz = st.dz.to(a.z->scalar_type());
    }
  }
  if (a.initial_state) {
    g.d_initial_state = shared_h0 ? st.d_roots.narrow(0, 0, std::max<int64_t>(R, 1)).sum(0).reshape(a.initial_state->sizes())
                                  : st.d_roots;
    if (shared_h0 && R == 0) g.d_initial_state.zero_();
  }
  return st;
#endif
}

[[maybe_unused]] std::vector<at::Tensor> backward_stages(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
    const at::Tensor& A, const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
    const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& initial_state, at::ArrayRef<double> dt_limit,
    bool dt_softplus, const at::Tensor& gather, const at::Tensor& scatter, const at::Tensor& seg_chunk_offsets,
    const at::Tensor& parents, const at::Tensor& root_index, const at::Tensor& level_segments,
    at::IntArrayRef level_offsets, const at::Tensor& child_offsets, const at::Tensor& children,
    const at::Tensor& saved_dt, const at::Tensor& saved_Lam, const at::Tensor& saved_states,
    const std::optional<at::Tensor>& saved_y, int64_t route, int64_t fused_pass) {
  TR_CHECK_VALUE(dt_limit.size() == 2, "ssd_fused_backward_stages: dt_limit must be (low, high)");
  Args a;
  a.x = x; a.dt = dt; a.B = B; a.C = C; a.A = A; a.D = D; a.dt_bias = dt_bias; a.z = z; a.initial_state = initial_state;
  a.dt_min = dt_limit[0]; a.dt_max = dt_limit[1]; a.dt_softplus = dt_softplus;
  Tables t{gather, scatter, seg_chunk_offsets, parents, root_index, level_segments,
           std::vector<int64_t>(level_offsets.begin(), level_offsets.end()), child_offsets, children};
  Saved s{saved_dt, saved_Lam, saved_states, saved_y ? *saved_y : at::Tensor()};
  Stages st = run(grad_out, a, t, s, true, BwdPlanOverride{route, fused_pass});
  const auto e = [&](const at::Tensor& v) { return v.defined() ? v : at::empty({0}, x.options().dtype(at::kFloat)); };
  const Grads& g = st.grads;
  return {e(st.dy), e(st.dz), e(st.cb), e(st.local), e(st.ds_leave), e(st.ddecay), e(st.d_roots), e(st.q), e(st.v),
          e(st.ddt_direct), e(st.d_dtA), e(st.ddt), e(st.ddt_raw), e(st.dA_part), e(g.dx), e(g.ddt), e(g.dB), e(g.dC),
          e(g.dA), e(g.dD), e(g.ddt_bias), e(g.dz), e(g.d_initial_state)};
}

}  // namespace

bool forms_y_itself(const Args& a, const Tables& t) {
#ifndef TREE_RECURRENCE_WITH_CUDA
  (void)a; (void)t;
  return false;
#else
  // The memory mode (TREE_RECURRENCE_SSD_RECOMPUTE_Y): the post kernel recomputes y where the plan takes the Half
  // route. It costs the post kernel about a quarter of its time for one (T, H, P) buffer less at the peak, so the
  // default keeps the stored y (speed).
  if (!a.z || !settings::ssd_recompute_y()) return false;
  if (a.x.dim() != 3 || a.B.dim() != 3 || t.gather.dim() != 2 || !a.x.is_cuda()) return false;
  const at::ScalarType in = a.x.scalar_type();
  if ((in != at::kBFloat16 && in != at::kHalf) || a.B.scalar_type() != in || a.C.scalar_type() != in ||
      a.z->scalar_type() != in)
    return false;
  // (a strided input is copied by the backward: its pointer is not this one)
  if (!a.x.is_contiguous() || !a.B.is_contiguous() || !a.C.is_contiguous() || !a.z->is_contiguous()) return false;
  // the plan as the backward will ask it (grad_out and the saved states: x's type, fresh buffers)
  const k::BwdType ty = bwd_type(a.x, "x");
  k::BwdParams p;
  p.tokens = a.x.size(0); p.heads = a.x.size(1); p.head_dim = a.x.size(2);
  p.groups = a.B.size(1); p.state_dim = a.B.size(2);
  p.num_chunks = t.gather.size(0); p.chunk = t.gather.size(1); p.num_segments = t.parents.size(0);
  p.x_type = p.bc_type = p.dout_type = p.states_type = p.z_type = ty;
  p.x = a.x.data_ptr(); p.B = a.B.data_ptr(); p.C = a.C.data_ptr(); p.z = a.z->data_ptr();
  p.dout = p.states = kFreshBuffer;
  return plan_backward(p, /*y_missing=*/true, BwdPlanOverride{}).recompute_y;
#endif
}

Grads backward(const at::Tensor& grad_out, const Args& a, const Tables& t, const Saved& saved) {
  return run(grad_out, a, t, saved, false, BwdPlanOverride{}).grads;
}

void register_backward_stages_op() {
  op_library(torch::Library::FRAGMENT)
      .def("ssd_fused_backward_stages(Tensor grad_out, Tensor x, Tensor dt, Tensor B, Tensor C, Tensor A, Tensor? D, "
           "Tensor? dt_bias, Tensor? z, Tensor? initial_state, float[] dt_limit, bool dt_softplus, Tensor gather, "
           "Tensor scatter, Tensor seg_chunk_offsets, Tensor parents, Tensor root_index, Tensor level_segments, "
           "int[] level_offsets, Tensor child_offsets, Tensor children, Tensor saved_dt, Tensor saved_Lam, "
           "Tensor saved_states, Tensor? saved_y, int route=-1, int fused_pass=-1) -> Tensor[]");
#ifdef TREE_RECURRENCE_WITH_CUDA
  op_library(torch::Library::IMPL, c10::DispatchKey::CUDA).impl("ssd_fused_backward_stages", &backward_stages);
#endif
}

}  // namespace tree_recurrence::ssd::fused
