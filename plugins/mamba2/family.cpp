// Mamba2 (SSD) family: Mamba2, Nemotron-H, Bamba, Granite-MoE-Hybrid, Falcon-H1, Zamba2.
#include "ops.h"
#include "tree_recurrence/sdk/family.h"

namespace {

class Mamba2Family final : public tree_recurrence::TreeFamily {
 public:
  Mamba2Family() { tree_recurrence::ssd::register_ops(); }
  std::vector<tree_recurrence::KernelInfo> kernels() const override {
    auto kernels = tree_recurrence::tree_conv_kernels();
    kernels.push_back({"ssd_tree_scan", "cpu", true});
    return kernels;
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(Mamba2Family, "mamba2", "0.1.0")
