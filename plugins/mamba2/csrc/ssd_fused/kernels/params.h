// POD parameters and launchers of the fused SSD (Mamba2) forward kernels (ssd_fused.h has the math).
// No ATen, no CUDA headers: the launchers take the stream as void* (a cudaStream_t) and return the
// cudaError_t of their launches as an int (0 = success); ssd_fwd_error_string names it.
//
// Layouts (contiguous, row-major; "in" = bf16 or fp16, x / B / C / states / y / out alike):
//   x (T, H, P) in; B, C (T, G, N) in; dt_raw (T, H) fp32; A, dt_bias (H) fp32; D (H * P) fp32
//   (per head values repeated over P) or null; z (T, H, P) in or fp32 (z_fp32) or null;
//   gather (NC, L) int64 (-1 = pad row); tables as TreePlan.chunk_tables gives them.
//   dt, Lam (NC, H, L) fp32; chunk_states (NC, H, P, N) fp32; states (NC, H, P, N) in;
//   workspace (S, H, P, N) fp32 (final states of segments with children);
//   initial_state null, (H, P, N) fp32 shared, or (R, H, P, N) fp32 by root_index (initial_per_root).
// Every exponent is clamped to <= 0 (A <= 0 in every model: A = -exp(A_log)).
#pragma once

#include <cstdint>

namespace tree_recurrence::ssd::fused::kernels {

enum class InType { BFloat16, Float16 };

struct FwdParams {
  InType in = InType::BFloat16;
  int64_t tokens = 0, heads = 0, groups = 0, head_dim = 0, state_dim = 0;  // T, H, G, P, N
  int64_t num_chunks = 0, chunk = 0;                                        // NC, L (64, 128 or 256)
  int64_t num_segments = 0;

  // inputs
  const void* x = nullptr;
  const void* B = nullptr;
  const void* C = nullptr;
  const float* dt_raw = nullptr;
  const float* A = nullptr;
  const float* dt_bias = nullptr;   // or null
  const float* D = nullptr;         // (H * P) or null
  const void* z = nullptr;          // or null
  bool z_fp32 = false;
  bool dt_softplus = false;
  float dt_min = 0.f, dt_max = 0.f;  // dt_max may be +inf
  const float* initial_state = nullptr;
  bool initial_per_root = false;

  // tables (device), int64
  const int64_t* gather = nullptr;             // NC x L
  const int64_t* seg_chunk_offsets = nullptr;  // S + 1
  const int64_t* parents = nullptr;            // S
  const int64_t* root_index = nullptr;         // S
  const int64_t* level_segments = nullptr;     // S
  const int64_t* level_offsets = nullptr;      // HOST, num_levels + 1
  int64_t num_levels = 0;
  const int64_t* child_offsets = nullptr;      // S + 1

  // outputs / transients
  float* dt = nullptr;            // NC x H x L
  float* Lam = nullptr;           // NC x H x L
  float* chunk_states = nullptr;  // NC x H x P x N
  void* states = nullptr;         // NC x H x P x N (in)
  float* workspace = nullptr;     // S x H x P x N
  void* y = nullptr;              // T x H x P (in), pre-gate; null unless z (and not needed: no grad)
  void* out = nullptr;            // T x H x P (in)
};

// The shapes the kernels take (P, N multiples of 8, P <= 128, N <= 256, L in {64, 128, 256}).
inline bool fwd_shape_supported(int64_t chunk, int64_t head_dim, int64_t state_dim) {
  return (chunk == 64 || chunk == 128 || chunk == 256) && head_dim > 0 && head_dim % 8 == 0 && head_dim <= 128 &&
         state_dim > 0 && state_dim % 8 == 0 && state_dim <= 256;
}

// a+b: dt prepare, chunk-local cumsum Lam, chunk states S_c (tensor cores).
int ssd_chunk_state_fwd(const FwdParams& p, void* stream);
// c: the tree state pass, one launch per level (host loop over level_offsets).
int ssd_state_pass_fwd(const FwdParams& p, void* stream);
// a+b+c in one kernel (ssd_chunk_state_pass_fwd.cu): dt, Lam and the states entering each chunk,
// one launch per level; S_c stays in registers (chunk_states is neither read nor written).
int ssd_chunk_state_pass_fwd(const FwdParams& p, void* stream);
// a+b+c for long segments (ssd_chunk_state_scan_fwd.cu; chunk 64): dt and Lam per (chunk, head), then
// one pipelined launch per level computing each S_c on tensor cores and the states entering each chunk
// (chunk c + 2's rows in flight while chunk c computes); chunk_states is neither read nor written, and
// dt, Lam, states and the workspace are bitwise the three-kernel path's (a+b, c above).
bool ssd_chunk_state_scan_supported(const FwdParams& p);
int ssd_chunk_state_scan_fwd(const FwdParams& p, void* stream);
// d: the chunk scan (C s^T, C B^T masked and decayed times dt x, D x, z gate), tensor cores; two
// kernels with the same arithmetic per element (fwd_tiles.cuh's expressions in the same order: their
// outputs are bitwise equal).
// Per head (ssd_chunk_scan_fwd.cu): per (chunk, 64-row tile, head), head-fastest grid (C / B rows
// shared through L2 by a group's heads), all first-block operands in flight at once, 16-byte
// epilogue; every supported shape (<= ~155 KB of shared memory) with 16-byte aligned x / z / y / out.
bool ssd_chunk_scan_supported(const FwdParams& p);
int ssd_chunk_scan_fwd(const FwdParams& p, void* stream);
// Grouped (ssd_chunk_scan_group_fwd.cu): per (chunk, group, head slice), C B^T once, the heads'
// state / x / z double-buffered by cp.async, 256 threads (rows x column halves), key tiles above the
// diagonal skipped, the epilogue on the accumulator fragments. Supported: chunk 64, P <= 64, H a
// multiple of G, shared memory <= 112 KB (2 CTAs per SM), N <= 128 (<= 192 at P <= 32), 16-byte
// aligned x / z / y / out.
bool ssd_chunk_scan_group_supported(const FwdParams& p);
int ssd_chunk_scan_group_fwd(const FwdParams& p, void* stream);

// The forward's kernel plan: how the states entering each chunk are formed and which chunk scan
// runs. fwd_plan (ssd_fused_fwd.cpp) picks it once per forward call from the filled parameters
// (chunk count, segment count, chunk, P, N, G, H, z's type, alignment):
//   FusedPass    a+b+c in ssd_chunk_state_pass_fwd, where the segments are short (fused_passes_suit:
//                they average <= 64 chunks; the pass walks each segment's chunks in order, so one
//                long row would leave it a CTA per head);
//   Pipelined    ssd_chunk_state_scan_fwd: long segments at chunk 64 (ssd_chunk_state_scan_supported);
//   ThreeKernel  ssd_chunk_state_fwd (fp32 chunk_states) then ssd_state_pass_fwd: long segments at
//                chunk 128 / 256 (and at chunk 64 where ssd_chunk_state_scan_supported fails);
//   and the chunk scan Grouped where ssd_chunk_scan_group_supported holds, else PerHead.
enum class StatePath { FusedPass, Pipelined, ThreeKernel };
enum class ScanKernel { Grouped, PerHead };
struct FwdPlan {
  StatePath path = StatePath::FusedPass;
  ScanKernel scan = ScanKernel::PerHead;
};
FwdPlan fwd_plan(const FwdParams& p);

const char* ssd_fwd_error_string(int error);

}  // namespace tree_recurrence::ssd::fused::kernels
