// Torch ops of the gated_delta_net family (namespace tree_recurrence_gated_delta_net), registered
// when the family is created (sdk/op_library.h says why). The tree conv and the state pass it runs on are the
// shared ops library's (torch.ops.tree_recurrence.*, sdk/shared_ops.h), not registered here.
#include "ops.h"

#include "csrc/gdn_chunked.h"
#include "csrc/gdn_fused/gdn_fused.h"
#include "csrc/gdn_fused/gdn_fused_bwd.h"
#include "csrc/gdn_token_oracle.h"
#include "tree_recurrence/sdk/chunk_tables.h"
#include "tree_recurrence/sdk/op_library.h"
#include "tree_recurrence/sdk/test_ops.h"

namespace tree_recurrence::gdn {

void register_ops() {
  // tree_conv and chunk_state_pass are the shared ops library's (torch.ops.tree_recurrence, sdk/shared_ops.h).
  // The seam's native op: chunked, over the plan's device chunk tables (csrc/gdn_chunked.h).
  op_library(torch::Library::FRAGMENT)
      .def("gdn_tree_scan(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, " TREE_RECURRENCE_CHUNK_TABLE_SCHEMA
           ", Tensor? initial_state, float scale, bool use_qk_l2norm) -> Tensor");
  auto& composite = op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd);
  composite.impl("gdn_tree_scan", &chunked_scan);
  if (!test_ops_enabled()) return;  // the test-only ops below: TREE_RECURRENCE_TEST_OPS=1 (sdk/test_ops.h)
  // Its float64 token-by-token oracle over the plan's host arrays (csrc/gdn_token_oracle.h).
  op_library(torch::Library::FRAGMENT)
      .def("gdn_token_scan(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor seg_offsets, Tensor parents, "
           "Tensor? initial_state, float scale, bool use_qk_l2norm) -> Tensor");
  // The fused CUDA forward's stages (csrc/gdn_fused/gdn_fused.h: fused::stages).
  op_library(torch::Library::FRAGMENT)
      .def("gdn_fused_stages(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, " TREE_RECURRENCE_CHUNK_TABLE_SCHEMA
           ", Tensor? initial_state, float scale, bool use_qk_l2norm) -> Tensor[]");
  // The fused CUDA backward's stages from given saved buffers (csrc/gdn_fused/gdn_fused_bwd.h).
  fused::register_backward_stages_op();
  auto& test_composite = op_library(torch::Library::IMPL, c10::DispatchKey::CompositeImplicitAutograd);
  test_composite.impl("gdn_token_scan", &token_oracle);
  test_composite.impl("gdn_fused_stages", &fused::stages);
}

}  // namespace tree_recurrence::gdn
