// Torch ops of the kimi_linear family (namespace tree_recurrence_kimi_linear, set by
// tree_recurrence_add_family), registered when the family is created (tree_recurrence/sdk/op_library.h).
#include "ops.h"

#include "csrc/kda_tree_scan.h"
#include "tree_recurrence/sdk/op_library.h"

namespace kimi_linear {

void register_ops() {
  // The tree conv is the SDK's shared op (torch.ops.tree_recurrence.tree_conv, libtree_recurrence_ops.so): not
  // registered here.
  tree_recurrence::op_library(torch::Library::FRAGMENT)
      .def("kda_tree_scan(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor seg_offsets, Tensor parents, "
           "Tensor? initial_state, float scale, bool use_qk_l2norm) -> Tensor");
  // CompositeImplicitAutograd: written with ATen ops, so autograd derives the backward on every device.
  tree_recurrence::op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd)
      .impl("kda_tree_scan", &tree_scan);
}

}  // namespace kimi_linear
