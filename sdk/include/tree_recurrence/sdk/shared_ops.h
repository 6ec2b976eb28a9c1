// The shared ops library, libtree_recurrence_ops.so (built from sdk/ops/, installed with the package under
// tree_recurrence/sdk/lib/, exported by the installed SDK as TreeRecurrence::ops): the torch ops several families
// share, registered ONCE in the namespace `tree_recurrence` (torch.ops.tree_recurrence.<op>) with their CPU,
// CUDA, Meta and Autograd kernels:
//
//   tree_conv, tree_conv_backward                    (tree_conv_op.h)
//   chunk_state_pass, chunk_state_pass_backward      (chunk_state_op.h)
//
// The Python package loads it before any plugin (tree_recurrence/_shared_ops.py); a plugin links it
// (tree_recurrence_add_family does) and calls the C++ functions those headers declare, never the ops by a
// string of its own namespace. A family's kernels() list names the shared ops as ops of its own (kernel_list.h
// finds them here). This header is torch-free.
#pragma once

#if defined(_WIN32)
#define TREE_RECURRENCE_OPS_API
#else
#define TREE_RECURRENCE_OPS_API __attribute__((visibility("default")))
#endif

// The namespace of the shared ops, and "tree_recurrence::<op>" for a literal op name.
#define TREE_RECURRENCE_SHARED_OP_NAMESPACE "tree_recurrence"
#define TREE_RECURRENCE_SHARED_OP(op) TREE_RECURRENCE_SHARED_OP_NAMESPACE "::" op
