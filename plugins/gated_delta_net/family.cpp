// Gated DeltaNet family: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid (see family.yaml).
#include "ops.h"
#include "tree_recurrence/sdk/family.h"

namespace {

class GatedDeltaNetFamily final : public tree_recurrence::TreeFamily {
 public:
  GatedDeltaNetFamily() { tree_recurrence::gdn::register_ops(); }
  std::vector<tree_recurrence::KernelInfo> kernels() const override {
    auto kernels = tree_recurrence::tree_conv_kernels();
    kernels.push_back({"gdn_tree_scan", "cpu", true});
    return kernels;
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(GatedDeltaNetFamily, "gated_delta_net", "0.1.0")
