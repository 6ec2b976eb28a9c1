// Torch ops of the mamba2 family (namespace tree_recurrence_mamba2): the
// chunked tree SSD scan (ssd_tree_scan, the seam's native op), and for tests only
// (settings::test_ops(), TREE_RECURRENCE_TEST_OPS) its float64 oracle ssd_token_scan and the fused
// kernels' stage ops, registered when the family is created (sdk/op_library.h says why: a bad
// schema must refuse the plugin, not terminate the process while its library loads).
#include "ops.h"

#include "csrc/ssd_chunked.h"
#include "csrc/ssd_fused/ssd_fused.h"
#include "csrc/ssd_fused/ssd_fused_bwd.h"
#include "csrc/ssd_token_oracle.h"
#include "tree_recurrence/sdk/chunk_tables.h"
#include "tree_recurrence/sdk/op_library.h"
#include "tree_recurrence/sdk/settings.h"

namespace tree_recurrence::ssd {

void register_ops() {
  // tree_conv and the inter-chunk state pass ssd_tree_scan calls (chunk_state_pass, a C++ function) are the
  // shared ops library's (torch.ops.tree_recurrence, sdk/shared_ops.h).
  op_library(torch::Library::FRAGMENT)
      .def("ssd_tree_scan(Tensor x, Tensor dt, Tensor B, Tensor C, " TREE_RECURRENCE_CHUNK_TABLE_SCHEMA
           ", Tensor? initial_state, Tensor A, float[] dt_limit, Tensor? D=None, Tensor? dt_bias=None, "
           "bool dt_softplus=False, Tensor? z=None) -> Tensor");
  auto& composite = op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd);
  composite.impl("ssd_tree_scan", &chunked_scan);
  // a bad TREE_RECURRENCE_TEST_OPS value throws here, naming the variable: the plugin is refused with that
  // message (op_library.h), the process goes on
  if (!settings::test_ops()) return;
  // the float64 token-by-token oracle (csrc/ssd_token_oracle.h)
  op_library(torch::Library::FRAGMENT)
      .def("ssd_token_scan(Tensor x, Tensor dt, Tensor B, Tensor C, Tensor seg_offsets, Tensor parents, Tensor? initial_state, "
           "Tensor A, float[] dt_limit, Tensor? D=None, Tensor? dt_bias=None, bool dt_softplus=False, Tensor? z=None) -> Tensor");
  // the fused CUDA forward's stages {out, dt, Lam, chunk_states, states, y} (ssd_fused.h)
  op_library(torch::Library::FRAGMENT)
      .def("ssd_fused_stages(Tensor x, Tensor dt, Tensor B, Tensor C, " TREE_RECURRENCE_CHUNK_TABLE_SCHEMA
           ", Tensor? initial_state, Tensor A, float[] dt_limit, Tensor? D=None, Tensor? dt_bias=None, "
           "bool dt_softplus=False, Tensor? z=None, str plan=\"\") -> Tensor[]");
#ifdef TREE_RECURRENCE_WITH_CUDA
  op_library(torch::Library::IMPL, c10::DispatchKey::CUDA).impl("ssd_fused_stages", &fused::stages_op);
#endif
  fused::register_backward_stages_op();  // the fused backward's stages (ssd_fused_bwd.h)
  op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd).impl("ssd_token_scan", &token_oracle);
}

}  // namespace tree_recurrence::ssd
