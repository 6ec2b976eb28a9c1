// Gated short conv family: LFM2, LFM2-MoE.
#include "ops.h"
#include "tree_recurrence/sdk/detecting_family.h"

namespace {

// Recognises (without covering) other causal depthwise convs.
class ShortConvFamily final : public tree_recurrence::DetectingFamily {
 public:
  ShortConvFamily()
      : DetectingFamily(&tree_recurrence::short_conv::register_ops, {tree_recurrence::detectors::kCausalDepthwiseConv},
                        {{"tree_conv", {}}}) {}
};

}  // namespace

TREE_RECURRENCE_FAMILY(ShortConvFamily, "short_conv", "0.1.0")
