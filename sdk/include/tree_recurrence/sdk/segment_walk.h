// The trie walk shared by native recurrent scans: segments in order (a parent comes before its
// children), each starting from its parent's final state; a root starts from `initial_state`
// (one state for every root, or one per root in root order) or from zeros.
//
//   walk_segments(op, seg_offsets, parents, initial_state, state_shape, options,
//                 [&](at::Tensor state, int64_t token) { ...; return new_state; });
//
// `step` gets the running state and a token index and returns the state after that token (it
// writes its own outputs). seg_offsets (S+1) and parents (S) are the plan's host int64 arrays.
// Errors name `op` and what was expected.
#pragma once

#include <ATen/core/Tensor.h>
#include "tree_recurrence/sdk/check.h"
#include <ATen/ops/zeros.h>

#include <optional>
#include <vector>

namespace tree_recurrence {

// The token tables of a token-by-token scan over `tokens` tokens: seg_offsets (S+1, from 0 to `tokens`)
// and parents (S), the plan's host int64 arrays (segment order and parents: walk_segments checks them).
inline void check_token_tables(const char* op, const at::Tensor& seg_offsets, const at::Tensor& parents, int64_t tokens) {
  TR_CHECK_VALUE(seg_offsets.is_cpu() && parents.is_cpu() && seg_offsets.scalar_type() == at::kLong &&
                     parents.scalar_type() == at::kLong && seg_offsets.is_contiguous() && parents.is_contiguous(),
                 op, ": seg_offsets and parents must be contiguous int64 CPU tensors (the plan's host arrays)");
  TR_CHECK_VALUE(seg_offsets.dim() == 1 && parents.dim() == 1 && seg_offsets.numel() == parents.numel() + 1, op,
                 ": seg_offsets must have one more entry than parents");
  TR_CHECK_VALUE(seg_offsets.numel() >= 2 && seg_offsets.data_ptr<int64_t>()[0] == 0 &&
                     seg_offsets.data_ptr<int64_t>()[seg_offsets.numel() - 1] == tokens,
                 op, ": seg_offsets must end at the number of tokens ", tokens, " (starting from 0)");
}

template <class Step>
void walk_segments(const char* op, const at::Tensor& seg_offsets, const at::Tensor& parents,
                   const std::optional<at::Tensor>& initial_state, at::IntArrayRef state_shape,
                   const at::TensorOptions& options, Step&& step) {
  TR_CHECK_VALUE(seg_offsets.is_cpu() && parents.is_cpu() && seg_offsets.scalar_type() == at::kLong &&
                        parents.scalar_type() == at::kLong && seg_offsets.numel() == parents.numel() + 1 &&
                        seg_offsets.is_contiguous() && parents.is_contiguous(),
                    op, ": seg_offsets (S+1) and parents (S) must be contiguous int64 CPU tensors (the plan's host arrays)");
  const int64_t S = parents.numel();
  const int64_t* offsets = seg_offsets.data_ptr<int64_t>();
  const int64_t* parent = parents.data_ptr<int64_t>();
  int64_t roots = 0;
  for (int64_t s = 0; s < S; ++s) {
    TR_CHECK_VALUE(offsets[s] <= offsets[s + 1], op, ": seg_offsets decrease at segment ", s);
    TR_CHECK_VALUE(parent[s] >= -1 && parent[s] < s, op, ": segment ", s, " has parent ", parent[s],
                      ", expected -1 or an earlier segment");
    roots += parent[s] < 0;
  }
  if (initial_state) {
    const at::Tensor& h0 = *initial_state;
    const bool shared = h0.sizes() == state_shape;
    const bool per_root = h0.dim() == static_cast<int64_t>(state_shape.size()) + 1 && h0.size(0) == roots &&
                          h0.sizes().slice(1) == state_shape;
    TR_CHECK_VALUE(shared || per_root, op, ": initial_state must be ", state_shape, " or (roots=", roots, ", ",
                      state_shape, "), got ", h0.sizes());
  }
  std::vector<at::Tensor> final_state(S);
  int64_t root = 0;
  for (int64_t s = 0; s < S; ++s) {
    at::Tensor state;
    if (parent[s] >= 0) {
      state = final_state[parent[s]];
    } else {
      if (!initial_state) state = at::zeros(state_shape, options);
      else if (initial_state->sizes() == state_shape) state = initial_state->to(options.dtype());
      else state = (*initial_state)[root].to(options.dtype());
      ++root;
    }
    for (int64_t t = offsets[s]; t < offsets[s + 1]; ++t) state = step(std::move(state), t);
    final_state[s] = state;
  }
}

}  // namespace tree_recurrence
