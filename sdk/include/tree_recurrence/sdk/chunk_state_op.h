// The chunked tree state pass as a torch op, shared by the chunked recurrent families (Gated
// DeltaNet, Mamba2 SSD). Math, schedule and speed: tree_recurrence/kernels/chunk_state_pass.h and
// docs/architecture.md ("Chunked tree state pass").
//
// Defined ONCE, for every family, by the shared ops library libtree_recurrence_ops.so (sdk/ops/, loaded by the
// Python package before any plugin; plugins link it: TreeRecurrence::ops), in the namespace tree_recurrence.
// Schema (torch.ops.tree_recurrence.chunk_state_pass):
//   chunk_state_pass(Tensor? w, Tensor u, Tensor kd, Tensor decay, Tensor? initial_state,
//                    Tensor seg_chunk_offsets, Tensor parents, Tensor root_index, Tensor level_segments,
//                    int[] level_offsets, Tensor child_offsets, Tensor children) -> (Tensor h, Tensor v_new)
//   w (NC, H, C, K) or None; u (NC, H, C, V); kd (NC, H, C, K): one dtype among float32, float64,
//   bfloat16, float16. decay (NC, H) float32 or float64. C <= 64. initial_state None, (H, K, V)
//   shared by every root or (R, H, K, V) one per root (R = roots = level 0). Index tables int64 on
//   the inputs' device (TreePlan.chunk_tables(C, device).state_args() in Python); level_offsets is
//   a host int list. Returns h (NC, H, K, V) float32 (float64 for float64 inputs), the state
//   entering each chunk, and v_new (NC, H, C, V) in u's dtype.
//   chunk_state_pass_backward(Tensor? grad_h, Tensor? grad_v_new, Tensor? w, Tensor kd, Tensor decay,
//                    Tensor h, Tensor v_new, Tensor? initial_state, <the same 7 tables>)
//       -> (Tensor grad_w, Tensor grad_u, Tensor grad_kd, Tensor grad_decay, Tensor grad_initial_state)
//   is the backward as its own op (CPU, CUDA, Meta); grad_w / grad_initial_state are empty (0,)
//   tensors when w / initial_state is None.
//
// From C++ (a family's composite code), with autograd, a C++ function of the shared library:
//   auto [h, v_new] = tree_recurrence::chunk_state_pass(w, u, kd, decay, initial_state,
//       seg_chunk_offsets, parents, root_index, level_segments, level_offsets, child_offsets, children);
// or with the plan's tables as the one structure a chunked op holds them in (sdk/chunk_tables.h):
//   auto [h, v_new] = tree_recurrence::chunk_state_pass(w, u, kd, decay, initial_state, tables);
// (the state pass reads 7 of its 9 tables; gather / scatter are the caller's).
//
// CPU validates every table (readable errors); CUDA checks shapes, dtypes and devices only (the
// tables' contents stay on the device: no host sync). The tables come from the plan.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "tree_recurrence/sdk/check.h"
#include "tree_recurrence/sdk/chunk_tables.h"
#include "tree_recurrence/sdk/shared_ops.h"

namespace tree_recurrence {

// The op tree_recurrence::chunk_state_pass, with autograd (defined in libtree_recurrence_ops.so).
TREE_RECURRENCE_OPS_API std::tuple<at::Tensor, at::Tensor> chunk_state_pass(
    const std::optional<at::Tensor>& w, const at::Tensor& u, const at::Tensor& kd, const at::Tensor& decay,
    const std::optional<at::Tensor>& initial_state, const at::Tensor& seg_chunk_offsets, const at::Tensor& parents,
    const at::Tensor& root_index, const at::Tensor& level_segments, at::IntArrayRef level_offsets,
    const at::Tensor& child_offsets, const at::Tensor& children);

// The same over the plan's tables held as one structure (ChunkTableSet, sdk/chunk_tables.h).
inline std::tuple<at::Tensor, at::Tensor> chunk_state_pass(const std::optional<at::Tensor>& w, const at::Tensor& u,
                                                           const at::Tensor& kd, const at::Tensor& decay,
                                                           const std::optional<at::Tensor>& initial_state,
                                                           const ChunkTableSet& t) {
  return chunk_state_pass(w, u, kd, decay, initial_state, t.seg_chunk_offsets, t.parents, t.root_index, t.level_segments,
                          t.level_offsets, t.child_offsets, t.children);
}

// A chunked op's initial state as chunk_state_pass takes it: `initial_state` of (H, A, B) = `dims`, shared
// by every root, or (roots, H, A, B), one per root (a leading batch of 1 dropped); on `device`, widened to
// `type`; none without one. `names` name the dims and `input` the tensor on `device` in the messages.
inline std::optional<at::Tensor> chunked_initial_state(const char* op, const std::optional<at::Tensor>& initial_state,
                                                       const int64_t (&dims)[3], const char* const (&names)[3],
                                                       const char* input, const c10::Device& device, at::ScalarType type) {
  if (!initial_state) return std::nullopt;
  at::Tensor s = *initial_state;
  if (s.dim() == 4 && s.size(0) == 1) s = s[0];
  TR_CHECK_VALUE((s.dim() == 3 || s.dim() == 4) && s.size(-3) == dims[0] && s.size(-2) == dims[1] && s.size(-1) == dims[2],
                 op, ": initial_state must be (", names[0], "=", dims[0], ", ", names[1], "=", dims[1], ", ", names[2], "=",
                 dims[2], ") or (roots, ", dims[0], ", ", dims[1], ", ", dims[2], "), got ", initial_state->sizes());
  TR_CHECK_VALUE(s.device() == device, op, ": initial_state is on ", s.device(), " but ", input, " is on ", device);
  return s.to(type);
}

}  // namespace tree_recurrence
