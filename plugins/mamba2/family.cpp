// Mamba2 (SSD) family: Mamba2, Nemotron-H, Bamba, Granite-MoE-Hybrid, Falcon-H1, Zamba2. Recognises
// (without covering) state-space decays and causal depthwise convs. ssd_tree_scan is a composite of
// ATen ops around the SDK's chunk_state_pass, so it runs wherever that op has a kernel.
#include "ops.h"
#include "tree_recurrence/sdk/detecting_family.h"

namespace d = tree_recurrence::detectors;
TREE_RECURRENCE_DETECTING_FAMILY(Mamba2Family, "mamba2", "0.1.0", &tree_recurrence::ssd::register_ops,
                                 {d::kStateSpaceDecay, d::kCausalDepthwiseConv},
                                 {{"tree_conv", {}}, {"ssd_tree_scan", {"chunk_state_pass"}}})
