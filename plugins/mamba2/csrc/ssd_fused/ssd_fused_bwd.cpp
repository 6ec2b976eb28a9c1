// fused::backward (ssd_fused.h): the fused SSD backward from the forward's saved buffers, and the
// test-only op ssd_fused_backward_stages (ssd_fused_bwd.h) that runs it from given buffers and
// returns every stage's output. Kernels: kernels/ssd_bwd.cu (params_bwd.h), launched in this order:
//   gate (dy, dz) -> C B^T -> dy x^T -> local entering-state gradient -> reverse tree state pass
//   (one launch per level, deepest first) -> ddecay -> rows (dx, ddt direct, q, v) -> dB / dC per
//   group -> d(dt A), ddt, ddt_raw, dA partials; then fixed-order ATen sums (dA, dD, ddt_bias, the
//   shared initial state's gradient). No host synchronisation (level_offsets is the host list).
// Tensor-core path (kernels/ssd_tc_bwd.cu; chunk 64, P and N small enough for its shared-memory
// plan, unless TREE_RECURRENCE_SSD_BWD_TC=0): gate -> local_tc -> reverse state pass -> ddecay ->
// post_tc (per chunk and group: cb, dyx, rows, dB / dC, d(dt A) in one kernel, no (NC, H, L, L)
// workspace); the same stage outputs. Otherwise the fp32 CUDA-core kernels above.
// The bf16 / fp16 path (local_bf16 + folded ddecay + post_bf16) keeps ds (ds_local, then ds_leave in place) in x's
// 16-bit type (issue 20 H5; TREE_RECURRENCE_SSD_DS_FP32=1: fp32); the state pass carries in fp32.
// On that path, for tries (fused_passes_suit; TREE_RECURRENCE_SSD_BWD_FUSED_PASS forces either way), the fused
// reverse local + state pass (kernels/ssd_state_pass_bwd.cu, one launch per level) replaces local_bf16 + the
// state pass: ds_local is formed inside the reverse pass and never stored; only ds_leave is written.
// Saved states are used as the forward stored them (in-type, rounded), as mamba-ssm's backward
// does with its bf16 states: recomputing them in fp32 would cost another state pass, and their
// rounding enters only dC (through C s) and ddecay, at the in-type's precision.
#include "ssd_fused.h"
#include "tree_recurrence/sdk/check.h"
#include "ssd_fused_bwd.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/params_bwd.h"
#include "tree_recurrence/sdk/op_library.h"

#ifdef TREE_RECURRENCE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace tree_recurrence::ssd::fused {
namespace {

namespace k = kernels;

k::BwdType bwd_type(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return k::BwdType::Float32;
    case at::kBFloat16: return k::BwdType::BFloat16;
    case at::kHalf: return k::BwdType::Float16;
    default:
      TR_CHECK_TYPE(false, "fused SSD backward: ", name, " has dtype ", t.scalar_type(),
                       ", expected float32, bfloat16 or float16");
  }
  return k::BwdType::Float32;
}

struct Stages {
  at::Tensor dy, dz, cb, local, ds_leave, ddecay, d_roots, q, v, ddt_direct, d_dtA, ddt, ddt_raw, dA_part;
  Grads grads;
};

