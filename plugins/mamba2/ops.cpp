// Torch ops of the mamba2 family (namespace tree_recurrence_mamba2): the shared tree conv and the
// native tree SSD scan, registered when the family is created (sdk/op_library.h says why: a bad
// schema must refuse the plugin, not terminate the process while its library loads).
#include "ops.h"

#include "ssd_tree_scan.h"
#include "tree_recurrence/sdk/tree_conv_op.h"

namespace tree_recurrence::ssd {

void register_ops() {
  register_tree_conv_op();
  op_library(torch::Library::FRAGMENT)
      .def("ssd_tree_scan(Tensor x, Tensor dt, Tensor B, Tensor C, Tensor seg_offsets, Tensor parents, Tensor? initial_state, "
           "Tensor A, float[] dt_limit, Tensor? D=None, Tensor? dt_bias=None, bool dt_softplus=False, Tensor? z=None) -> Tensor");
  op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd).impl("ssd_tree_scan", &tree_scan);
}

}  // namespace tree_recurrence::ssd
