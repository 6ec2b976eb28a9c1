// DetectingFamily: the TreeFamily most families are, declared by what differs between them.
//
//   TREE_RECURRENCE_DETECTING_FAMILY(MyFamily, "my_family", "0.1.0", &my::register_ops,
//                                    {tree_recurrence::detectors::kCausalDepthwiseConv},
//                                    {{"tree_conv", {}}, {"my_tree_scan", {"chunk_state_pass"}}})
//
// declares the class MyFamily (a DetectingFamily given those arguments) and exports it
// (TREE_RECURRENCE_FAMILY, sdk/family.h); use it once per plugin, at namespace scope.
// Its constructor registers the family's torch ops; detect() covers the manifest's mixers and recognises
// (without covering) other modules the listed detectors match, so install names the detector when a
// model holds one nobody covers (sdk/detectors.h); kernels() is registered_kernels(ops)
// (sdk/kernel_list.h: an op and the ops of its namespace it is a composite of).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "tree_recurrence/sdk/detectors.h"
#include "tree_recurrence/sdk/family.h"
#include "tree_recurrence/sdk/kernel_list.h"

namespace tree_recurrence {

class DetectingFamily : public TreeFamily {
 public:
  using OpList = std::vector<std::pair<std::string, std::vector<std::string>>>;

  DetectingFamily(void (*register_ops)(), std::vector<detectors::Detector> recognised, OpList ops)
      : recognised_(std::move(recognised)), ops_(std::move(ops)) {
    register_ops();
  }

  Claim detect(const ModuleDescription& module) const override {
    Claim claim = TreeFamily::detect(module);
    if (claim.claimed) return claim;
    return detectors::recognise(module, manifest().family, recognised_);
  }

  std::vector<KernelInfo> kernels() const override { return registered_kernels(ops_); }

 private:
  std::vector<detectors::Detector> recognised_;
  OpList ops_;
};

}  // namespace tree_recurrence

#define TREE_RECURRENCE_DETECTING_FAMILY(FamilyClass, family_name, family_version, ...)        \
  namespace {                                                                                   \
  struct FamilyClass final : ::tree_recurrence::DetectingFamily {                               \
    FamilyClass() : ::tree_recurrence::DetectingFamily(__VA_ARGS__) {}                          \
  };                                                                                            \
  }                                                                                             \
  TREE_RECURRENCE_FAMILY(FamilyClass, family_name, family_version)
