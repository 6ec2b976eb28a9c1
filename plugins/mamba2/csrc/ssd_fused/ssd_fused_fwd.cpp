// fused::forward (ssd_fused.h): the fused SSD forward's launches (kernels/params.h) on the current
// stream, no host sync (the host level_offsets drive the per-level loops). One kernel plan per call
// (kernels::fwd_plan, from the shapes only):
//   the states entering each chunk: the fused chunk-state + state pass (ssd_chunk_state_pass_fwd.cu,
//     the fp32 chunk states never reach memory) where the segments average <= 64 chunks
//     (fused_passes_suit); else at chunk 64 the pipelined chunk-state scan (ssd_chunk_state_scan_fwd.cu:
//     dt / Lam, then per level one kernel computing each S_c and the states with chunk c + 2's rows in
//     flight; no fp32 chunk_states); else (chunk 128 / 256) the three-kernel path's chunk state
//     (ssd_chunk_state_fwd.cu: fp32 chunk_states) and state pass (ssd_state_pass_fwd.cu). The
//     pipelined scan and the three-kernel path give bitwise equal dt, Lam, states and workspace.
//   the chunk scan: the grouped kernel (ssd_chunk_scan_group_fwd.cu: per (chunk, group, head slice),
//     C B^T once, the heads double-buffered) where ssd_chunk_scan_group_supported holds (chunk 64,
//     P <= 64, its shared memory), else the per-head kernel (ssd_chunk_scan_fwd.cu, every shape);
//     bitwise equal outputs.
// forward_stages (tests) also runs the chunk-state kernel, for the transient chunk_states stage; with
// the fused pass or the pipelined scan, dt / Lam / states then come from that path's kernel (which
// rewrites the same dt / Lam). Its plan argument forces a state path and / or a chunk scan where the
// shapes take it, so the tests compare the variants bitwise in one process.
#include "ssd_fused.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string_view>

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "kernels/params.h"

