// Kimi Delta Attention family: transformers' kimi_linear and glm5_next (see family.yaml), built out of tree
// against the installed SDK (find_package(TreeRecurrenceSDK)).
//
// The family object is created once, when the registry loads the library, and never destroyed. Its
// constructor registers the torch ops (tree_recurrence_kimi_linear::kda_tree_scan; the tree conv is the
// SDK's shared op, tree_recurrence::tree_conv): an error
// there reaches the factory, which reports it, and the registry refuses this plugin while others load.
#include "ops.h"
#include "tree_recurrence/sdk/family.h"

namespace {

class KimiLinearFamily final : public tree_recurrence::TreeFamily {
 public:
  KimiLinearFamily() { kimi_linear::register_ops(); }

  // The default detect() claims the manifest's mixer classes (KimiLinearDeltaAttention, ...): nothing to add.

  std::vector<tree_recurrence::KernelInfo> kernels() const override {
    // kda_tree_scan is an ATen composite: it runs on CUDA too, one token at a time, so it is advertised for
    // the CPU only (on CUDA the driver forks or rescans over the bound kernel, FLA's chunk_kda).
    auto kernels = tree_recurrence::tree_conv_kernels();
    kernels.push_back({"kda_tree_scan", "cpu", true});
    return kernels;
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(KimiLinearFamily, "kimi_linear", "0.1.0")
