// Gated DeltaNet family: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid (see family.yaml).
#include "ops.h"
#include "tree_recurrence/sdk/detectors.h"
#include "tree_recurrence/sdk/family.h"
#include "tree_recurrence/sdk/kernel_list.h"

namespace {

class GatedDeltaNetFamily final : public tree_recurrence::TreeFamily {
 public:
  GatedDeltaNetFamily() { tree_recurrence::gdn::register_ops(); }
  // Covers the manifest's mixers; recognises (without covering) other modules with a state-space decay
  // or a causal depthwise conv, so install names this detector when a model holds one nobody covers.
  tree_recurrence::Claim detect(const tree_recurrence::ModuleDescription& module) const override {
    tree_recurrence::Claim claim = TreeFamily::detect(module);
    if (claim.claimed) return claim;
    namespace d = tree_recurrence::detectors;
    return d::recognise(module, manifest().family, {d::kStateSpaceDecay, d::kCausalDepthwiseConv});
  }
  // From what register_ops() registered: gdn_tree_scan is a composite of ATen ops around the SDK's
  // chunk_state_pass, so it runs wherever that op has a kernel.
  std::vector<tree_recurrence::KernelInfo> kernels() const override {
    return tree_recurrence::registered_kernels({{"tree_conv", {}}, {"gdn_tree_scan", {"chunk_state_pass"}}});
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(GatedDeltaNetFamily, "gated_delta_net", "0.1.0")
