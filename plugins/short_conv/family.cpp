// Gated short conv family: LFM2, LFM2-MoE.
#include "ops.h"
#include "tree_recurrence/sdk/family.h"

namespace {

class ShortConvFamily final : public tree_recurrence::TreeFamily {
 public:
  ShortConvFamily() { tree_recurrence::short_conv::register_ops(); }
  std::vector<tree_recurrence::KernelInfo> kernels() const override {
    return tree_recurrence::tree_conv_kernels();
  }
};

}  // namespace

TREE_RECURRENCE_FAMILY(ShortConvFamily, "short_conv", "0.1.0")
