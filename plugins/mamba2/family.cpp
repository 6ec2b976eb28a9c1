// Mamba2 (SSD) family: Mamba2, Nemotron-H, Bamba, Granite-MoE-Hybrid, Falcon-H1, Zamba2.
#include "tree_recurrence/sdk/family.h"

namespace {

class Mamba2Family final : public tree_recurrence::TreeFamily {
 public:
  std::vector<tree_recurrence::KernelInfo> kernels() const override {
#ifdef TREE_RECURRENCE_WITH_CUDA
    const bool cuda = true;
#else
    const bool cuda = false;
#endif
    return {{"tree_conv", "cpu", true}, {"tree_conv", "cuda", cuda}};
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(Mamba2Family, "mamba2", "0.1.0")
