// Torch ops of the gated_delta_net family (namespace tree_recurrence_gated_delta_net), registered
// when the family is created (sdk/op_library.h says why).
#include "ops.h"

#include "csrc/gdn_tree_scan.h"
#include "tree_recurrence/sdk/chunk_state_op.h"
#include "tree_recurrence/sdk/tree_conv_op.h"

namespace tree_recurrence::gdn {

void register_ops() {
  register_tree_conv_op();
  register_chunk_state_op();
  op_library(torch::Library::FRAGMENT)
      .def("gdn_tree_scan(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor seg_offsets, Tensor parents, "
           "Tensor? initial_state, float scale, bool use_qk_l2norm) -> Tensor");
  op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd).impl("gdn_tree_scan", &tree_scan);
}

}  // namespace tree_recurrence::gdn
