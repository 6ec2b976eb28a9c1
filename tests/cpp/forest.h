// Random forests for the plan tests: a trie built from parent links, laid out in DFS pre-order,
// with each sample's expected token ids kept independently of the plan.
#pragma once

#include <functional>
#include <random>
#include <vector>

#include "tree_recurrence/tree_plan.h"

namespace test_forest {

using tree_recurrence::Index;
using tree_recurrence::IndexVector;

struct Forest {
  IndexVector offsets{0};   // segment boundaries (DFS pre-order)
  IndexVector parents;      // per segment
  IndexVector depths;       // per segment (levels)
  IndexVector kv_index;     // TRL: root-to-segment paths laid end to end
  IndexVector cu_k{0};
  std::vector<std::vector<Index>> leaf_samples;  // token positions of each root-to-leaf path
};

// `children[s]` lists the children of abstract node s; `roots` the root nodes; `lengths[s]` tokens.
inline Forest layout(const std::vector<std::vector<int>>& children, const std::vector<int>& roots, const std::vector<Index>& lengths) {
  Forest f;
  std::vector<IndexVector> path_of;  // by laid-out segment
  std::function<void(int, Index, Index)> visit = [&](int node, Index parent, Index depth) {
    const Index s = static_cast<Index>(f.parents.size());
    const Index start = f.offsets.back();
    f.offsets.push_back(start + lengths[node]);
    f.parents.push_back(parent);
    f.depths.push_back(depth);
    IndexVector path = parent >= 0 ? path_of[parent] : IndexVector{};
    for (Index t = start; t < start + lengths[node]; ++t) path.push_back(t);
    path_of.push_back(path);
    f.kv_index.insert(f.kv_index.end(), path.begin(), path.end());
    f.cu_k.push_back(static_cast<Index>(f.kv_index.size()));
    if (children[node].empty()) f.leaf_samples.push_back(path);
    for (int c : children[node]) visit(c, s, depth + 1);
  };
  for (int r : roots) visit(r, -1, 0);
  return f;
}

inline Forest random_forest(std::mt19937& rng, int nodes, int max_len, int max_roots) {
  std::vector<std::vector<int>> children(nodes);
  std::vector<int> roots;
  std::vector<Index> lengths(nodes);
  std::uniform_int_distribution<int> length(1, max_len);
  const int num_roots = std::uniform_int_distribution<int>(1, std::min(max_roots, nodes))(rng);
  for (int n = 0; n < nodes; ++n) {
    lengths[n] = length(rng);
    if (n < num_roots) roots.push_back(n);
    else children[std::uniform_int_distribution<int>(0, n - 1)(rng)].push_back(n);
  }
  return layout(children, roots, lengths);
}

inline tree_recurrence::TreeInput trl_input(const Forest& f) {
  tree_recurrence::TreeInput in;
  in.cu_seqlens_q = f.offsets;
  in.kv_index = f.kv_index;
  in.cu_seqlens_k = f.cu_k;
  in.num_tokens = f.offsets.back();
  return in;
}

}  // namespace test_forest
