// Detectors a family ships: they recognise modules that mix tokens like the family's layers, over the
// module descriptions `install` hands every family (path, class, model type, direct parameters, conv
// geometry; no torch object).
//
// A family's TreeFamily::detect answers one of three things for a module:
//   covered     Claim{true, "mixer", why}: the family follows the tree inside this mixer;
//   recognised  Claim{false, "recurrent", why}: a recurrent token mixer this family can tell, but
//               does not cover (install then answers "none" and names the detector and the family);
//   unknown     Claim{}: nothing to say.
// `recognise(module, family, {detectors...})` runs the listed detectors in order and words the answer.
#pragma once

#include <string>
#include <vector>

#include "tree_recurrence/sdk/family.h"

namespace tree_recurrence::detectors {

// A detector: the name shown to users, and a test returning why the module matches ("" when not).
struct Detector {
  const char* name;
  std::string (*why)(const ModuleDescription& module);
};

// A state-space decay parameter `A_log` (Mamba2, Gated DeltaNet, KDA gates, ...).
inline std::string state_space_decay(const ModuleDescription& module) {
  for (const auto& param : module.params)
    if (param.name == "A_log") return "has a state-space decay (A_log)";
  return "";
}

// An nn.Conv1d that is depthwise (groups == in == out channels), wider than 1 and padded by width - 1
// on the left, which is what makes it causal once the right end is cut (short convs before a scan).
inline std::string causal_depthwise_conv(const ModuleDescription& module) {
  const ConvDescription& c = module.conv;
  if (c.present && c.groups == c.in_channels && c.groups == c.out_channels && c.kernel_size > 1 &&
      c.padding == c.kernel_size - 1)
    return "is a causal depthwise conv (width " + std::to_string(c.kernel_size) + ")";
  return "";
}

inline constexpr Detector kStateSpaceDecay{"state_space_decay", &state_space_decay};
inline constexpr Detector kCausalDepthwiseConv{"causal_depthwise_conv", &causal_depthwise_conv};

// The first matching detector's answer, as a "recognised, not covered" claim naming it and `family`.
inline Claim recognise(const ModuleDescription& module, const std::string& family,
                       const std::vector<Detector>& detectors) {
  for (const Detector& d : detectors) {
    std::string why = d.why(module);
    if (!why.empty()) return {false, "recurrent", why + " [detector " + d.name + " of family " + family + "]"};
  }
  return {};
}

}  // namespace tree_recurrence::detectors
