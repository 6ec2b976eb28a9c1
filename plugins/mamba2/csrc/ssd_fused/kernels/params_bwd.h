// POD parameters and launchers of the fused SSD (Mamba2) backward kernels (*_bwd.cu; the math is in
// ssd_fused.h and, stage by stage, in tests/python/ssd_bwd_reference.py; ssd_fused_bwd.cpp's plan says which
// route runs which). No ATen, no CUDA headers:
// the launchers take the stream as void* (a cudaStream_t) and return the cudaError_t of their launch
// as an int (0 = success).
//
// Layouts (contiguous, row-major). Tensors tagged with a BwdType may be fp32, bf16 or fp16 (the
// kernels widen on load; fp32 lets the stage test compare against float64 at fp32 precision):
//   x, dout, y, z (T, H, P); B, C (T, G, N); states (NC, H, P, N) entering each chunk.
// fp32: dt_raw (T, H); A, dt_bias (H); D (H * P) (per-head values repeated over P) or null;
//   saved dt, Lam (NC, H, L); gather (NC, L) int64 (-1 = pad row); tables as TreePlan.chunk_tables.
// Outputs and workspaces are fp32:
//   dy, dz (T, H, P)                  dy = dout silu(z) (= dout without z), dz = dout y silu'(z)
//   cb (NC, G, L, L)                  <C_i, B_j> for j <= i, else 0
//   dyx (NC, H, L, L)                 <dy_i, x_j> for j <= i, else 0; the d(dt A) kernel turns it
//                                     in place into the row-exclusive prefix sums of W (below)
//   ds (NC, H, P, N)                  first the local entering-state gradient, then (in place, by the
//                                     state pass) ds_leave: the gradient of each chunk's leaving state
//                                     (the Half route: ds16 below, in the input type, instead)
//   ws (S, H, P, N)                   entering-state gradient of each segment's first chunk
//   droots (R, H, P, N) or null       the same, per root (row root_index[s])
//   ddecay (NC, H)                    <s[c], ds_leave[c]> (the gradient of exp(Lam_last))
//   q, v, ddt_direct, d_dtA (NC, H, L)
//   dx (T, H, P), ddt (T, H) (wrt the prepared dt), ddt_raw (T, H), dB, dC (T, G, N), dA_part (NC, H)
// 64-bit indexing throughout. Deterministic: every sum has a fixed order, no atomics.
#pragma once

#include <cstdint>

namespace tree_recurrence::ssd::fused::kernels {

enum class BwdType { Float32, BFloat16, Float16 };

struct BwdParams {
  int64_t tokens = 0, heads = 0, groups = 0, head_dim = 0, state_dim = 0;  // T, H, G, P, N
  int64_t num_chunks = 0, chunk = 0;                                        // NC, L (<= 256)
  int64_t num_segments = 0;                                                 // S

  BwdType x_type = BwdType::BFloat16, bc_type = BwdType::BFloat16, dout_type = BwdType::BFloat16;
  BwdType y_type = BwdType::BFloat16, z_type = BwdType::BFloat16, states_type = BwdType::BFloat16;

  // inputs
  const void* x = nullptr;
  const void* B = nullptr;
  const void* C = nullptr;
  const void* dout = nullptr;
  const void* y = nullptr;        // with z only
  const void* z = nullptr;        // or null
  const void* states = nullptr;
  const float* dt_raw = nullptr;
  const float* A = nullptr;
  const float* dt_bias = nullptr;  // or null
  const float* D = nullptr;        // (H * P) or null
  bool dt_softplus = false;
  float dt_min = 0.f, dt_max = 0.f;  // dt_max may be +inf
  const float* dt = nullptr;         // saved (NC, H, L)
  const float* Lam = nullptr;        // saved (NC, H, L)

  // tables (device), int64
  const int64_t* gather = nullptr;             // NC x L
  const int64_t* seg_chunk_offsets = nullptr;  // S + 1
  const int64_t* root_index = nullptr;         // S
  const int64_t* level_segments = nullptr;     // S
  const int64_t* child_offsets = nullptr;      // S + 1
  const int64_t* children = nullptr;

