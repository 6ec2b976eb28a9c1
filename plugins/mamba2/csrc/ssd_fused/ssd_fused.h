// The fused bf16 / fp16 tensor-core path of ssd_tree_scan on CUDA. ssd_chunked.cpp's
// chunked_scan calls fused::scan when fused::supported(...) holds; everything else (CPU, fp32,
// fp64, shapes outside the kernels' range) stays on the ATen composite, the exact twin these
// kernels are tested against.
//
// Math (chunk L = the gather table's width, 64, 128 or 256; chunks never cross a segment; tokens i, j
// of one chunk; H heads, G groups, head h reads group h / (H / G); state (P, N) per head):
//   dt_i  = clamp(softplus?(dt_raw_i + dt_bias), dt_limit)   (fp32; softplus threshold 20; pad rows 0)
//   Lam_i = sum_{m <= i} dt_m A                                (chunk-local, fp32, <= 0)
//   S_c   = sum_j exp(Lam_last - Lam_j) dt_j x_j^T B_j        (P x N, the chunk's own state, from 0)
//   state pass over the trie (elementwise, fp32): s[c] = state entering chunk c; a segment's first
//   chunk starts from its parent's leaving state, a root from initial_state ((H, P, N) shared or
//   (R, H, P, N) per root) or 0; leaving state = exp(Lam_last) s[c] + S_c
//   y_i   = exp(Lam_i) C_i s[c]^T + sum_{j <= i} <C_i, B_j> exp(Lam_i - Lam_j) dt_j x_j + D x_i
//   out_i = y_i * silu(z_i) when z is given, else y_i
//
// Buffers written by the forward and saved for the backward (NC chunks, chunk-major):
//   dt     float32 (NC, H, L)        dt_i after bias / softplus / clamp (0 on pad rows)
//   Lam    float32 (NC, H, L)        chunk-local cumsum of dt A
//   states in-type (NC, H, P, N)     s[c], the state entering each chunk (rounded like mamba-ssm)
//   y      in-type (T, H, P)         y before the z gate (only when z is given and forms_y_itself is false:
//                                     otherwise the backward's post kernel recomputes it)
// "in-type" is x's dtype (bf16 or fp16); B, C share it; dt, z, D, dt_bias, A may be fp32 or in-type.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "tree_recurrence/sdk/chunk_tables.h"

