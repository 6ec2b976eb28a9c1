// Chunked tree state pass: the one sequential stage of chunked recurrent kernels (Gated DeltaNet,
// Mamba2 SSD, ...), over segment-aligned chunks that follow the trie. CPU and CUDA, no ATen.
//
// Per chunk c (NC chunks) and head (H heads), chunk length C (rows >= the chunk's tokens are zero),
// state K x V:
//   v_new[c] = u[c] - w[c] @ h[c]                 (C x V; w may be absent: v_new = u)
//   S_out(c) = decay[c] * h[c] + kd[c]^T @ v_new[c]  (K x V)
//   h[c]     = S_out(c-1) inside a segment; the first chunk of segment s starts from
//              S_out(last chunk of parents[s]), or for a root from the initial state (shared, or
//              one per root, index root_index[s]), or zeros.
// Backward, with dS the gradient of S_out(c) (the sum of the children's first-chunk state
// gradients for a segment's last chunk, in children order; zero for a leaf):
//   dv_total[c] = dv_new[c] + kd[c] @ dS
//   dh_total[c] = dh[c] + decay[c] * dS - w[c]^T @ dv_total      (= dS of chunk c-1)
//   du = dv_total, dw = -dv_total @ h^T, dkd = v_new @ dS^T, ddecay = <h, dS>.
// The kernels below do the sequential part only: they write du (= dv_total) and dS per chunk; the
// caller forms dw, dkd and ddecay from them with batched matmuls (sdk/chunk_state_op.h).
//
// Schedule: segments are processed level by level (the plan's level_segments / level_offsets),
// forward in increasing level order, backward deepest level first. On CUDA one launch per level
// and direction; one thread block per (segment of the level, head, V tile of 32 columns) walks the
// segment's chunks with its fp32 (fp64) state tile in shared memory. Column tiles of V are
// independent in every sequential quantity, so no block ever waits for another one of its level.
// Final states of segments with children (forward) and first-chunk state gradients of non-roots
// (backward) pass between levels through a (S, H, K, V) workspace. Deterministic: no atomics.
//
// Arrays are contiguous, row-major, on the device the function runs on (level_offsets: host).
#pragma once

#include <cstdint>

#include "tree_recurrence/kernels/dtype.h"  // DType

namespace tree_recurrence::kernels {

// Element types: `in` is the type of w/u/kd/v_new/grad_v_new/grad_u; `acc` (Float32 or Float64)
// is the type of decay, h, states, initial states, workspaces and grad_h/grad_state. The SDK's one
// element-type enum (dtype.h), under the name the state pass's callers use.
using ChunkDType = DType;

constexpr int64_t kChunkStateMaxChunk = 64;  // C
constexpr int64_t kChunkStateCudaMaxK = 256;  // K on CUDA (any K on CPU)

// The plan's chunk tables (TreePlan.chunk_tables(C, device)), int64, on the device of the call;
// level_offsets on the HOST. Shared by the state pass parameter blocks (a base, so the fields keep
// their names there).
struct ChunkTreeTables {
  const int64_t* seg_chunk_offsets = nullptr;  // S+1
  const int64_t* parents = nullptr;            // S
  const int64_t* root_index = nullptr;         // S, -1 for non-roots
  const int64_t* level_segments = nullptr;     // S
  const int64_t* level_offsets = nullptr;      // HOST, num_levels+1
  int64_t num_levels = 0;
  const int64_t* child_offsets = nullptr;      // S+1
  const int64_t* children = nullptr;           // child_offsets[S] = S - R
};

struct ChunkStatePassParams : ChunkTreeTables {  // tables: the base
  int64_t num_chunks = 0;     // NC
  int64_t heads = 0;          // H
  int64_t chunk = 0;          // C, 1..kChunkStateMaxChunk
  int64_t k_dim = 0;          // K
  int64_t v_dim = 0;          // V
  int64_t num_segments = 0;   // S
  int64_t num_roots = 0;      // R: rows of a per-root initial state / grad_initial_roots
  ChunkDType in = ChunkDType::Float32;
  ChunkDType acc = ChunkDType::Float32;

  // Forward inputs.
  const void* w = nullptr;       // NC x H x C x K (in), or null
  const void* u = nullptr;       // NC x H x C x V (in)
  const void* kd = nullptr;      // NC x H x C x K (in)
  const void* decay = nullptr;   // NC x H (acc)
  // Initial state (acc): null (zeros), H x K x V shared by every root (initial_per_root false), or
  // R x H x K x V indexed by root_index.
  const void* initial_state = nullptr;
  bool initial_per_root = false;

  // Forward outputs.
  void* h = nullptr;       // NC x H x K x V (acc): state entering each chunk
  void* v_new = nullptr;   // NC x H x C x V (in)

  // Backward inputs (h and v_new above are read; u and initial_state are not).
  const void* grad_h = nullptr;      // NC x H x K x V (acc), or null (zero)
  const void* grad_v_new = nullptr;  // NC x H x C x V (in), or null (zero)
  // Backward outputs.
  void* grad_u = nullptr;             // NC x H x C x V (acc): dv_total
  void* grad_state = nullptr;         // NC x H x K x V (acc): dS, the gradient of S_out(c)
  void* grad_initial_roots = nullptr; // R x H x K x V (acc): state gradient entering each root
                                      // (row root_index[s]); may be null when not wanted
  // CUDA only, optional: NC x H x ceil(V/32) (acc), per 32-column V tile the partial sums of
  // ddecay[c] = <h[c], dS(c)> (sum them over the last axis in order). The CPU ignores it.
  void* grad_decay_partial = nullptr;

  // Scratch, S x H x K x V (acc), required by both directions.
  void* workspace = nullptr;

  // CPU only: the heads [head_begin, head_end) this call computes (-1: all), so callers may run
  // head ranges in parallel. The CUDA functions ignore them.
  int64_t head_begin = 0;
  int64_t head_end = -1;
};

const char* chunk_dtype_name(ChunkDType dtype);

// Throws std::invalid_argument on bad sizes, missing pointers or bad level_offsets. Does not read
// device tables.
void check_chunk_state_params(const ChunkStatePassParams& params, bool backward);

// CPU: in must equal acc (Float32 or Float64; callers widen half types). Also validates every table
// (throws std::invalid_argument naming the table and index).
void chunk_state_pass_forward_cpu(const ChunkStatePassParams& params);
void chunk_state_pass_backward_cpu(const ChunkStatePassParams& params);
void check_chunk_state_tables_cpu(const ChunkStatePassParams& params);

// CUDA: in Float32/BFloat16/Float16 with acc Float32, or Float64 with acc Float64; K <= 256
// (K <= 128 for Float64). `stream` is a cudaStream_t. Asynchronous, no host synchronisation;
// tables are NOT validated (no device reads from the host). Launch failures throw
// std::runtime_error. Defined only when CUDA is enabled.
void chunk_state_pass_forward_cuda(const ChunkStatePassParams& params, void* stream);
void chunk_state_pass_backward_cuda(const ChunkStatePassParams& params, void* stream);

}  // namespace tree_recurrence::kernels
