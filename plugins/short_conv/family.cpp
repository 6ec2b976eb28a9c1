// Gated short conv family: LFM2, LFM2-MoE.
#include "ops.h"
#include "tree_recurrence/sdk/detectors.h"
#include "tree_recurrence/sdk/family.h"
#include "tree_recurrence/sdk/kernel_list.h"

namespace {

class ShortConvFamily final : public tree_recurrence::TreeFamily {
 public:
  ShortConvFamily() { tree_recurrence::short_conv::register_ops(); }
  // Covers the manifest's mixers; recognises (without covering) other modules that are causal depthwise
  // convs, so install names this detector when a model holds one nobody covers.
  tree_recurrence::Claim detect(const tree_recurrence::ModuleDescription& module) const override {
    tree_recurrence::Claim claim = TreeFamily::detect(module);
    if (claim.claimed) return claim;
    namespace d = tree_recurrence::detectors;
    return d::recognise(module, manifest().family, {d::kCausalDepthwiseConv});
  }
  std::vector<tree_recurrence::KernelInfo> kernels() const override {
    return tree_recurrence::registered_kernels({{"tree_conv", {}}});
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(ShortConvFamily, "short_conv", "0.1.0")
