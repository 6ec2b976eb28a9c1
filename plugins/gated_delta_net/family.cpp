// Gated DeltaNet family: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid (see family.yaml).
#include "ops.h"
#include "tree_recurrence/sdk/family.h"

namespace {

class GatedDeltaNetFamily final : public tree_recurrence::TreeFamily {
 public:
  GatedDeltaNetFamily() { tree_recurrence::gdn::register_ops(); }
  std::vector<tree_recurrence::KernelInfo> kernels() const override {
#ifdef TREE_RECURRENCE_WITH_CUDA
    const bool cuda = true;
#else
    const bool cuda = false;
#endif
    return {{"tree_conv", "cpu", true}, {"tree_conv", "cuda", cuda}, {"gdn_tree_scan", "cpu", true}};
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(GatedDeltaNetFamily, "gated_delta_net", "0.1.0")
