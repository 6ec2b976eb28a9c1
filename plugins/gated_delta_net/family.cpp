// Gated DeltaNet family: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid (see family.yaml).
#include "ops.h"
#include "tree_recurrence/sdk/detecting_family.h"

namespace {

namespace d = tree_recurrence::detectors;

// Recognises (without covering) state-space decays and causal depthwise convs. gdn_tree_scan is a
// composite of ATen ops around the SDK's chunk_state_pass, so it runs wherever that op has a kernel.
class GatedDeltaNetFamily final : public tree_recurrence::DetectingFamily {
 public:
  GatedDeltaNetFamily()
      : DetectingFamily(&tree_recurrence::gdn::register_ops, {d::kStateSpaceDecay, d::kCausalDepthwiseConv},
                        {{"tree_conv", {}}, {"gdn_tree_scan", {"chunk_state_pass"}}}) {}
};

}  // namespace

TREE_RECURRENCE_FAMILY(GatedDeltaNetFamily, "gated_delta_net", "0.1.0")
