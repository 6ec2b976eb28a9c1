// Chunked tree state pass on tensor cores (CUDA, bf16 / fp16 operands, fp32 state): the sequential
// stage of the fused Gated DeltaNet kernels (and any family whose chunk update has this form).
// No ATen: plugins call these C++ functions directly with a POD parameter block.
//
// Per chunk c (NC chunks), head (H heads), chunk length C = 64 (padded rows of w, u, kd are zero),
// state S (K x V, fp32, kept in registers):
//   h[c]      = S entering chunk c                        (stored rounded to the input type)
//   v_new[c]  = u[c] - w[c] @ h[c]                        (C x V; w null: v_new = u)
//   S leaving = decay[c] * S + kd[c]^T @ v_new[c]         (v_new rounded to the input type first)
// A segment's first chunk starts from its parent's final state (fp32, final_state[parent]), a root
// from the initial state (shared (H, K, V), or one per root (R, H, K, V) by root_index) or zeros.
//
// Backward, per chunk in reverse, with dS the gradient of the state leaving chunk c (for a segment's
// last chunk: the sum of its children's grad_initial, in children order (deterministic), zero for
// a leaf):
//   grad_state_out[c] = dS                                 (stored rounded to the input type)
//   dv_total[c] = dv_local[c] + kd[c] @ dS                 (C x V; dv_local null: 0)
//   dS (entering c) = decay[c] * dS + q_g[c]^T @ grad_out[c] - w[c]^T @ dv_total[c]
// (q_g / grad_out null: that term is 0; w null: no w term; grad_out chunk-major, or token-major
// through grad_out_rows). The value left after a segment's first
// chunk is that segment's initial-state gradient: written to grad_initial (R, H, K, V) for a root
// (summed over roots when the initial state is shared: the caller sums) and kept in the (S, H, K, V)
// workspace for non-roots, where the parent's last chunk gathers it.
//
// Schedule: one launch per trie level and direction (forward: levels in increasing order,
// backward: deepest first), one CTA per (segment of the level, head, V tile); host loop over the
// host level_offsets, no host sync. Deterministic: no atomics. Per level one of two kernels with
// the same arithmetic (bitwise equal at BV 32): the wide one (8 warps, BV 32) where the level has
// at most one CTA per SM, else the 4-warp one (see `wide` below).
//
// Arrays are contiguous, row-major, on the current CUDA device; the tables are the plan's
// (TreePlan.chunk_tables(64, device)), int64.
#pragma once

#include <cstdint>

#include "tree_recurrence/kernels/chunk_state_pass.h"  // ChunkDType, ChunkTreeTables

namespace tree_recurrence::kernels {

constexpr int64_t kChunkStateTcChunk = 64;   // C
constexpr int64_t kChunkStateTcMaxK = 128;   // K <= 128
constexpr int64_t kChunkStateTcMaxV = 128;   // V <= 128 (split into V tiles)

struct ChunkStatePassTcParams : ChunkTreeTables {  // tables (device; level_offsets HOST): the base
  int64_t num_chunks = 0;    // NC
  int64_t heads = 0;         // H
  int64_t k_dim = 0;         // K, 1..128, a multiple of 8
  int64_t v_dim = 0;         // V, 1..128, a multiple of 8
  int64_t num_segments = 0;  // S
  int64_t num_roots = 0;     // R
  ChunkDType in = ChunkDType::BFloat16;  // BFloat16 or Float16

  // Forward inputs.
  const void* w = nullptr;             // (NC, H, C, K) in, or null
  const void* u = nullptr;             // (NC, H, C, V) in
  const void* kd = nullptr;            // (NC, H, C, K) in
  const float* decay = nullptr;        // (NC, H)
  const float* initial_state = nullptr;  // null, (H, K, V) or (R, H, K, V)
  bool initial_per_root = false;
  // Forward outputs.
  void* h = nullptr;              // (NC, H, K, V) in
  void* v_new = nullptr;          // (NC, H, C, V) in
  float* final_state = nullptr;   // (S, H, K, V): state leaving each segment's last chunk

  // Backward inputs (w, kd, decay above are read too).
  const void* dv_local = nullptr;  // (NC, H, C, V) in, or null
  const void* q_g = nullptr;       // (NC, H, C, K) in, or null
  const void* grad_out = nullptr;  // (NC, H, C, V) in, or null; (T, H, V) with grad_out_rows
  // null: grad_out is chunk-major as above. Else (NC, C) int64, the token of each chunk row (-1: a
  // padding row, read as zeros; e.g. the plan's gather table), and grad_out is token-major (T, H, V):
  // row i of chunk c is grad_out[grad_out_rows[c * C + i], head, :] (no chunk-major copy of it).
  const int64_t* grad_out_rows = nullptr;
  // Backward outputs.
  void* grad_state_out = nullptr;  // (NC, H, K, V) in: gradient of the state leaving each chunk
  void* dv_total = nullptr;        // (NC, H, C, V) in
  float* grad_initial = nullptr;   // (R, H, K, V): per-root initial-state gradient
  float* workspace = nullptr;      // (S, H, K, V): non-roots' initial-state gradients

  // The kernel plan, chosen per level from the level's grid and the device (SM count, shared
  // memory): the wide kernel (8 warps splitting each chunk's products and state update by columns
  // too, BV 32, two stages of operand tiles: 57-140 KB of shared memory) on levels whose BV-32 grid
  // has at most one CTA per SM, where its shared memory fits the device; else the 4-warp kernel,
  // at 64 V columns per CTA when the level gives every SM two CTAs at that width (K > 64), else 32.
  // The wide kernel equals the 4-warp one at BV 32 bit for bit. The two fields below force a
  // choice (tests): v_tile 32 or 64 the 4-warp kernel's V tile (0: the plan's); wide 0 the 4-warp
  // kernel, 1 the wide one on every level (needs v_tile 0 or 32 and the shared memory, else an
  // error), -1 the plan's.
  int v_tile = 0;
  int wide = -1;
};

// Both return an empty string on success, else what is wrong (bad parameters, or the launch error;
// no host sync). The string stays valid until the calling thread's next call.
const char* chunk_state_pass_tc_forward(const ChunkStatePassTcParams& p, void* cuda_stream);
const char* chunk_state_pass_tc_backward(const ChunkStatePassTcParams& p, void* cuda_stream);

}  // namespace tree_recurrence::kernels
