// Torch ops of this family (namespace from TREE_RECURRENCE_OP_NAMESPACE): the shared tree conv.
#include <torch/library.h>

#include "tree_recurrence/sdk/tree_conv_op.h"

#define TR_STR2(x) #x
#define TR_STR(x) TR_STR2(x)

TORCH_LIBRARY(TREE_RECURRENCE_OP_NAMESPACE, m) { tree_recurrence::define_tree_conv(m); }
TORCH_LIBRARY_IMPL(TREE_RECURRENCE_OP_NAMESPACE, CPU, m) { tree_recurrence::impl_tree_conv_cpu(m); }
#ifdef TREE_RECURRENCE_WITH_CUDA
TORCH_LIBRARY_IMPL(TREE_RECURRENCE_OP_NAMESPACE, CUDA, m) { tree_recurrence::impl_tree_conv_cuda(m); }
#endif
TORCH_LIBRARY_IMPL(TREE_RECURRENCE_OP_NAMESPACE, Meta, m) { tree_recurrence::impl_tree_conv_meta(m); }
TORCH_LIBRARY_IMPL(TREE_RECURRENCE_OP_NAMESPACE, Autograd, m) {
  tree_recurrence::impl_tree_conv_autograd(m, TR_STR(TREE_RECURRENCE_OP_NAMESPACE) "::tree_conv");
}
