// Times TreePlan construction on one core for a TRL-like forest: 100k tokens, 10k segments.
//
// Forest: 500 prompt groups; each prompt (100 tokens) branches into 19 completions of ~5 tokens
// (GRPO groups), laid out in DFS pre-order. Reports the median of repeated builds for the three
// input formats, and the lazily built extras (path_tokens for rescans, conv ancestors for W=4).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

#include "tree_recurrence/tree_plan.h"

using namespace tree_recurrence;
using Clock = std::chrono::steady_clock;

template <class F>
double median_ms(F&& f, int runs = 31) {
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    const auto start = Clock::now();
    f();
    times.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

int main() {
  std::mt19937 rng(0);
  const Index groups = 500, prompt = 100, completions = 19;
  TreeInput trl, parents_only;
  IndexVector offsets{0}, parents, depths, kv, cu_k{0};
  for (Index g = 0; g < groups; ++g) {
    const Index root = static_cast<Index>(parents.size());
    const Index root_start = offsets.back();
    offsets.push_back(root_start + prompt);
    parents.push_back(-1);
    depths.push_back(0);
    for (Index t = root_start; t < root_start + prompt; ++t) kv.push_back(t);
    cu_k.push_back(static_cast<Index>(kv.size()));
    for (Index c = 0; c < completions; ++c) {
      const Index length = std::uniform_int_distribution<Index>(2, 8)(rng);
      const Index start = offsets.back();
      offsets.push_back(start + length);
      parents.push_back(root);
      depths.push_back(1);
      for (Index t = root_start; t < root_start + prompt; ++t) kv.push_back(t);
      for (Index t = start; t < start + length; ++t) kv.push_back(t);
      cu_k.push_back(static_cast<Index>(kv.size()));
    }
  }
  trl.cu_seqlens_q = parents_only.cu_seqlens_q = offsets;
  trl.kv_index = kv;
  trl.cu_seqlens_k = cu_k;
  parents_only.segment_parents = parents;
  TreeInput both = trl;
  both.segment_parents = parents;
  both.segment_depths = depths;

  auto plan = TreePlan::build(trl);
  std::printf("forest: %lld tokens, %lld segments, %lld samples, %lld levels, %zu key-path entries, %lld path tokens\n",
              static_cast<long long>(plan->num_tokens()), static_cast<long long>(plan->num_segments()),
              static_cast<long long>(plan->num_leaves()), static_cast<long long>(plan->num_levels()), kv.size(),
              static_cast<long long>(plan->path_token_total()));
  std::printf("build, parents format (offsets + parents):        %.3f ms\n",
              median_ms([&] { TreePlan::build(parents_only); }));
  std::printf("build, TRL 1.16 format (validates %zu key entries): %.3f ms\n", kv.size(), median_ms([&] { TreePlan::build(trl); }));
  std::printf("build, TRL + parents + depths (checked):           %.3f ms\n", median_ms([&] { TreePlan::build(both); }));
  std::printf("extra, conv ancestors width 4 (first use):         %.3f ms\n",
              median_ms([&] { TreePlan::build(parents_only)->conv_ancestors(4); }) - median_ms([&] { TreePlan::build(parents_only); }));
  std::printf("extra, path tokens for rescans (first use):        %.3f ms\n",
              median_ms([&] { TreePlan::build(parents_only)->path_tokens(); }) - median_ms([&] { TreePlan::build(parents_only); }));

  // GRPO shape of issue 15: 8 prompts of 2,048 tokens, each with 8 completions of 512, TRL 1.16
  // format. "forward tables" = plan + token tables + conv ancestors and readers (width 4).
  {
    TreeInput grpo;
    IndexVector q{0}, k{0}, key;
    for (Index g = 0; g < 8; ++g) {
      const Index root_start = q.back();
      q.push_back(root_start + 2048);
      for (Index t = root_start; t < root_start + 2048; ++t) key.push_back(t);
      k.push_back(static_cast<Index>(key.size()));
      for (Index c = 0; c < 8; ++c) {
        const Index start = q.back();
        q.push_back(start + 512);
        for (Index t = root_start; t < root_start + 2048; ++t) key.push_back(t);
        for (Index t = start; t < start + 512; ++t) key.push_back(t);
        k.push_back(static_cast<Index>(key.size()));
      }
    }
    grpo.cu_seqlens_q = q;
    grpo.kv_index = key;
    grpo.cu_seqlens_k = k;
    std::printf("GRPO shape: %lld tokens, %lld segments, %zu key-index entries\n", static_cast<long long>(q.back()),
                static_cast<long long>(q.size() - 1), key.size());
    const double plan_ms = median_ms([&] { TreePlan::build(grpo); });
    std::printf("GRPO build, TRL 1.16 format:                       %.3f ms\n", plan_ms);
    const double all_ms = median_ms([&] {
      auto p = TreePlan::build(grpo);
      p->token_position();
      p->conv_ancestors(4);
      p->conv_readers(4);
    });
    std::printf("GRPO tables (token tables + conv 4 fwd/bwd):       %.3f ms\n", all_ms - plan_ms);
    std::printf("GRPO plan + forward tables:                        %.3f ms\n", all_ms);
  }
  return 0;
}