// TREE_RECURRENCE_SSD_BWD_TC=0 forces the fp32 CUDA-core kernels (the round-1 baseline)
bool tc_enabled() {
  const char* v = std::getenv("TREE_RECURRENCE_SSD_BWD_TC");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

// TREE_RECURRENCE_SSD_BWD_V1=1 selects the round-2 kernels: gate + local_tc (fp32 dy), the separate
// ddecay kernel (re-reads ds_leave). Otherwise (round 3, H4): bf16 / fp16 inputs take the local kernel
// of ssd_local_bwd.cu (dy from dout / z on the fly) and the ddecay is folded into the state pass.
bool v1_selected() {
  const char* v = std::getenv("TREE_RECURRENCE_SSD_BWD_V1");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

// TREE_RECURRENCE_SSD_DS_FP32=1 (read once per process): the bf16 / fp16 path keeps the state gradient ds in
// fp32 (the pre-H5 buffer, 4 bytes per element). Otherwise (H5) that path (bf16 local kernel + folded ddecay +
// bf16 post kernel) stores ds_local / ds_leave in x's 16-bit type (p.ds16): half the bytes (1.61 GB at GRPO).
bool ds_fp32_selected() {
  static const bool v = [] {
    const char* e = std::getenv("TREE_RECURRENCE_SSD_DS_FP32");
    return e != nullptr && std::strcmp(e, "1") == 0;
  }();
  return v;
}

// TREE_RECURRENCE_SSD_BWD_FUSED_PASS (read once per process): the fused reverse local + state pass
// (kernels/ssd_state_pass_bwd.cu: ds_local formed inside the reverse pass, never stored) instead of
// local_bf16 + state_pass_kernel. Unset: auto (fused_passes_suit); "1": fused wherever it is supported; "0": never.
int fused_pass_mode() {
  static const int v = [] {
    const char* e = std::getenv("TREE_RECURRENCE_SSD_BWD_FUSED_PASS");
    if (e == nullptr || *e == '\0') return -1;
    return std::strcmp(e, "0") == 0 ? 0 : std::strcmp(e, "1") == 0 ? 1 : -1;
  }();
  return v;
}
// The auto rule is the forward's (fused_passes_suit, ssd_fused.h: the segments average at most 64 chunks). The
// fused pass walks each (segment, head) sequentially with one CTA of 8 warps per (segment, head, N tile); on a trie (GRPO: 72 segments, 8 / 32 chunks each) that is 1,024
// to 8,192 CTAs per level over short chains, while one long row (one segment of 768 chunks) gives only H CTAs
// (128 < 132 SMs x 2 slots) walking 768 dependent steps, against local_bf16's NC x H fully parallel CTAs plus the
// elementwise pass's 8 x H CTAs: there the two-kernel path keeps its parallelism (H200, 2026-12-02 evening: the flat
// row took 20.59 ms f+b with the fused pass forced against 20.36 with the two kernels; the trie 17.33 against 18.81).

// TREE_RECURRENCE_SSD_POST_DY=buffer (read per call): the bf16 post kernel reads the gate's fp32 dy instead of forming
// dy from dout / z (switch-over check; dz / dD then come from the gate / ATen)
bool post_dy_buffer_selected() {
  const char* v = std::getenv("TREE_RECURRENCE_SSD_POST_DY");
  return v != nullptr && std::strcmp(v, "buffer") == 0;
}

void check_launch(int err, const char* what) {
  TR_CHECK(err == 0, "fused SSD backward: the ", what, " kernel failed to launch: ", k::ssd_bwd_error_string(err));
}

// a reverse pass over the trie: one launch per level, deepest first (level_offsets is the host list: no sync);
// S segments
using LevelLaunch = int (*)(const k::BwdParams&, int64_t begin, int64_t count, void* stream);
void launch_levels(LevelLaunch launch, const k::BwdParams& p, const Tables& t, int64_t S, void* stream,
                   const char* what) {
  for (int64_t lv = static_cast<int64_t>(t.level_offsets.size()) - 2; lv >= 0; --lv) {
    const int64_t begin = t.level_offsets[lv], count = t.level_offsets[lv + 1] - begin;
    TR_CHECK_VALUE(count >= 0 && begin >= 0 && begin + count <= S, "fused SSD backward: level_offsets ", lv, " is out of range");
    check_launch(launch(p, begin, count, stream), what);
  }
}

// the fp32 CUDA-core kernels (round 1): the local stage (C B^T, dy x^T, the local state gradient) and the
// post-state-pass stages (rows, dB / dC, d(dt A))
void launch_local_fp32(const k::BwdParams& p, void* stream) {
  check_launch(k::ssd_bwd_cb(p, stream), "C B^T");
  check_launch(k::ssd_bwd_dyx(p, stream), "dy x^T");
  check_launch(k::ssd_bwd_local(p, stream), "local state gradient");
}
void launch_post_fp32(const k::BwdParams& p, void* stream) {
  check_launch(k::ssd_bwd_rows(p, stream), "rows (dx, ddt)");
  check_launch(k::ssd_bwd_dbdc(p, stream), "dB / dC");
  check_launch(k::ssd_bwd_dtA(p, stream), "d(dt A)");
}

Stages run(const at::Tensor& grad_out, const Args& a, const Tables& t, const Saved& saved, bool keep_stages) {
#ifndef TREE_RECURRENCE_WITH_CUDA
  (void)grad_out; (void)a; (void)t; (void)saved; (void)keep_stages;
  TR_CHECK(false, "fused SSD backward: this build has no CUDA kernels");
#else
  TR_CHECK_VALUE(a.x.is_cuda(), "fused SSD backward: x must be a CUDA tensor, got one on ", a.x.device());
  TR_CHECK_VALUE(a.x.dim() == 3, "fused SSD backward: x must be (tokens, heads, head_dim), got ", a.x.sizes());
  const int64_t T = a.x.size(0), H = a.x.size(1), P = a.x.size(2);
  TR_CHECK_VALUE(a.B.dim() == 3 && a.B.size(0) == T && a.C.sizes() == a.B.sizes(),
                    "fused SSD backward: B and C must be (tokens, groups, state) alike, got ", a.B.sizes(), " and ",
                    a.C.sizes());
  const int64_t G = a.B.size(1), N = a.B.size(2);
  TR_CHECK_VALUE(G > 0 && H % G == 0, "fused SSD backward: heads ", H, " must be a multiple of groups ", G);
  TR_CHECK_VALUE(a.dt.dim() == 2 && a.dt.size(0) == T && a.dt.size(1) == H, "fused SSD backward: dt must be (", T, ", ",
                    H, "), got ", a.dt.sizes());
  TR_CHECK_VALUE(a.A.dim() == 1 && a.A.size(0) == H, "fused SSD backward: A must be (", H, "), got ", a.A.sizes());
  TR_CHECK_VALUE(grad_out.sizes() == a.x.sizes(), "fused SSD backward: grad_out must be shaped like x ", a.x.sizes(),
                    ", got ", grad_out.sizes());
  TR_CHECK_VALUE(t.gather.dim() == 2 && t.gather.scalar_type() == at::kLong, "fused SSD backward: gather must be an int64 (chunks, chunk) table, got ",
                    t.gather.scalar_type(), " ", t.gather.sizes());
  const int64_t NC = t.gather.size(0), L = t.gather.size(1), S = t.parents.size(0);
  TR_CHECK_VALUE(L >= 1 && L <= k::kBwdMaxChunk, "fused SSD backward: chunk ", L, " must be in 1..", k::kBwdMaxChunk);
  TR_CHECK_VALUE(t.level_offsets.size() >= 1, "fused SSD backward: level_offsets must not be empty");
  TR_CHECK_VALUE(saved.dt.scalar_type() == at::kFloat && saved.Lam.scalar_type() == at::kFloat &&
                        saved.dt.sizes() == at::IntArrayRef({NC, H, L}) && saved.Lam.sizes() == saved.dt.sizes(),
                    "fused SSD backward: saved dt and Lam must be float32 (chunks, heads, chunk) = (", NC, ", ", H, ", ", L,
                    "), got ", saved.dt.scalar_type(), " ", saved.dt.sizes(), " and ", saved.Lam.scalar_type(), " ",
                    saved.Lam.sizes());
  TR_CHECK_VALUE(saved.states.sizes() == at::IntArrayRef({NC, H, P, N}), "fused SSD backward: saved states must be (", NC,
                    ", ", H, ", ", P, ", ", N, "), got ", saved.states.sizes());
  if (a.z) {
    TR_CHECK_VALUE(a.z->sizes() == a.x.sizes(), "fused SSD backward: z must be shaped like x ", a.x.sizes(), ", got ",
                      a.z->sizes());
    // y may be absent (the forward did not store it: forms_y_itself); then it is recomputed, by the post kernel or,
    // on a route that reads it, by the forward kernels (below)
    TR_CHECK_VALUE(!saved.y.defined() || saved.y.sizes() == a.x.sizes(),
                      "fused SSD backward: the saved y must be shaped like x ", a.x.sizes(), ", got ", saved.y.sizes());
  }
  if (a.D)
    TR_CHECK_VALUE((a.D->dim() == 1 && a.D->size(0) == H) || (a.D->dim() == 2 && a.D->size(0) == H && a.D->size(1) == P),
                      "fused SSD backward: D must be (", H, ") or (", H, ", ", P, "), got ", a.D->sizes());
  if (a.dt_bias)
    TR_CHECK_VALUE(a.dt_bias->dim() == 1 && a.dt_bias->size(0) == H, "fused SSD backward: dt_bias must be (", H,
                      "), got ", a.dt_bias->sizes());
  bool shared_h0 = false;
  int64_t R = t.level_offsets.size() >= 2 ? t.level_offsets[1] - t.level_offsets[0] : 0;  // roots = level 0
  if (a.initial_state) {
    const at::Tensor& s = *a.initial_state;
    TR_CHECK_VALUE((s.dim() == 3 || s.dim() == 4) && s.size(-3) == H && s.size(-2) == P && s.size(-1) == N,
                      "fused SSD backward: initial_state must be (", H, ", ", P, ", ", N, ") or (roots, ", H, ", ", P, ", ",
                      N, "), got ", s.sizes());
    shared_h0 = s.dim() == 3 || s.size(0) == 1;
    if (!shared_h0) R = s.size(0);
  }

  c10::cuda::CUDAGuard guard(a.x.device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto f32 = a.x.options().dtype(at::kFloat);
  // the kernels read fp32 / bf16 / fp16; a float64 tensor (z may be one) is narrowed to fp32
  const auto in = [](const at::Tensor& x) {
    return x.scalar_type() == at::kDouble ? x.to(at::kFloat).contiguous() : x.contiguous();
  };
  const at::Tensor x = in(a.x), B = in(a.B), C = in(a.C), dout = in(grad_out), states = in(saved.states);
  const at::Tensor dt_raw = a.dt.to(at::kFloat).contiguous(), A = a.A.to(at::kFloat).contiguous();
  const at::Tensor dt_s = saved.dt.contiguous(), Lam = saved.Lam.contiguous();
  const at::Tensor dt_bias = a.dt_bias ? a.dt_bias->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor D = a.D ? (a.D->dim() == 1 ? a.D->to(at::kFloat).view({H, 1}).expand({H, P}) : a.D->to(at::kFloat))
                                 .contiguous()
                           : at::Tensor();
  const at::Tensor z = a.z ? in(*a.z) : at::Tensor();
  at::Tensor y = a.z && saved.y.defined() ? in(saved.y) : at::Tensor();
  const bool y_missing = a.z && !y.defined();
  const at::Tensor gather = t.gather.contiguous();

  Stages st;
  // ds (fp32, or x's 16-bit type on the bf16 path), cb, the row stages and the outputs dx / dz / dB / dC are
  // allocated below, once the kernels are chosen
  at::Tensor ws = at::empty({std::max<int64_t>(S, 1), H, P, N}, f32);
  if (a.initial_state) st.d_roots = at::zeros({std::max<int64_t>(R, 1), H, P, N}, f32);
  st.ddecay = at::empty({NC, H}, f32);
  st.ddt = at::empty({T, H}, f32);
  st.ddt_raw = at::empty({T, H}, f32);
  st.dA_part = at::empty({NC, H}, f32);

  k::BwdParams p;
  p.tokens = T; p.heads = H; p.groups = G; p.head_dim = P; p.state_dim = N;
  p.num_chunks = NC; p.chunk = L; p.num_segments = S;
  p.x_type = bwd_type(x, "x");
  p.bc_type = bwd_type(B, "B");
  TR_CHECK_TYPE(C.scalar_type() == B.scalar_type(), "fused SSD backward: B and C must share a dtype, got ",
                   B.scalar_type(), " and ", C.scalar_type());
  p.dout_type = bwd_type(dout, "grad_out");
  p.states_type = bwd_type(states, "saved states");
  p.x = x.data_ptr(); p.B = B.data_ptr(); p.C = C.data_ptr(); p.dout = dout.data_ptr(); p.states = states.data_ptr();
  if (a.z) {
    p.z_type = bwd_type(z, "z");
    p.z = z.data_ptr();
    if (y.defined()) {
      p.y_type = bwd_type(y, "saved y");
      p.y = y.data_ptr();
    }
  }
  p.dt_raw = dt_raw.data_ptr<float>();
  p.A = A.data_ptr<float>();
  p.dt_bias = a.dt_bias ? dt_bias.data_ptr<float>() : nullptr;
  p.D = a.D ? D.data_ptr<float>() : nullptr;
  p.dt_softplus = a.dt_softplus;
  p.dt_min = static_cast<float>(a.dt_min);
  p.dt_max = static_cast<float>(a.dt_max);
  p.dt = dt_s.data_ptr<float>();
  p.Lam = Lam.data_ptr<float>();
  p.gather = gather.data_ptr<int64_t>();
  const at::Tensor sco = t.seg_chunk_offsets.contiguous(), ridx = t.root_index.contiguous(),
                   lsegs = t.level_segments.contiguous(), coff = t.child_offsets.contiguous(),
                   kids = t.children.numel() > 0 ? t.children.contiguous() : at::zeros({1}, t.parents.options());
  p.seg_chunk_offsets = sco.data_ptr<int64_t>();
  p.root_index = ridx.data_ptr<int64_t>();
  p.level_segments = lsegs.data_ptr<int64_t>();
  p.child_offsets = coff.data_ptr<int64_t>();
  p.children = kids.data_ptr<int64_t>();
  const bool tc = tc_enabled() && k::ssd_bwd_tc_supported(p);
  // Chunk 128 / 256 tables are correct but slow here (issue 20 item 2): the fused bf16 flat row at the GRPO shape
  // took 15.1 ms forward + backward at chunk 64, 1,300 ms at 128 and 1,775 ms at 256 (H100, 2026-12-07). The
  // family adapters build chunk-64 tables; a direct caller with wider tables is told once.
  if (!tc && L > k::kTcBwdChunk && tc_enabled())
    TORCH_WARN_ONCE(::tree_recurrence::sdk::message::str(
        "ssd_tree_scan: the fused backward's tensor-core kernels take chunk ", k::kTcBwdChunk, " only; these chunk-", L,
        " tables run its fp32 CUDA-core kernels, 85-120x slower at the GRPO shape. Build the chunk tables at 64 "
        "(TreePlan.chunk_tables(64)): the results agree to rounding."));
  at::Tensor dyx, dx, dB, dC;
  if (!tc) {
    dyx = at::empty({NC, H, L, L}, f32);
    p.dyx = dyx.data_ptr<float>();
  } else {
    p.dx_type = p.x_type;  // the tensor-core kernels write dx in x's (kernel) dtype: no fp32 (T, H, P) buffer
  }
  p.ws = ws.data_ptr<float>();
  p.droots = a.initial_state ? st.d_roots.data_ptr<float>() : nullptr;
  p.ddecay = st.ddecay.data_ptr<float>();
  p.ddt = st.ddt.data_ptr<float>();
  p.ddt_raw = st.ddt_raw.data_ptr<float>();
  p.dA_part = st.dA_part.data_ptr<float>();

  const bool v1 = v1_selected();
  // the bf16 / fp16 local kernel (dy on the fly). ds is not allocated yet (p.ds, p.ds16 null): the support
  // checks below pass its alignment, and the fresh buffer allocated after them is 16-byte aligned
  const bool local_new = tc && !v1 && k::ssd_bwd_local_bf16_supported(p);
  // H3: true when the new post kernel runs with dy computed on the fly from dout / z; it then writes
  // dz in z's dtype into dz_out and the (NC, H, P) fp32 partials of dD = sum_t dy x into dD_part.
  // TREE_RECURRENCE_SSD_POST_DY=buffer: the new post kernel reads the gate's fp32 dy instead (switch-over
  // check; dz / dD then come from the gate / ATen as before).
  const bool post_dy_buffer = post_dy_buffer_selected();
  // the post kernel's support is decided before dz_out / dD_part are allocated: with post_dy_from_dout
  // set and dz_out / dy still null, ssd_bwd_post_bf16_supported checks the shapes, dtypes and the inputs'
  // alignment; the buffers allocated below are fresh (aligned), and in the dy-buffer mode the gate's dy is
  // allocated whenever post_new is false (need_gate), so the decision holds for both modes
  // (the outputs dx_out, dz_out, dB_out / dC_out are still null here: the check accepts that, they are fresh
  // buffers allocated below). Without a saved y the kernel recomputes it (p.recompute_y; dy on the fly only).
  const auto post_check = [&] {
    if (!(tc && !v1)) return false;
    p.post_dy_from_dout = true;
    const bool ok = k::ssd_bwd_post_bf16_supported(p);
    p.post_dy_from_dout = false;
    return ok;
  };
  p.recompute_y = y_missing && !post_dy_buffer;
  bool post_ok = post_check();
  // y missing on a route that reads it (another post kernel, an environment override, inputs the kernel refuses),
  // or for the gate (which writes dz from y) of the stage op: y from the forward kernels, bit for bit the
  // forward's (a forward's time and transient memory: the common route never takes this)
  const auto forward_y = [&] {
    y = forward(a, t, /*save_y=*/true).second.y;
    p.y = y.data_ptr();
    p.y_type = bwd_type(y, "recomputed y");
  };
  if (y_missing && !(post_ok && p.recompute_y)) {
    forward_y();
    p.recompute_y = false;
    post_ok = post_check();
  }
  const bool post_new = post_ok && !post_dy_buffer;
  // H5: ds in x's 16-bit type when every kernel touching it takes it so (local_bf16, the state pass with the
  // folded ddecay, post_bf16; post_ok implies 16-bit x / B / C / dout / states of one type, !v1 the fold)
  at::Tensor ds16;
  if (local_new && post_ok && !ds_fp32_selected()) {
    ds16 = at::empty({NC, H, P, N}, x.options());
    p.ds16 = ds16.data_ptr();
    p.ds16_type = p.x_type;
  } else {
    st.ds_leave = at::empty({NC, H, P, N}, f32);
    p.ds = st.ds_leave.data_ptr<float>();
  }
  at::Tensor dz_out, dD_part, y_scratch;
  if (post_new) {
    p.post_dy_from_dout = true;
    if (a.D) {
      dD_part = at::empty({NC, H, P}, f32);
      p.dD_part = dD_part.data_ptr<float>();
    }
  }
  // the gate's fp32 dy / dz: only when a kernel still reads dy, or for the stage op's dy / dz outputs
  const bool need_gate = !(local_new && post_new) || keep_stages;
  if (need_gate && a.z && p.y == nullptr) forward_y();  // (the post kernel still recomputes its own: p.recompute_y)
  // post_bf16's outputs: 16-bit dB / dC (no fp32 buffers, no cast), no cb / q / v / ddt_direct / d_dtA outside the
  // stage op (nothing reads them), and dx / dz / dB / dC allocated after the state pass, once its carries (ws)
  // are released: they are not both in memory at the peak
  const bool late_outputs = post_ok && !keep_stages;
  const auto alloc_outputs = [&] {
    dx = at::empty({T, H, P}, tc ? x.options() : f32);
    if (tc) p.dx_out = dx.data_ptr(); else p.dx = dx.data_ptr<float>();
    if (post_ok) {
      dB = at::empty({T, G, N}, B.options());
      dC = at::empty({T, G, N}, B.options());
      p.dB_out = dB.data_ptr();
      p.dC_out = dC.data_ptr();
    } else {
      dB = at::empty({T, G, N}, f32);
      dC = at::empty({T, G, N}, f32);
      p.dB = dB.data_ptr<float>();
      p.dC = dC.data_ptr<float>();
    }
    if (post_new && a.z) {
      // dz over y (in place) when y is this backward's own: the post kernel reads each y element once, in the thread
      // that then writes its dz (L2 loads, not the read-only path), and nothing reads y after it. The saved y only
      // without retain_graph (Saved::y_consumable); a y this backward recomputed, always. One (T, H, P) buffer less
      // at the peak (0.75 GiB at GRPO: the post kernel's outputs are allocated next to states and ds).
      const bool own_y = y.defined() && !p.recompute_y && (saved.y_consumable || !y.is_same(saved.y));
      dz_out = own_y && !keep_stages && y.scalar_type() == z.scalar_type() && y.is_contiguous() ? y
                                                                                                 : at::empty({T, H, P}, z.options());
      p.dz_out = dz_out.data_ptr();
    }
    if (post_ok && p.recompute_y) {  // the post kernel's per-CTA y scratch (NC G x L x P: 50 MB at GRPO)
      y_scratch = at::empty({NC * G, L, P}, x.options());
      p.y_scratch = y_scratch.data_ptr();
    }
  };
  if (!post_ok || keep_stages) {
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
  // issue 20: the fused reverse local + state pass replaces local_bf16 + the state pass (same ds_leave / ws /
  // d_roots bits, ddecay partials of its own layout); decided once the ds / ws / droots pointers are set
  const int fmode = fused_pass_mode();
  const bool fused_pass = local_new && fmode != 0 && (fmode == 1 || fused_passes_suit(NC, S)) &&
                          k::ssd_bwd_fused_pass_supported(p);
  // folded ddecay: per-warp partials written by the state pass (parts depends on the pointers above)
  at::Tensor ddecay_part;
  if (!v1) {
    const int64_t parts = fused_pass ? k::ssd_bwd_fused_pass_ddecay_parts(p) : k::ssd_bwd_ddecay_parts(p);
    ddecay_part = at::empty({NC, H, parts}, f32);
    p.ddecay_part = ddecay_part.data_ptr<float>();
    p.ddecay_parts = parts;
  }

  if (need_gate) check_launch(k::ssd_bwd_gate(p, stream), "gate (dy, dz)");
  if (fused_pass) {
    // the stage op's local stage: local_bf16 into a buffer of its own (the fused pass never forms ds_local in
    // memory); the backward itself runs no local kernel
    if (keep_stages) {
      k::BwdParams q = p;
      at::Tensor tmp = at::empty({NC, H, P, N}, ds16.defined() ? x.options() : f32);
      if (ds16.defined()) q.ds16 = tmp.data_ptr(); else q.ds = tmp.data_ptr<float>();
      check_launch(k::ssd_bwd_local_bf16(q, stream), "bf16 / fp16 local state gradient (stage output)");
      st.local = tmp.to(at::kFloat);
    }
    launch_levels(k::ssd_bwd_fused_pass, p, t, S, stream, "fused reverse local + state pass");
  } else if (local_new) {
    check_launch(k::ssd_bwd_local_bf16(p, stream), "bf16 / fp16 local state gradient (dy on the fly)");
  } else if (tc) {
    check_launch(k::ssd_bwd_local_tc(p, stream), "tensor-core local state gradient");
  } else {
    launch_local_fp32(p, stream);
  }
  if (!fused_pass) {
    if (keep_stages) st.local = ds16.defined() ? ds16.to(at::kFloat) : st.ds_leave.clone();  // widened: exact
    launch_levels(k::ssd_bwd_state_pass, p, t, S, stream, "reverse state pass");
  }
  if (p.ddecay_part != nullptr)
    check_launch(k::ssd_bwd_ddecay_finish(p, stream), "ddecay (sum of the state pass's partials)");
  else
    check_launch(k::ssd_bwd_ddecay(p, stream), "ddecay");
  if (!keep_stages) {
    // the segments' carries (S, H, P, N) fp32: the state pass was their last reader (0.30 GB on the GRPO
    // trie's 72 segments), back to the caching allocator (stream order) before the post kernel's outputs
    // (dx, dz, dB, dC) are allocated on its route (late_outputs), so the two are not in memory together
    ws = at::Tensor();
    p.ws = nullptr;
  }
  if (late_outputs) alloc_outputs();
  // H3's bf16 / fp16 post kernel (ssd_post_bwd.cu): dy on the fly (post_new) or from the gate's dy
  if (post_ok) {  // post_new, or the dy-buffer mode (reads the gate's fp32 dy)
    // (outside the stage op p.cb is null: C B^T stays in shared memory, no 100 MB stage write at GRPO)
    p.post_bf16_checked = true;        // decided above: the launcher does not check again
    check_launch(k::ssd_bwd_post_bf16(p, stream), "bf16 / fp16 chunk gradients (cb, dx, dz, ddt, dB, dC, d(dt A), dD)");
  } else if (tc) {
    check_launch(k::ssd_bwd_post_tc(p, stream), "tensor-core chunk gradients (cb, dx, ddt, dB, dC, d(dt A))");
  } else {
    launch_post_fp32(p, stream);
  }

  if (keep_stages && ds16.defined()) st.ds_leave = ds16.to(at::kFloat);  // the stage op's fp32 ds_leave, exact
  if (!keep_stages) {
    // the kernels' workspaces are dead now: give them back to the caching allocator before the ATen
    // tail allocates (ds_leave alone is 3.2 GB at GRPO in fp32, 1.6 GB in bf16; the stream order keeps the
    // reuse safe)
    st.ds_leave = at::Tensor();
    ds16 = at::Tensor();
    st.cb = at::Tensor();
    st.q = at::Tensor();
    st.v = at::Tensor();
    st.ddt_direct = at::Tensor();
    st.d_dtA = at::Tensor();
    st.ddecay = at::Tensor();
    ws = at::Tensor();
    dyx = at::Tensor();
    ddecay_part = at::Tensor();
  }
  Grads& g = st.grads;
  g.dx = dx.to(a.x.scalar_type());
  g.ddt = st.ddt_raw.to(a.dt.scalar_type());
  g.dB = dB.to(a.B.scalar_type());
  g.dC = dC.to(a.C.scalar_type());
  g.dA = st.dA_part.sum(0).to(a.A.scalar_type());
  if (a.D) {
    if (dD_part.defined()) {  // (NC, H[, P]) partials: fixed-order ATen sums of NC x H [x P] floats
      const at::Tensor hp = dD_part.sum(0);
      g.dD = (a.D->dim() == 1 && hp.dim() == 2 ? hp.sum(1) : hp).to(a.D->scalar_type());
    } else {
      TR_CHECK(st.dy.defined(), "fused SSD backward: dD needs dy or the post kernel's dD partials");
      const at::Tensor xy = st.dy * x.to(at::kFloat);
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

[[maybe_unused]] std::vector<at::Tensor> backward_stages(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& dt,
                                        const at::Tensor& B, const at::Tensor& C, const at::Tensor& A,
                                        const std::optional<at::Tensor>& D, const std::optional<at::Tensor>& dt_bias,
                                        const std::optional<at::Tensor>& z, const std::optional<at::Tensor>& initial_state,
                                        at::ArrayRef<double> dt_limit, bool dt_softplus, const at::Tensor& gather,
                                        const at::Tensor& scatter, const at::Tensor& seg_chunk_offsets,
                                        const at::Tensor& parents, const at::Tensor& root_index,
                                        const at::Tensor& level_segments, at::IntArrayRef level_offsets,
                                        const at::Tensor& child_offsets, const at::Tensor& children,
                                        const at::Tensor& saved_dt, const at::Tensor& saved_Lam,
                                        const at::Tensor& saved_states, const std::optional<at::Tensor>& saved_y) {
  TR_CHECK_VALUE(dt_limit.size() == 2, "ssd_fused_backward_stages: dt_limit must be (low, high)");
  Args a;
  a.x = x; a.dt = dt; a.B = B; a.C = C; a.A = A; a.D = D; a.dt_bias = dt_bias; a.z = z; a.initial_state = initial_state;
  a.dt_min = dt_limit[0]; a.dt_max = dt_limit[1]; a.dt_softplus = dt_softplus;
  Tables t{gather, scatter, seg_chunk_offsets, parents, root_index, level_segments,
           std::vector<int64_t>(level_offsets.begin(), level_offsets.end()), child_offsets, children};
  Saved s{saved_dt, saved_Lam, saved_states, saved_y ? *saved_y : at::Tensor()};
  Stages st = run(grad_out, a, t, s, true);
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
  // Opt-in, TREE_RECURRENCE_SSD_RECOMPUTE_Y=1 (read per call): the memory mode. Measured on the H200 at GRPO
  // (2026-12-04, calls 2-3): the recompute costs the post kernel 2.0 ms (9.32 ms against 7.29; flat row 17.95 ms
  // f+b against 15.83) for 0.72 GiB less peak (5.65 GiB against 6.35): the default keeps the stored y (speed).
  const char* rec = std::getenv("TREE_RECURRENCE_SSD_RECOMPUTE_Y");
  if (rec == nullptr || std::strcmp(rec, "1") != 0) return false;
  if (!a.z || !tc_enabled() || v1_selected() || post_dy_buffer_selected()) return false;
  if (a.x.dim() != 3 || a.B.dim() != 3 || t.gather.dim() != 2 || !a.x.is_cuda()) return false;
  const at::ScalarType in = a.x.scalar_type();
  if ((in != at::kBFloat16 && in != at::kHalf) || a.B.scalar_type() != in || a.C.scalar_type() != in ||
      a.z->scalar_type() != in)
    return false;
  // the post kernel's support as the backward will ask it (grad_out, states, ds, the outputs: fresh, of x's type)
  const k::BwdType ty = bwd_type(a.x, "x");
  k::BwdParams p;
  p.tokens = a.x.size(0); p.heads = a.x.size(1); p.head_dim = a.x.size(2);
  p.groups = a.B.size(1); p.state_dim = a.B.size(2);
  p.num_chunks = t.gather.size(0); p.chunk = t.gather.size(1); p.num_segments = t.parents.size(0);
  p.x_type = p.bc_type = p.dout_type = p.states_type = p.dx_type = p.z_type = ty;
  const bool dense = a.x.is_contiguous() && a.B.is_contiguous() && a.C.is_contiguous() && a.z->is_contiguous();
  if (!dense) return false;  // (a strided input is copied by the backward: its pointer is not this one)
  p.x = a.x.data_ptr(); p.B = a.B.data_ptr(); p.C = a.C.data_ptr(); p.z = a.z->data_ptr();
  p.post_dy_from_dout = true;
  p.recompute_y = true;
  return k::ssd_bwd_tc_supported(p) && k::ssd_bwd_post_bf16_supported(p);
#endif
}

Grads backward(const at::Tensor& grad_out, const Args& a, const Tables& t, const Saved& saved) {
  return run(grad_out, a, t, saved, false).grads;
}

void register_backward_stages_op() {
  op_library(torch::Library::FRAGMENT)
      .def("ssd_fused_backward_stages(Tensor grad_out, Tensor x, Tensor dt, Tensor B, Tensor C, Tensor A, Tensor? D, "
           "Tensor? dt_bias, Tensor? z, Tensor? initial_state, float[] dt_limit, bool dt_softplus, Tensor gather, "
           "Tensor scatter, Tensor seg_chunk_offsets, Tensor parents, Tensor root_index, Tensor level_segments, "
           "int[] level_offsets, Tensor child_offsets, Tensor children, Tensor saved_dt, Tensor saved_Lam, "
           "Tensor saved_states, Tensor? saved_y) -> Tensor[]");
#ifdef TREE_RECURRENCE_WITH_CUDA
  op_library(torch::Library::IMPL, c10::DispatchKey::CUDA).impl("ssd_fused_backward_stages", &backward_stages);
#endif
}

}  // namespace tree_recurrence::ssd::fused
