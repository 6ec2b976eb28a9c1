#include "tree_recurrence/policy.h"

#include <yaml-cpp/yaml.h>

#include <stdexcept>

#include "tree_recurrence/tree_plan.h"

namespace tree_recurrence {

std::string to_string(Strategy strategy) {
  switch (strategy) {
    case Strategy::Auto: return "auto";
    case Strategy::Native: return "native";
    case Strategy::Fork: return "fork";
    case Strategy::Rescan: return "rescan";
  }
  return "?";
}

Strategy strategy_from_string(const std::string& name) {
  for (Strategy s : {Strategy::Auto, Strategy::Native, Strategy::Fork, Strategy::Rescan})
    if (to_string(s) == name) return s;
  throw std::invalid_argument("strategy: unknown value '" + name + "', expected one of auto, native, fork, rescan");
}

namespace {

// A YAML key's value, parsed as the variable of the same setting is (settings.h); errors name the
// file and the key.
std::string where(const std::string& origin, const std::string& key) { return origin + ": " + key; }

Policy apply(const YAML::Node& root, Policy policy, const std::string& origin) {
  if (!root || root.IsNull()) return policy;
  if (!root.IsMap()) throw std::invalid_argument(origin + ": a policy must be a YAML mapping");
  for (const auto& item : root) {
    const std::string key = item.first.as<std::string>();
    if (!item.second.IsScalar()) throw std::invalid_argument(origin + ": " + key + " must be a scalar");
    const std::string value = item.second.as<std::string>();
    if (key == "fork_min_saved_tokens") policy.fork_min_saved_tokens = settings::parse_count(where(origin, key).c_str(), value);
    else if (key == "strategy") policy.strategy = strategy_from_string(value);
    else if (key == "prefer_native") policy.prefer_native = settings::parse_flag(where(origin, key).c_str(), value);
    else
      throw std::invalid_argument(origin + ": unknown policy key '" + key +
                                  "', expected fork_min_saved_tokens, strategy or prefer_native");
  }
  return policy;
}

}  // namespace

Policy Policy::from_yaml_text(const std::string& text, Policy base, const std::string& origin) {
  try {
    return apply(YAML::Load(text), base, origin);
  } catch (const YAML::Exception& e) {
    throw std::invalid_argument(origin + ": invalid YAML: " + e.what());
  }
}

Policy Policy::from_yaml_file(const std::string& path, Policy base) {
  try {
    return apply(YAML::LoadFile(path), base, path);
  } catch (const YAML::BadFile&) {
    throw std::invalid_argument(path + ": cannot read the policy file");
  } catch (const YAML::Exception& e) {
    throw std::invalid_argument(path + ": invalid YAML: " + e.what());
  }
}

Policy Policy::from_yaml_file(const std::string& path) { return from_yaml_file(path, Policy()); }
Policy Policy::from_yaml_text(const std::string& text) { return from_yaml_text(text, Policy()); }
Policy Policy::from_environment() { return from_environment(Policy()); }

Policy Policy::from_environment(Policy base) {
  if (settings::is_set(settings::PolicyFile)) base = from_yaml_file(settings::text(settings::PolicyFile), base);
  return from_environment_variables(base);
}

Policy Policy::from_environment_variables(Policy base) {
  Policy policy = base;
  if (settings::is_set(settings::ForkMinSavedTokens))
    policy.fork_min_saved_tokens = settings::count(settings::ForkMinSavedTokens);
  if (settings::is_set(settings::Strategy)) policy.strategy = strategy_from_string(settings::choice(settings::Strategy));
  if (settings::is_set(settings::PreferNative)) policy.prefer_native = settings::flag(settings::PreferNative);
  return policy;
}

Decision Policy::choose(const TreePlan& plan, bool native_available, bool fork_available) const {
  switch (strategy) {
    case Strategy::Native:
      if (native_available) return {Strategy::Native, "policy forces native"};
      throw std::invalid_argument("strategy: native was forced but this seam has no native tree kernel here");
    case Strategy::Fork:
      if (fork_available) return {Strategy::Fork, "policy forces fork"};
      throw std::invalid_argument("strategy: fork was forced but the bound kernel takes no per-sequence initial states");
    case Strategy::Rescan: return {Strategy::Rescan, "policy forces rescan"};
    case Strategy::Auto: break;
  }
  if (native_available && prefer_native) return {Strategy::Native, "native tree kernel available"};
  const int64_t extra_calls = plan.num_levels() - 1;
  if (fork_available && plan.saved_tokens() >= fork_min_saved_tokens * extra_calls)
    return {Strategy::Fork, "saves " + std::to_string(plan.saved_tokens()) + " tokens for " + std::to_string(extra_calls) +
                                " extra calls (threshold " + std::to_string(fork_min_saved_tokens) + " per call)"};
  if (native_available) return {Strategy::Native, "native tree kernel available; forking saves too little"};
  return {Strategy::Rescan, fork_available ? "forking saves " + std::to_string(plan.saved_tokens()) + " tokens, under " +
                                                 std::to_string(fork_min_saved_tokens * extra_calls) + " for " +
                                                 std::to_string(extra_calls) + " extra calls"
                                           : "bound kernel cannot fork"};
}

}  // namespace tree_recurrence