  // outputs / workspaces (fp32)
  float* dy = nullptr;
  float* dz = nullptr;  // or null (no z)
  float* cb = nullptr;
  float* dyx = nullptr;
  float* ds = nullptr;
  float* ws = nullptr;
  float* droots = nullptr;  // or null
  float* ddecay = nullptr;
  float* q = nullptr;
  float* v = nullptr;
  float* ddt_direct = nullptr;
  float* d_dtA = nullptr;
  float* dx = nullptr;
  float* ddt = nullptr;
  float* ddt_raw = nullptr;
  float* dB = nullptr;
  float* dC = nullptr;
  float* dA_part = nullptr;
  // TensorCore and Half routes: dx written in this type (x's), rounded once from fp32 (dx above unused)
  void* dx_out = nullptr;
  BwdType dx_type = BwdType::Float32;
  // ddecay_part (NC, H, ddecay_parts) fp32: one partial of <s[c], ds_leave[c]> per warp of the reverse pass
  // (ssd_bwd_ddecay_parts / ssd_bwd_fused_pass_ddecay_parts say how many), summed in order into ddecay by
  // ssd_bwd_ddecay_finish.
  float* ddecay_part = nullptr;
  int64_t ddecay_parts = 0;
  // The Half route (post_bf16 forms dy = dout silu(z), dout without z, from dout, z, y itself): dz_out (T, H, P) in
  // z's type (when z is given); dD_part (NC, H, P) fp32 or null: per (chunk, head, p) the partial sum over the
  // chunk's tokens of dy x (ATen sums chunks).
  void* dz_out = nullptr;  // may be y itself (dz written in place over y: each element read, then written, by one thread)
  float* dD_part = nullptr;
  // set by a caller that has just evaluated ssd_bwd_post_bf16_supported(p) as true for these params (and changed
  // only what the support check allows since): ssd_bwd_post_bf16 then launches without checking again
  bool post_bf16_checked = false;
  // The state gradient in the input type (the Half route): ds16 (NC, H, P, N) of ds16_type (x's bf16 / fp16)
  // replaces the fp32 ds above (then null): local_bf16 (or the fused pass) rounds ds_local once (RN) from its fp32
  // accumulators, the state pass keeps the carry (and the ddecay partials) in fp32 and writes ds_leave rounded (RN)
  // in place, the post kernel reads the 16-bit values. The fp32-ds kernels (local, local_tc, rows, dB / dC,
  // post_tc) refuse it; the 16-bit kernels (local_bf16, the fused pass, post_bf16) require it. ws and droots stay
  // fp32.
  void* ds16 = nullptr;
  BwdType ds16_type = BwdType::BFloat16;
  // post_bf16 only:
  //   recompute_y: with z, y is not read (may be null): the post kernel recomputes it from C, s, cb, x, dt, Lam
  //     and D, so the forward need not store it (the memory mode);
  //   y_scratch: (NC * G, L, P) in x's type, the per-CTA scratch the recomputed y passes through (L2-resident:
  //     each CTA reuses its L x P for every head); required with recompute_y (the check accepts it null: a caller
  //     allocates it after deciding);
  //   dB_out / dC_out (T, G, N) in B's 16-bit type: dB / dC rounded once from fp32 (no fp32 buffer, no cast).
  bool recompute_y = false;
  void* y_scratch = nullptr;
  void* dB_out = nullptr;
  void* dC_out = nullptr;
};

constexpr int64_t kBwdMaxChunk = 256;
// The one chunk the tensor-core backward takes (ssd_bwd_tc_supported); wider tables run the fp32 CUDA-core kernels.
constexpr int kTcBwdChunk = 64;

// Shared by every route (ssd_bwd.cu):
int ssd_bwd_gate(const BwdParams& p, void* stream);        // dy, dz (TensorCore, CudaCore; the stage op)
// The reverse state pass, one launch per level, deepest first: the level's segments are
// level_segments[begin, begin + count). fp32 ds, or the 16-bit ds16 (the ring kernel: 16-byte-aligned buffers,
// states in ds16's type, ddecay_part set). Writes ds_leave in place, ws, droots, the ddecay partials.
int ssd_bwd_state_pass(const BwdParams& p, int64_t begin, int64_t count, void* stream);
int64_t ssd_bwd_ddecay_parts(const BwdParams& p);             // partials per (chunk, head) (after ds, ws, droots, states)
int ssd_bwd_ddecay_finish(const BwdParams& p, void* stream);  // ddecay from ddecay_part
const char* ssd_bwd_error_string(int error);

// The CudaCore route (ssd_bwd.cu), fp32 ds, any chunk up to kBwdMaxChunk, in launch order around the state pass:
int ssd_bwd_cb(const BwdParams& p, void* stream);          // cb
int ssd_bwd_dyx(const BwdParams& p, void* stream);         // dyx (needs dy)
int ssd_bwd_local(const BwdParams& p, void* stream);       // ds = local (needs dy)
int ssd_bwd_rows(const BwdParams& p, void* stream);        // dx, ddt_direct, q, v (needs ds_leave, ddecay)
int ssd_bwd_dbdc(const BwdParams& p, void* stream);        // dB, dC (needs dyx untouched)
int ssd_bwd_dtA(const BwdParams& p, void* stream);         // d_dtA, ddt, ddt_raw, dA_part (overwrites dyx)

// The Half route's 16-bit kernels: chunk 64, P and N in 1..128 multiples of 8, one 16-bit type for their inputs
// and ds16, 16-byte aligned pointers (each _supported says exactly).
// local_bf16 (ssd_local_bwd.cu): ds16 = (e^Lam . dy)^T C with dy from dout and z (p.dy unused), one MMA per product.
bool ssd_bwd_local_bf16_supported(const BwdParams& p);
int ssd_bwd_local_bf16(const BwdParams& p, void* stream);
// The fused reverse local + state pass (ssd_state_pass_bwd.cu), per level (deepest first): local_bf16's ds_local
// formed inside the reverse pass (never stored) and the state pass's ds_leave, ws, d_roots (bitwise theirs) and
// ddecay partials of its own layout (ssd_bwd_fused_pass_ddecay_parts, then ssd_bwd_ddecay_finish). Replaces
// ssd_bwd_local_bf16 + ssd_bwd_state_pass; also needs states (/ ds16, ws, droots) 8-byte aligned.
bool ssd_bwd_fused_pass_supported(const BwdParams& p);
int64_t ssd_bwd_fused_pass_ddecay_parts(const BwdParams& p);
int ssd_bwd_fused_pass(const BwdParams& p, int64_t begin, int64_t count, void* stream);
// post_bf16 (ssd_post_bwd.cu): post_tc's outputs (cb if set, dx_out, q, v, ddt_direct, d_dtA when set, ddt,
// ddt_raw, dA_part, dB_out, dC_out) and dz_out, dD_part; one bf16 / fp16 MMA per product, ldmatrix fragments; x /
// B / C / dout / states (/ z / y) of one 16-bit type. The support check accepts null outputs (dx_out, dz_out,
// dB_out / dC_out): a caller may allocate them after deciding (fresh buffers are aligned); the launch refuses them
// null.
bool ssd_bwd_post_bf16_supported(const BwdParams& p);
int ssd_bwd_post_bf16(const BwdParams& p, void* stream);  // needs ds_leave, ddecay

// The TensorCore route (ssd_tc_bwd.cu), chunk 64 with P, N <= 128 and post_tc's shared-memory plan within the
// device's opt-in limit (ssd_bwd_tc_supported; the Half route asks it too). Order: gate -> local_tc -> state pass
// levels -> ddecay finish -> post_tc. dyx is not used (may be null).
bool ssd_bwd_tc_supported(const BwdParams& p);
int ssd_bwd_local_tc(const BwdParams& p, void* stream);  // ds = local (needs dy)
int ssd_bwd_post_tc(const BwdParams& p, void* stream);   // cb, dx, ddt_direct, q, v, d_dtA, ddt, ddt_raw,
                                                         // dA_part, dB, dC (needs ds_leave, ddecay)

}  // namespace tree_recurrence::ssd::fused::kernels