namespace tree_recurrence::ssd::fused {
namespace {

struct Stages {
  at::Tensor out, dt, Lam, chunk_states, states, y;
};

#ifdef TREE_RECURRENCE_WITH_CUDA
// Contiguous and 16-byte aligned (the kernels load 8 halves at a time).
at::Tensor dense(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

void check_launch(int err, const char* stage) {
  TR_CHECK(err == 0, "fused SSD forward: the ", stage, " kernel failed to launch: ", kernels::ssd_fwd_error_string(err));
}

const int64_t* table(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TR_CHECK_VALUE(t.scalar_type() == at::kLong && t.device() == x.device() && t.is_contiguous(), "fused SSD forward: table ",
                    name, " must be a contiguous int64 tensor on ", x.device(), ", got ", t.scalar_type(), " on ",
                    t.device());
  return t.data_ptr<int64_t>();
}

// The plan with the parts `force` names replaced: comma-separated names among "fused_pass",
// "pipelined", "three_kernel" (the state path) and "group_scan", "head_scan" (the chunk scan); ""
// keeps the forward's own plan. A forced kernel these shapes do not take is refused.
kernels::FwdPlan forced(kernels::FwdPlan plan, std::string_view force, const kernels::FwdParams& p) {
  using kernels::ScanKernel;
  using kernels::StatePath;
  while (!force.empty()) {
    const size_t comma = force.find(',');
    const std::string_view name = force.substr(0, comma);
    force = comma == std::string_view::npos ? std::string_view() : force.substr(comma + 1);
    if (name == "fused_pass") {
      plan.path = StatePath::FusedPass;
    } else if (name == "three_kernel") {
      plan.path = StatePath::ThreeKernel;
    } else if (name == "pipelined") {
      TR_CHECK_VALUE(kernels::ssd_chunk_state_scan_supported(p),
                     "ssd_fused_stages: the pipelined chunk-state scan does not take this call (chunk 64 only), chunk ",
                     p.chunk);
      plan.path = StatePath::Pipelined;
    } else if (name == "group_scan") {
      TR_CHECK_VALUE(kernels::ssd_chunk_scan_group_supported(p), "ssd_fused_stages: the grouped chunk scan does not ",
                     "take chunk ", p.chunk, ", head_dim ", p.head_dim, ", state ", p.state_dim);
      plan.scan = ScanKernel::Grouped;
    } else if (name == "head_scan") {
      plan.scan = ScanKernel::PerHead;
    } else {
      TR_CHECK_VALUE(false, "ssd_fused_stages: unknown plan part '", name,
                     "' (fused_pass, pipelined, three_kernel, group_scan, head_scan)");
    }
  }
  return plan;
}
#endif

// with_chunk_states: also compute the transient fp32 chunk states (forward_stages); force: forced().
Stages run(const Args& a, const Tables& t, bool with_chunk_states, bool save_y, std::string_view force) {
#ifndef TREE_RECURRENCE_WITH_CUDA
  (void)a;
  (void)t;
  (void)with_chunk_states;
  (void)save_y;
  (void)force;
  TR_CHECK(false, "fused SSD forward: this build has no CUDA kernels");
#else
  const c10::cuda::CUDAGuard guard(a.x.device());
  const at::ScalarType in = a.x.scalar_type();
  TR_CHECK_TYPE(in == at::kBFloat16 || in == at::kHalf, "fused SSD forward: x must be bfloat16 or float16, got ", in);
  TR_CHECK_TYPE(a.B.scalar_type() == in && a.C.scalar_type() == in, "fused SSD forward: B and C must have x's dtype ", in,
                   ", got ", a.B.scalar_type(), " and ", a.C.scalar_type());
  const at::Tensor x = dense(a.x), B = dense(a.B), C = dense(a.C);
  const int64_t T = x.size(0), H = x.size(1), P = x.size(2), G = B.size(1), N = B.size(2);
  const int64_t NC = t.gather.size(0), L = t.gather.size(1), S = t.parents.size(0);
  TR_CHECK_VALUE(G > 0 && H % G == 0, "fused SSD forward: the heads must be a multiple of the groups");
  TR_CHECK_VALUE(kernels::fwd_shape_supported(L, P, N), "fused SSD forward: chunk ", L, ", head_dim ", P, ", state ", N,
                    " outside the kernels' range (chunk 64/128/256; head_dim, state multiples of 8, <= 128, <= 256)");
  const auto f32 = x.options().dtype(at::kFloat);
  const at::Tensor dt_raw = a.dt.to(at::kFloat).contiguous();
  const at::Tensor A = a.A.to(at::kFloat).contiguous();
  at::Tensor dt_bias, D, z, h0;
  if (a.dt_bias) dt_bias = a.dt_bias->to(at::kFloat).contiguous();
  if (a.D) D = (a.D->dim() == 1 ? a.D->to(at::kFloat).view({H, 1}).expand({H, P}) : a.D->to(at::kFloat)).contiguous();
  bool z_fp32 = false;
  if (a.z) {
    z = a.z->dim() == 4 ? (*a.z)[0] : *a.z;
    z_fp32 = z.scalar_type() != in;
    z = dense(z_fp32 ? z.to(at::kFloat) : z);
  }
  bool per_root = false;
  if (a.initial_state) {
    h0 = *a.initial_state;
    if (h0.dim() == 4 && h0.size(0) == 1) h0 = h0[0];
    per_root = h0.dim() == 4;
    h0 = dense(h0.to(at::kFloat));  // the state passes read it 16 / 8 bytes at a time: aligned, contiguous
  }

  Stages o;
  o.out = at::empty({T, H, P}, x.options());
  o.dt = at::empty({NC, H, L}, f32);
  o.Lam = at::empty({NC, H, L}, f32);
  o.states = at::empty({NC, H, P, N}, x.options());
  if (a.z && save_y) o.y = at::empty({T, H, P}, x.options());
  const at::Tensor workspace = at::empty({std::max<int64_t>(S, 1), H, P, N}, f32);

  kernels::FwdParams p;
  p.in = in == at::kBFloat16 ? kernels::InType::BFloat16 : kernels::InType::Float16;
  p.tokens = T, p.heads = H, p.groups = G, p.head_dim = P, p.state_dim = N;
  p.num_chunks = NC, p.chunk = L, p.num_segments = S;
  p.x = x.data_ptr(), p.B = B.data_ptr(), p.C = C.data_ptr();
  p.dt_raw = dt_raw.data_ptr<float>(), p.A = A.data_ptr<float>();
  p.dt_bias = a.dt_bias ? dt_bias.data_ptr<float>() : nullptr;
  p.D = a.D ? D.data_ptr<float>() : nullptr;
  p.z = a.z ? z.data_ptr() : nullptr;
  p.z_fp32 = z_fp32;
  p.dt_softplus = a.dt_softplus;
  p.dt_min = static_cast<float>(a.dt_min), p.dt_max = static_cast<float>(a.dt_max);
  p.initial_state = a.initial_state ? h0.data_ptr<float>() : nullptr;
  p.initial_per_root = per_root;
  p.gather = table(t.gather, x, "gather");
  p.seg_chunk_offsets = table(t.seg_chunk_offsets, x, "seg_chunk_offsets");
  p.parents = table(t.parents, x, "parents");
  p.root_index = table(t.root_index, x, "root_index");
  p.level_segments = table(t.level_segments, x, "level_segments");
  p.child_offsets = table(t.child_offsets, x, "child_offsets");
  TR_CHECK_VALUE(!t.level_offsets.empty(), "fused SSD forward: level_offsets is empty");
  p.level_offsets = t.level_offsets.data();
  p.num_levels = static_cast<int64_t>(t.level_offsets.size()) - 1;
  p.dt = o.dt.data_ptr<float>(), p.Lam = o.Lam.data_ptr<float>();
  p.states = o.states.data_ptr();
  p.workspace = workspace.data_ptr<float>();
  p.y = a.z && save_y ? o.y.data_ptr() : nullptr;
  p.out = o.out.data_ptr();
  // the plan, from the filled parameters (the pipelined scan's and the grouped scan's support: shapes,
  // z's type, x / B / dt / Lam / z / y / out aligned); the fp32 chunk states exist only for the
  // three-kernel path and the stages op
  const kernels::FwdPlan plan = forced(kernels::fwd_plan(p), force, p);
  const bool chunk_state_kernel = plan.path == kernels::StatePath::ThreeKernel || with_chunk_states;
  if (chunk_state_kernel) {
    o.chunk_states = at::empty({NC, H, P, N}, f32);
    p.chunk_states = o.chunk_states.data_ptr<float>();
  }

  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  if (chunk_state_kernel) check_launch(kernels::ssd_chunk_state_fwd(p, stream), "chunk state");
  switch (plan.path) {
    case kernels::StatePath::FusedPass:
      check_launch(kernels::ssd_chunk_state_pass_fwd(p, stream), "fused chunk state + state pass");
      break;
    case kernels::StatePath::Pipelined:  // (after the chunk-state kernel in forward_stages: rewrites the same dt / Lam)
      check_launch(kernels::ssd_chunk_state_scan_fwd(p, stream), "pipelined chunk state scan");
      break;
    case kernels::StatePath::ThreeKernel:
      check_launch(kernels::ssd_state_pass_fwd(p, stream), "state pass");
      break;
  }
  if (plan.scan == kernels::ScanKernel::Grouped)
    check_launch(kernels::ssd_chunk_scan_group_fwd(p, stream), "grouped chunk scan");
  else
    check_launch(kernels::ssd_chunk_scan_fwd(p, stream), "chunk scan");
  return o;
#endif
}

}  // namespace

#ifdef TREE_RECURRENCE_WITH_CUDA
namespace kernels {

FwdPlan fwd_plan(const FwdParams& p) {
  FwdPlan plan;
  if (fused_passes_suit(p.num_chunks, p.num_segments))
    plan.path = StatePath::FusedPass;
  else if (ssd_chunk_state_scan_supported(p))
    plan.path = StatePath::Pipelined;
  else
    plan.path = StatePath::ThreeKernel;
  plan.scan = ssd_chunk_scan_group_supported(p) ? ScanKernel::Grouped : ScanKernel::PerHead;
  return plan;
}

}  // namespace kernels
#endif

std::pair<at::Tensor, Saved> forward(const Args& a, const Tables& t, bool save_y) {
  Stages o = run(a, t, /*with_chunk_states=*/false, save_y, /*force=*/{});
  return {o.out, Saved{o.dt, o.Lam, o.states, o.y}};
}

std::vector<at::Tensor> forward_stages(const Args& a, const Tables& t, std::string_view plan) {
  Stages o = run(a, t, /*with_chunk_states=*/true, /*save_y=*/true, plan);
  return {o.out, o.dt, o.Lam, o.chunk_states, o.states, o.y};
}

}  // namespace tree_recurrence::ssd::fused
