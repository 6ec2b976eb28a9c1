// Gated DeltaNet family: Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid (see family.yaml). Recognises
// (without covering) state-space decays and causal depthwise convs. gdn_tree_scan is a composite of
// ATen ops around the SDK's chunk_state_pass, so it runs wherever that op has a kernel.
#include "ops.h"
#include "tree_recurrence/sdk/detecting_family.h"

namespace d = tree_recurrence::detectors;
TREE_RECURRENCE_DETECTING_FAMILY(GatedDeltaNetFamily, "gated_delta_net", "0.1.0", &tree_recurrence::gdn::register_ops,
                                 {d::kStateSpaceDecay, d::kCausalDepthwiseConv},
                                 {{"tree_conv", {}}, {"gdn_tree_scan", {"chunk_state_pass"}}})
