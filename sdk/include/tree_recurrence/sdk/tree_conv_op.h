// The tree conv as a torch op, for any family that has a causal depthwise conv seam.
//
// Defined ONCE, for every family, by the shared ops library libtree_recurrence_ops.so (sdk/shared_ops.h), in the
// namespace tree_recurrence, with its CPU, CUDA, Meta and Autograd kernels. Schema (torch.ops.tree_recurrence.tree_conv):
//   tree_conv(Tensor x, Tensor weight, Tensor? bias, Tensor ancestors, Tensor reader_offsets,
//             Tensor readers, bool silu) -> Tensor
//   x (N, C) token-major; weight (C, W); bias (C) or None; ancestors (N, W-1) int64 from the
//   plan; reader_offsets/readers: the plan's reverse table (used by the CUDA backward).
//   Returns y (N, C) in x's dtype, computed in fp32 with SiLU applied before the single rounding.
//   tree_conv_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor? bias, Tensor ancestors,
//             Tensor reader_offsets, Tensor readers, bool silu) -> (grad_x, grad_weight, grad_bias)
//   is the backward as its own op (CPU, CUDA, Meta; grad_bias zeros without a bias).
//
// From C++, with autograd: tree_recurrence::tree_conv(x, weight, bias, ancestors, reader_offsets, readers, silu).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "tree_recurrence/sdk/shared_ops.h"

namespace tree_recurrence {

// The op tree_recurrence::tree_conv, with autograd (defined in libtree_recurrence_ops.so).
TREE_RECURRENCE_OPS_API at::Tensor tree_conv(const at::Tensor& x, const at::Tensor& weight,
                                             const std::optional<at::Tensor>& bias, const at::Tensor& ancestors,
                                             const at::Tensor& reader_offsets, const at::Tensor& readers, bool silu);

}  // namespace tree_recurrence
