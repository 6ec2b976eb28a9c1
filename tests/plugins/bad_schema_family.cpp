// A plugin whose op schema is invalid: registration throws inside the family constructor, so the
// registry must report it (and the process must survive), as with the bug where a schema default
// torch cannot parse aborted the whole process while the library loaded.
#include "tree_recurrence/sdk/family.h"
#include "tree_recurrence/sdk/op_library.h"

namespace {

class BadSchemaFamily final : public tree_recurrence::TreeFamily {
 public:
  BadSchemaFamily() { tree_recurrence::op_library(torch::Library::FRAGMENT).def("broken(Tensor x, float y=[0., inf]) -> Tensor"); }
  std::vector<tree_recurrence::KernelInfo> kernels() const override { return {}; }
};

}  // namespace

TREE_RECURRENCE_FAMILY(BadSchemaFamily, "test_bad_schema", "1.0.0")
