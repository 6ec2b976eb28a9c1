// Mamba2 (SSD) family: Mamba2, Nemotron-H, Bamba, Granite-MoE-Hybrid, Falcon-H1, Zamba2.
#include "ops.h"
#include "tree_recurrence/sdk/family.h"

namespace {

class Mamba2Family final : public tree_recurrence::TreeFamily {
 public:
  Mamba2Family() { tree_recurrence::ssd::register_ops(); }
  std::vector<tree_recurrence::KernelInfo> kernels() const override {
#ifdef TREE_RECURRENCE_WITH_CUDA
    const bool cuda = true;
#else
    const bool cuda = false;
#endif
    return {{"tree_conv", "cpu", true}, {"tree_conv", "cuda", cuda}, {"ssd_tree_scan", "cpu", true}};
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(Mamba2Family, "mamba2", "0.1.0")
