// Gated short conv family: LFM2, LFM2-MoE. Recognises (without covering) other causal depthwise convs.
#include "ops.h"
#include "tree_recurrence/sdk/detecting_family.h"

TREE_RECURRENCE_DETECTING_FAMILY(ShortConvFamily, "short_conv", "0.1.0", &tree_recurrence::short_conv::register_ops,
                                 {tree_recurrence::detectors::kCausalDepthwiseConv}, {{"tree_conv", {}}})
