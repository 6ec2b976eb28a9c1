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
  bool state_pass_ahead = true;  // ssd_state_pass_fwd: 4 chunks loaded ahead (false: one at a time)

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
// d: the chunk scan (C s^T, C B^T masked and decayed times dt x, D x, z gate), tensor cores.
// v2 (ssd_chunk_scan_fwd.cu): per (chunk, 64-row tile, head), head-fastest grid (C / B rows shared
// through L2 by a group's heads), all first-block operands in flight at once, 16-byte epilogue; every
// supported shape (<= ~155 KB of shared memory) with 16-byte aligned x / z / y / out.
bool ssd_chunk_scan_v2_supported(const FwdParams& p);
int ssd_chunk_scan_fwd_v2(const FwdParams& p, void* stream);
// v3 (where v4 is not supported, or TREE_RECURRENCE_SSD_FWD_SCAN=v3; ssd_chunk_scan_group_fwd.cu):
// chunk 64, per (chunk, group, head slice): C B^T once, the heads' state / x / z double-buffered by cp.async, per-warp 16-byte
// epilogue; same arithmetic as v2 (expected bitwise equal). Supported: chunk 64, P <= 64, H a
// multiple of G, shared memory <= 112 KB (2 CTAs per SM), 16-byte aligned x / z / y / out.
bool ssd_chunk_scan_v3_supported(const FwdParams& p);
int ssd_chunk_scan_fwd_v3(const FwdParams& p, void* stream);
// v4 (the default where supported; ssd_chunk_scan_v4_fwd.cu): v3's blocks with 256 threads (rows x
// column halves), key tiles above the diagonal skipped, the epilogue on the accumulator fragments;
// same arithmetic per element (expected bitwise equal to v3). Supported: as v3, its shared memory
// (v3's less the fp32 stage plus per-warp output tiles) <= 112 KB.
bool ssd_chunk_scan_v4_supported(const FwdParams& p);
int ssd_chunk_scan_fwd_v4(const FwdParams& p, void* stream);

const char* ssd_fwd_error_string(int error);

}  // namespace tree_recurrence::ssd::fused::kernels
