#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "forest.h"
#include "tree_recurrence/policy.h"
#include "tree_recurrence/sdk/settings.h"

using namespace tree_recurrence;
using namespace test_forest;

namespace {
std::shared_ptr<TreePlan> fork_plan() {  // prompt of 100 tokens, 3 completions of 10: saves 200, 2 levels
  return TreePlan::build(trl_input(layout({{1, 2, 3}, {}, {}, {}}, {0}, {100, 10, 10, 10})));
}
}  // namespace

TEST_SUITE("Policy") {
  TEST_CASE("auto prefers native then fork when it saves enough else rescan") {
    auto plan = fork_plan();
    Policy p;
    p.fork_min_saved_tokens = 200;
    CHECK(p.choose(*plan, true, true).strategy == Strategy::Native);
    CHECK(p.choose(*plan, false, true).strategy == Strategy::Fork);
    p.fork_min_saved_tokens = 201;
    CHECK(p.choose(*plan, false, true).strategy == Strategy::Rescan);
    CHECK(p.choose(*plan, false, false).strategy == Strategy::Rescan);
    p.prefer_native = false;
    p.fork_min_saved_tokens = 10;
    CHECK(p.choose(*plan, true, true).strategy == Strategy::Fork);
    p.fork_min_saved_tokens = 1000;
    CHECK(p.choose(*plan, true, true).strategy == Strategy::Native);
  }

  TEST_CASE("chains fork for free") {
    auto chains = TreePlan::build(trl_input(layout({{}, {}}, {0, 1}, {5, 6})));
    Policy p;
    p.fork_min_saved_tokens = 1000000;
    CHECK(p.choose(*chains, false, true).strategy == Strategy::Fork);
  }

  TEST_CASE("forced strategies and their errors") {
    auto plan = fork_plan();
    Policy p;
    p.strategy = Strategy::Rescan;
    CHECK(p.choose(*plan, true, true).strategy == Strategy::Rescan);
    p.strategy = Strategy::Fork;
    CHECK_THROWS_WITH_AS(p.choose(*plan, true, false), doctest::Contains("fork was forced"), std::invalid_argument);
    p.strategy = Strategy::Native;
    CHECK_THROWS_WITH_AS(p.choose(*plan, false, true), doctest::Contains("native was forced"), std::invalid_argument);
  }

  TEST_CASE("YAML text and files and errors") {
    Policy p = Policy::from_yaml_text("fork_min_saved_tokens: 64\nstrategy: rescan\nprefer_native: false\n");
    CHECK(p.fork_min_saved_tokens == 64);
    CHECK(p.strategy == Strategy::Rescan);
    CHECK_FALSE(p.prefer_native);
    CHECK_THROWS_WITH_AS(Policy::from_yaml_text("fork_min_saved: 3"), doctest::Contains("unknown policy key 'fork_min_saved'"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Policy::from_yaml_text("fork_min_saved_tokens: -3"), doctest::Contains("non-negative integer"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Policy::from_yaml_text("strategy: sideways"), doctest::Contains("unknown value 'sideways'"),
                         std::invalid_argument);
    CHECK_THROWS_WITH_AS(Policy::from_yaml_text("[1, 2"), doctest::Contains("invalid YAML"), std::invalid_argument);
    CHECK_THROWS_WITH_AS(Policy::from_yaml_file("/nonexistent/policy.yaml"), doctest::Contains("cannot read"), std::invalid_argument);
    const std::string path = (std::filesystem::temp_directory_path() / "tree_recurrence_policy_test.yaml").string();
    std::ofstream(path) << "fork_min_saved_tokens: 7\n";
    CHECK(Policy::from_yaml_file(path).fork_min_saved_tokens == 7);
  }

  TEST_CASE("environment overrides the file and the file overrides defaults") {
    const std::string path = (std::filesystem::temp_directory_path() / "tree_recurrence_policy_env_test.yaml").string();
    std::ofstream(path) << "fork_min_saved_tokens: 11\nstrategy: fork\n";
    setenv("TREE_RECURRENCE_POLICY_FILE", path.c_str(), 1);
    setenv("TREE_RECURRENCE_STRATEGY", "rescan", 1);
    Policy p = Policy::from_environment();
    CHECK(p.fork_min_saved_tokens == 11);
    CHECK(p.strategy == Strategy::Rescan);
    setenv("TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS", "nope", 1);
    CHECK_THROWS_WITH_AS(Policy::from_environment(), doctest::Contains("TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS"), std::invalid_argument);
    unsetenv("TREE_RECURRENCE_FORK_MIN_SAVED_TOKENS");
    setenv("TREE_RECURRENCE_STRATEGY", "sideways", 1);
    CHECK_THROWS_WITH_AS(Policy::from_environment(), doctest::Contains("TREE_RECURRENCE_STRATEGY must be one of auto, native"),
                         std::invalid_argument);
    setenv("TREE_RECURRENCE_STRATEGY", "", 1);  // empty: unset
    setenv("TREE_RECURRENCE_PREFER_NATIVE", "Off", 1);
    CHECK_FALSE(Policy::from_environment().prefer_native);
    setenv("TREE_RECURRENCE_PREFER_NATIVE", "maybe", 1);
    CHECK_THROWS_WITH_AS(Policy::from_environment(), doctest::Contains("TREE_RECURRENCE_PREFER_NATIVE must be 1 or 0"),
                         std::invalid_argument);
    unsetenv("TREE_RECURRENCE_PREFER_NATIVE");
    unsetenv("TREE_RECURRENCE_POLICY_FILE");
    unsetenv("TREE_RECURRENCE_STRATEGY");
    CHECK(Policy::from_environment().strategy == Strategy::Auto);
  }

  TEST_CASE("the defaults are the settings' fallbacks") {
    const Policy p;
    CHECK(p.fork_min_saved_tokens == 1024);
    CHECK(p.strategy == Strategy::Auto);
    CHECK(p.prefer_native);
  }
}

TEST_SUITE("Settings") {
  namespace s = tree_recurrence::settings;

  TEST_CASE("one declaration per variable") {
    CHECK(s::kCount <= 10);
    for (int i = 0; i < s::kCount; ++i) {
      CHECK(std::string(s::kAll[i].name).rfind("TREE_RECURRENCE_", 0) == 0);
      CHECK(s::find(s::kAll[i].name) == &s::kAll[i]);
      CHECK(std::string(s::kAll[i].doc).size() > 10);
    }
    CHECK(s::find("TREE_RECURRENCE_NOT_A_SETTING") == nullptr);
  }

  TEST_CASE("parsers of flags counts choices and lists") {
    for (const char* yes : {"1", "true", "YES", " on "}) CHECK(s::parse_flag("X", yes));
    for (const char* no : {"0", "False", "no", "OFF"}) CHECK_FALSE(s::parse_flag("X", no));
    CHECK_THROWS_WITH_AS(s::parse_flag("TREE_RECURRENCE_FUSED", "2"), doctest::Contains("TREE_RECURRENCE_FUSED must be 1 or 0"),
                         std::invalid_argument);
    CHECK(s::parse_count("X", "0") == 0);
    CHECK(s::parse_count("X", " 42") == 42);
    for (const char* bad : {"-1", "4k", "", "+3", "99999999999999999999"})
      CHECK_THROWS_WITH_AS(s::parse_count("TREE_RECURRENCE_N", bad), doctest::Contains("TREE_RECURRENCE_N must be a non-negative"),
                           std::invalid_argument);
    CHECK(s::parse_choice(s::kAll[s::Strategy], "fork") == "fork");
    CHECK_THROWS_WITH_AS(s::parse_choice(s::kAll[s::Strategy], "Fork"), doctest::Contains("auto, native, fork, rescan"),
                         std::invalid_argument);
    CHECK(s::parse_list(s::kAll[s::PluginPath], "/a b::/c:") == std::vector<std::string>{"/a b", "/c"});
    CHECK(s::parse_list(s::kAll[s::DisableFamilies], " mamba2, ,short_conv:x") ==
          std::vector<std::string>{"mamba2", "short_conv", "x"});
  }

  TEST_CASE("accessors read the environment at each call") {
    unsetenv("TREE_RECURRENCE_FUSED");
    CHECK(s::fused_kernels());
    CHECK_FALSE(s::is_set(s::Fused));
    setenv("TREE_RECURRENCE_FUSED", "0", 1);
    CHECK_FALSE(s::fused_kernels());
    CHECK(s::is_set(s::Fused));
    setenv("TREE_RECURRENCE_FUSED", "", 1);
    CHECK(s::fused_kernels());
    setenv("TREE_RECURRENCE_FUSED", "nope", 1);
    CHECK_THROWS_WITH_AS(s::fused_kernels(), doctest::Contains("TREE_RECURRENCE_FUSED"), std::invalid_argument);
    unsetenv("TREE_RECURRENCE_FUSED");
  }
}