namespace tree_recurrence::ssd::fused {

// The plan's tables as the op receives them (TreePlan.chunk_tables(L, device); sdk/chunk_tables.h).
using Tables = ::tree_recurrence::ChunkTableSet;

struct Args {
  at::Tensor x, dt, B, C, A;                 // (T, H, P), (T, H), (T, G, N) x2, (H)
  std::optional<at::Tensor> D, dt_bias, z;   // (H) or (H, P); (H); like x
  std::optional<at::Tensor> initial_state;   // (H, P, N) or (R, H, P, N)
  double dt_min = 0.0, dt_max = 0.0;
  bool dt_softplus = false;
};

struct Saved {
  at::Tensor dt, Lam, states, y;  // y undefined without z
  // y is this backward's to overwrite: no later backward reads it (the graph is not kept: autograd frees the saved
  // buffers after this backward anyway). The bf16 post kernel then writes dz over y in place (one (T, H, P) buffer
  // less at the backward's peak: 0.75 GiB at GRPO). Each element of y is read once, by the thread that then writes
  // that element's dz.
  bool y_consumable = false;
};

// Whether the fused kernels take this call: CUDA, x/B/C bf16 or fp16 alike, L in {64, 128, 256},
// P and N multiples of 8 with P <= 128 and N <= 256, and the fused kernels on (settings::fused_kernels(),
// TREE_RECURRENCE_FUSED).
bool supported(const Args& a, const Tables& t);

// The op with autograd (a torch::autograd::Function around forward() and backward()). Returns out
// (T, H, P) in x's dtype (bf16 / fp16: the kernels' own rounding, no fp32 widening); the composite
// returns fp32 (ssd_chunked.h).
at::Tensor scan(const Args& a, const Tables& t);

// Forward kernels (ssd_fused_fwd.cpp): out (T, H, P) in x's dtype, and the saved buffers (with
// save_y false, y is neither written nor returned: a forward no backward will follow).
std::pair<at::Tensor, Saved> forward(const Args& a, const Tables& t, bool save_y = true);

struct Grads {
  at::Tensor dx, ddt, dB, dC, dA;           // like x, dt, B, C, A
  at::Tensor dD, ddt_bias, dz;              // like D, dt_bias, z (undefined when absent)
  at::Tensor d_initial_state;               // like initial_state, float32 (undefined when absent)
};

// The auto rule of both fused sequential passes (the forward's chunk-state pass, the backward's reverse local +
// state pass), on host counts only: fused when the plan's segments average at most 64 chunks. A pass walks each
// (segment, head) chunk by chunk, so one long row (one segment of hundreds of chunks) leaves it a CTA per head
// walking every chunk in turn, where the unfused kernels work on all chunks at once (docs/kernels.md).
inline bool fused_passes_suit(int64_t num_chunks, int64_t num_segments) {
  return num_chunks <= 64 * std::max<int64_t>(num_segments, 1);
}

// Backward kernels (ssd_fused_bwd.cpp) from the saved buffers and grad_out (T, H, P). With z and no saved y
// (Saved::y undefined) the backward recomputes y: the bf16 post kernel forms it itself; any other route runs the
// forward kernels for it. With Saved::y_consumable the returned dz may be y's storage (written in place).
Grads backward(const at::Tensor& grad_out, const Args& a, const Tables& t, const Saved& saved);

// (ssd_fused_bwd.cpp) Whether the backward's post kernel will form the pre-gate y itself for these inputs: only in the
// memory mode (settings::ssd_recompute_y(), TREE_RECURRENCE_SSD_RECOMPUTE_Y), with z given, x / B / C / z of one
// 16-bit type, dense, where the backward's plan takes its 16-bit route: then the forward does not store y (one
// (T, H, P) buffer less). Host-side only. A backward that finds y missing on another route (grad_out misaligned, a
// setting changed in between) recomputes it with the forward kernels: correct, slower.
bool forms_y_itself(const Args& a, const Tables& t);

// (ssd_fused_fwd.cpp) The forward's stages for tests: {out, dt, Lam, chunk_states (fp32
// (NC, H, P, N), the transient S_c), states, y (undefined without z)}. `plan` forces parts of the
// forward plan, comma-separated: fused_pass, pipelined, three_kernel (the state path), group_scan,
// head_scan (the chunk scan); empty keeps the plan's own choice; a part these shapes cannot run, or
// an unknown name, is a ValueError.
std::vector<at::Tensor> forward_stages(const Args& a, const Tables& t, std::string_view plan);

// (ssd_fused.cpp) Args / Tables from ssd_tree_scan's arguments (z (1, T, H, P) as its (T, H, P) view;
// initial_state (1, H, P, N) is the shared one), and the test-only op ssd_fused_stages (ssd_tree_scan's
// arguments and `plan`; returns forward_stages; throws naming the reason when fused::supported does not
// hold).
std::pair<Args, Tables> bind(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                             TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                             const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                             const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z);
std::vector<at::Tensor> stages_op(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& B, const at::Tensor& C,
                                  TREE_RECURRENCE_CHUNK_TABLE_PARAMS, const std::optional<at::Tensor>& initial_state,
                                  const at::Tensor& A, at::ArrayRef<double> dt_limit, const std::optional<at::Tensor>& D,
                                  const std::optional<at::Tensor>& dt_bias, bool dt_softplus, const std::optional<at::Tensor>& z,
                                  c10::string_view plan);

}  // namespace tree_recurrence::ssd::fused
