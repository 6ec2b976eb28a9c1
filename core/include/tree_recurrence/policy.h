// Policy: how the driver runs a recurrent scan over a trie.
//
// Strategies:
//   native  - the family's own tree kernel (every segment starts from its parent's final state);
//   fork    - the model's bound kernel, one varlen call per trie level, initial states taken from
//             the parents' final states (needs per-sequence initial states);
//   rescan  - the model's bound kernel, one call over every root-to-leaf path, each segment's
//             outputs taken from one path through it.
// With strategy "auto" the policy prefers native (when available and prefer_native), else forks
// when the prefix tokens forking saves outweigh one more kernel call per extra level:
//   saved_tokens >= fork_min_saved_tokens * (num_levels - 1),
// else rescans. Precedence of settings, lowest first: defaults < YAML file < environment <
// explicit values (see docs/policy.md).
#pragma once

#include <cstdint>
#include <string>

#include "tree_recurrence/sdk/settings.h"

namespace tree_recurrence {

class TreePlan;

enum class Strategy { Auto, Native, Fork, Rescan };

std::string to_string(Strategy strategy);
Strategy strategy_from_string(const std::string& name);  // throws std::invalid_argument

struct Decision {
  Strategy strategy;
  std::string reason;
};

struct Policy {
  // The defaults are the settings' fallbacks (sdk/settings.h).
  int64_t fork_min_saved_tokens = settings::parse_count("fork_min_saved_tokens",
                                                        settings::kAll[settings::ForkMinSavedTokens].fallback);
  Strategy strategy = strategy_from_string(settings::kAll[settings::Strategy].fallback);
  bool prefer_native = settings::parse_flag("prefer_native", settings::kAll[settings::PreferNative].fallback);

  // Reads keys fork_min_saved_tokens, strategy, prefer_native from a YAML mapping (file or text);
  // unknown keys and bad values throw std::invalid_argument naming the key.
  static Policy from_yaml_file(const std::string& path, Policy base);
  static Policy from_yaml_file(const std::string& path);
  static Policy from_yaml_text(const std::string& text, Policy base, const std::string& origin = "<string>");
  static Policy from_yaml_text(const std::string& text);
  // TREE_RECURRENCE_POLICY_FILE (a YAML file), then TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS,
  // TREE_RECURRENCE_STRATEGY, TREE_RECURRENCE_PREFER_NATIVE, each where set (settings.h; a bad
  // value throws std::invalid_argument naming the variable).
  static Policy from_environment(Policy base);
  static Policy from_environment();
  // Only the TREE_RECURRENCE_* variables, not the policy file.
  static Policy from_environment_variables(Policy base);

  Decision choose(const TreePlan& plan, bool native_available, bool fork_available) const;
};

}  // namespace tree_recurrence
