// fused::forward (ssd_fused.h): the fused SSD forward's launches (kernels/params.h) on the current
// stream, no host sync (the host level_offsets drive the per-level loops).
//   default: chunk state + tree state pass in one kernel per level (ssd_chunk_state_pass_fwd.cu, the
//            fp32 chunk states never reach memory), then the chunk scan, when the segments average
//            <= 64 chunks (fused_pass_enabled); else, or with TREE_RECURRENCE_SSD_FWD_FUSED_PASS=0,
//            the pipelined chunk-state scan (ssd_chunk_state_scan_fwd.cu, chunk 64: dt / Lam, then per
//            level one kernel computing each S_c and the states with chunk c + 2's rows in flight; no
//            fp32 chunk_states), bitwise equal to the three-kernel path (chunk state -> fp32
//            chunk_states -> state pass -> chunk scan), which runs for chunks 128 / 256 or with
//            TREE_RECURRENCE_SSD_FWD_PIPELINED=0; TREE_RECURRENCE_SSD_FWD_FUSED_PASS=1 forces the fused
//            pass. The three-kernel path's state pass loads 4 chunks ahead;
//            TREE_RECURRENCE_SSD_FWD_STATE_PASS=v1 one at a time (the previous kernel, until the GPU
//            confirms; same arithmetic).
//   chunk scan: v4 (ssd_chunk_scan_v4_fwd.cu: v3's blocks with 8 warps, the epilogue on the
//            fragments) where ssd_chunk_scan_v4_supported holds, else v3 (ssd_chunk_scan_group_fwd.cu:
//            per (chunk, group, head slice), C B^T once, the heads' state / x / z double-buffered) where
//            ssd_chunk_scan_v3_supported holds (chunk 64, P <= 64), else v2 (ssd_chunk_scan_fwd.cu: per
//            (chunk, tile, head), head-fastest grid, every shape); TREE_RECURRENCE_SSD_FWD_SCAN=v3
//            forces v3 where supported (the fallback until the GPU confirms v4), =v2 forces v2 (same
//            arithmetic in all three, expected bitwise equal).
// forward_stages (tests) also runs the chunk-state kernel, for the transient chunk_states stage; with
// the fused pass or the pipelined scan, dt / Lam / states then come from that kernel (which rewrites
// the same dt / Lam).
#include "ssd_fused.h"
#include "tree_recurrence/sdk/check.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

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
#endif

// The fused pass walks a segment's chunks in order with a matmul per step (~2 us each), the
// three-kernel path computes every chunk state in parallel and then walks them elementwise: on few,
// long segments (one 49k-token row: 768 chunks in a row) the latter is faster. Auto (unset): fused
// when the segments average at most 64 chunks (host counts only: NC and S); "1" always, "0" never.
bool fused_pass_enabled(int64_t num_chunks, int64_t num_segments) {
  const char* v = std::getenv("TREE_RECURRENCE_SSD_FWD_FUSED_PASS");
  if (v && std::string(v) == "0") return false;
  if (v && std::string(v) == "1") return true;
  return fused_passes_suit(num_chunks, num_segments);
}

// TREE_RECURRENCE_SSD_FWD_SCAN: "v2" the per-head v2 kernel everywhere; "v3" v3 where it is
// supported, else v2; anything else (unset) v4 where it is supported, else v3, else v2. Read per
// forward, as TREE_RECURRENCE_SSD_FWD_FUSED_PASS is (the GPU tests switch it in-process; one getenv
// per forward).
enum class Scan { Default, V3, V2 };
Scan scan_forced() {
  const char* v = std::getenv("TREE_RECURRENCE_SSD_FWD_SCAN");
  if (v && std::string(v) == "v2") return Scan::V2;
  if (v && std::string(v) == "v3") return Scan::V3;
  return Scan::Default;
}

// TREE_RECURRENCE_SSD_FWD_PIPELINED: "0" the three-kernel path where the fused pass does not run; else
// the pipelined chunk-state scan where it is supported (chunk 64). Read per forward (the GPU tests
// compare both paths in-process).
bool pipelined_enabled() {
  const char* v = std::getenv("TREE_RECURRENCE_SSD_FWD_PIPELINED");
  return !(v && std::string(v) == "0");
}

// TREE_RECURRENCE_SSD_FWD_STATE_PASS: "v1" the state pass one chunk at a time; else 4 chunks ahead.
bool state_pass_ahead() {
  const char* v = std::getenv("TREE_RECURRENCE_SSD_FWD_STATE_PASS");
  return !(v && std::string(v) == "v1");
}

// with_chunk_states: also compute the transient fp32 chunk states (forward_stages).
Stages run(const Args& a, const Tables& t, bool with_chunk_states, bool save_y) {
#ifndef TREE_RECURRENCE_WITH_CUDA
  (void)a;
  (void)t;
  (void)with_chunk_states;
  (void)save_y;
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
  // (no numbers in the message: see docs/kernels.md, the crash on a thrown error that formats one)
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
  p.state_pass_ahead = state_pass_ahead();
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
  // the route, from the filled parameters (the pipelined scan's support: shapes, x / B / dt / Lam aligned);
  // the fp32 chunk states exist only for the three-kernel path and the stages op
  const bool fused_pass = fused_pass_enabled(NC, S);
  const bool pipelined = !fused_pass && pipelined_enabled() && kernels::ssd_chunk_state_scan_supported(p);
  const bool chunk_state_kernel = (!fused_pass && !pipelined) || with_chunk_states;
  if (chunk_state_kernel) {
    o.chunk_states = at::empty({NC, H, P, N}, f32);
    p.chunk_states = o.chunk_states.data_ptr<float>();
  }

  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  if (chunk_state_kernel) check_launch(kernels::ssd_chunk_state_fwd(p, stream), "chunk state");
  if (fused_pass)
    check_launch(kernels::ssd_chunk_state_pass_fwd(p, stream), "fused chunk state + state pass");
  else if (pipelined)  // (after the chunk-state kernel in forward_stages: rewrites the same dt / Lam)
    check_launch(kernels::ssd_chunk_state_scan_fwd(p, stream), "pipelined chunk state scan");
  else
    check_launch(kernels::ssd_state_pass_fwd(p, stream), "state pass");
  const Scan scan = scan_forced();
  if (scan == Scan::Default && kernels::ssd_chunk_scan_v4_supported(p))
    check_launch(kernels::ssd_chunk_scan_fwd_v4(p, stream), "chunk scan (v4)");
  else if (scan != Scan::V2 && kernels::ssd_chunk_scan_v3_supported(p))
    check_launch(kernels::ssd_chunk_scan_fwd_v3(p, stream), "chunk scan (v3)");
  else
    check_launch(kernels::ssd_chunk_scan_fwd_v2(p, stream), "chunk scan (v2)");
  return o;
#endif
}

}  // namespace

std::pair<at::Tensor, Saved> forward(const Args& a, const Tables& t, bool save_y) {
  Stages o = run(a, t, /*with_chunk_states=*/false, save_y);
  return {o.out, Saved{o.dt, o.Lam, o.states, o.y}};
}

std::vector<at::Tensor> forward_stages(const Args& a, const Tables& t) {
  Stages o = run(a, t, /*with_chunk_states=*/true, /*save_y=*/true);
  return {o.out, o.dt, o.Lam, o.chunk_states, o.states, o.y};
}

}  // namespace tree_recurrence::ssd::fused
