// The shared ops library's one definition block: the namespace `tree_recurrence` belongs to this library (a
// second TORCH_LIBRARY(tree_recurrence) anywhere fails loudly). The schemas are fixed and tested, so defining
// them in a static initializer, when the library loads, cannot refuse a family (plugins define theirs from
// their constructor instead, sdk/op_library.h). Kernels: chunk_state_op.cpp, tree_conv_op.cpp.
#include "shared_ops_internal.h"

TORCH_LIBRARY(tree_recurrence, m) {
  tree_recurrence::define_tree_conv_ops(m);
  tree_recurrence::define_chunk_state_ops(m);
}
