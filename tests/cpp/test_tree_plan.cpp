#include <doctest/doctest.h>

#include <algorithm>
#include <random>

#include "forest.h"
#include "tree_recurrence/tree_plan.h"

using namespace tree_recurrence;
using namespace test_forest;

namespace {

std::vector<IndexVector> plan_paths(const TreePlan& plan) {
  std::vector<IndexVector> out;
  for (Index p = 0; p < plan.num_leaves(); ++p)
    out.emplace_back(plan.path_tokens().begin() + plan.path_offsets()[p], plan.path_tokens().begin() + plan.path_offsets()[p + 1]);
  return out;
}

// Checks a plan against the forest it came from, through independent expectations only.
void check_plan(const TreePlan& plan, const Forest& f) {
  REQUIRE(plan_paths(plan) == f.leaf_samples);
  CHECK(plan.parents() == f.parents);
  CHECK(plan.levels() == f.depths);
  Index total = 0;
  for (const auto& s : f.leaf_samples) total += static_cast<Index>(s.size());
  CHECK(plan.path_token_total() == total);
  CHECK(plan.saved_tokens() == total - f.offsets.back());
  // Every token takes its outputs from a path position that holds that very token.
  for (Index t = 0; t < plan.num_tokens(); ++t) CHECK(plan.path_tokens()[plan.token_source()[t]] == t);
  // Conv ancestors: the j-th predecessor of a token is the token j steps back in any path through it.
  for (Index width : {1, 2, 4, 7}) {
    const IndexVector& anc = plan.conv_ancestors(width);
    for (const auto& sample : f.leaf_samples)
      for (size_t p = 0; p < sample.size(); ++p)
        for (Index j = 1; j < width; ++j) {
          const Index expected = static_cast<Index>(p) - j >= 0 ? sample[p - j] : -1;
          CHECK(anc[sample[p] * (width - 1) + j - 1] == expected);
        }
  }
  // The reader table is exactly the reverse of the ancestor table.
  for (Index width : {2, 4}) {
    const IndexVector& anc = plan.conv_ancestors(width);
    const IndexVector& off = plan.conv_reader_offsets(width);
    const IndexVector& readers = plan.conv_readers(width);
    REQUIRE(static_cast<Index>(off.size()) == plan.num_tokens() + 1);
    Index listed = 0;
    for (Index u = 0; u < plan.num_tokens(); ++u)
      for (Index i = off[u]; i < off[u + 1]; ++i, ++listed) {
        CHECK(anc[readers[i]] == u);
        if (i > off[u]) CHECK(readers[i] > readers[i - 1]);
      }
    CHECK(listed == static_cast<Index>(std::count_if(anc.begin(), anc.end(), [](Index a) { return a >= 0; })));
  }
  // Token position is the depth in the sample.
  for (const auto& sample : f.leaf_samples)
    for (size_t p = 0; p < sample.size(); ++p) CHECK(plan.token_position()[sample[p]] == static_cast<Index>(p));
  // Levels CSR lists each segment once, grouped by level.
  IndexVector seen(plan.num_segments(), 0);
  for (Index l = 0; l < plan.num_levels(); ++l)
    for (Index i = plan.level_offsets()[l]; i < plan.level_offsets()[l + 1]; ++i) {
      CHECK(plan.levels()[plan.level_segments()[i]] == l);
      ++seen[plan.level_segments()[i]];
    }
  for (Index c : seen) CHECK(c == 1);
  // Chunk tables: every token sits in a chunk of its own segment, chunks of a segment in token order,
  // each chunk full but the segment's last; the grid's padding is -1; scatter is gather's inverse.
  for (Index chunk : {1, 2, 3, 4, 64}) {
    const ChunkTables t = plan.chunk_tables(chunk);
    REQUIRE(static_cast<Index>(t.seg_chunk_offsets.size()) == plan.num_segments() + 1);
    REQUIRE(static_cast<Index>(t.gather.size()) == t.num_chunks * chunk);
    REQUIRE(static_cast<Index>(t.scatter.size()) == plan.num_tokens());
    Index token = 0;
    for (Index s = 0; s < plan.num_segments(); ++s) {
      const Index length = plan.seg_lengths()[s];
      CHECK(t.seg_chunk_offsets[s + 1] - t.seg_chunk_offsets[s] == (length + chunk - 1) / chunk);
      for (Index c = t.seg_chunk_offsets[s]; c < t.seg_chunk_offsets[s + 1]; ++c)
        for (Index i = 0; i < chunk; ++i) {
          const Index entry = t.gather[c * chunk + i];
          if (token < plan.seg_offsets()[s + 1]) {
            CHECK(entry == token);
            CHECK(t.scatter[token] == c * chunk + i);
            ++token;
          } else {
            CHECK(entry == -1);
          }
        }
    }
    CHECK(token == plan.num_tokens());
    Index roots = 0;
    for (Index s = 0; s < plan.num_segments(); ++s) CHECK(t.root_index[s] == (plan.parents()[s] < 0 ? roots++ : -1));
  }
  CHECK_THROWS_AS(plan.chunk_tables(0), TreeError);
  CHECK_THROWS_AS(plan.chunk_tables(kMaxChunkSize + 1), TreeError);
}

template <class F>
std::string error_of(F&& build) {
  try {
    build();
  } catch (const TreeError& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST_SUITE("TreePlan") {
  TEST_CASE("hand-made fork: prompt with two completions") {
    // prompt (3 tokens) -> completion A (2) and completion B (1)
    Forest f = layout({{1, 2}, {}, {}}, {0}, {3, 2, 1});
    auto plan = TreePlan::build(trl_input(f));
    check_plan(*plan, f);
    CHECK(plan->num_levels() == 2);
    CHECK(plan->leaves() == IndexVector{1, 2});
    CHECK(plan->path_tokens() == IndexVector{0, 1, 2, 3, 4, 0, 1, 2, 5});
    CHECK(plan->conv_ancestors(4) == IndexVector{-1, -1, -1, 0, -1, -1, 1, 0, -1, 2, 1, 0, 3, 2, 1, 2, 1, 0});
    CHECK(plan->saved_tokens() == 3);
  }

  TEST_CASE("all three formats give the same plan") {
    std::mt19937 rng(7);
    Forest f = random_forest(rng, 12, 4, 3);
    auto from_kv = TreePlan::build(trl_input(f));
    TreeInput with_parents = trl_input(f);
    with_parents.segment_parents = f.parents;
    with_parents.segment_depths = f.depths;
    TreeInput parents_only;
    parents_only.cu_seqlens_q = f.offsets;
    parents_only.segment_parents = f.parents;
    for (const TreeInput& in : {with_parents, parents_only}) {
      auto plan = TreePlan::build(in);
      for (const auto& name : TreePlan::array_names()) CHECK_MESSAGE(plan->array(name) == from_kv->array(name), name);
    }
  }

  TEST_CASE("random forests: samples and conv ancestors are exact") {
    std::mt19937 rng(1234);
    for (int trial = 0; trial < 200; ++trial) {
      const int nodes = std::uniform_int_distribution<int>(1, 40)(rng);
      const int max_len = trial % 3 == 0 ? 1 : std::uniform_int_distribution<int>(1, 9)(rng);  // 1-token segments
      Forest f = random_forest(rng, nodes, max_len, 4);
      CAPTURE(trial);
      check_plan(*TreePlan::build(trl_input(f)), f);
    }
  }

  TEST_CASE("deep chain of 1-token segments and a plain chain") {
    std::vector<std::vector<int>> children(50);
    for (int i = 0; i + 1 < 50; ++i) children[i] = {i + 1};
    Forest deep = layout(children, {0}, std::vector<Index>(50, 1));
    auto plan = TreePlan::build(trl_input(deep));
    check_plan(*plan, deep);
    CHECK(plan->num_levels() == 50);
    Forest chain = layout({{}}, {0}, {17});
    auto flat = TreePlan::build(trl_input(chain));
    check_plan(*flat, chain);
    CHECK(flat->is_chains());
    CHECK(flat->saved_tokens() == 0);
  }

  TEST_CASE("several roots (packed samples without sharing) are chains") {
    Forest f = layout({{}, {}, {}}, {0, 1, 2}, {3, 1, 5});
    auto plan = TreePlan::build(trl_input(f));
    check_plan(*plan, f);
    CHECK(plan->is_chains());
    CHECK(plan->num_leaves() == 3);
  }
}

TEST_SUITE("TreePlan validation") {
  Forest base() { return layout({{1, 2}, {}, {}}, {0}, {3, 2, 1}); }

  TEST_CASE("offsets") {
    TreeInput in = trl_input(base());
    in.cu_seqlens_q = {0, 3, 3, 6};
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_cu_seqlens_q: segment 1: offsets must increase strictly") == 0);
    in = trl_input(base());
    in.cu_seqlens_q[0] = 1;
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_cu_seqlens_q: must start at 0") == 0);
    in = trl_input(base());
    in.num_tokens = 9;
    CHECK(error_of([&] { TreePlan::build(in); }).find("but the row has 9 tokens") != std::string::npos);
    in.cu_seqlens_q = {0};
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_cu_seqlens_q: needs at least 2 entries") == 0);
  }

  TEST_CASE("key paths") {
    TreeInput in = trl_input(base());
    (*in.kv_index)[7] = 2;  // segment 1's path no longer ends in its own tokens
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_kv_index: segment 1: key path must end in the segment's own tokens") == 0);
    in = trl_input(base());
    (*in.kv_index)[0] = 99;
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_kv_index: entry 0 is 99, outside the row") == 0);
    in = trl_input(base());
    (*in.kv_index)[10] = 1;  // segment 2 attaches after token 1, not the end of segment 0
    CHECK(error_of([&] { TreePlan::build(in); }).find("not the last token of segment 0") != std::string::npos);
    in = trl_input(base());
    (*in.kv_index)[8] = 1;  // segment 2's prefix [1, 1, 2] is not segment 0's path [0, 1, 2]
    CHECK(error_of([&] { TreePlan::build(in); }).find("is not the key path of its parent segment 0") != std::string::npos);
    in = trl_input(base());
    in.cu_seqlens_k = IndexVector{0, 3, 5};
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_cu_seqlens_k: has 3 entries, expected 4") == 0);
    in = trl_input(base());
    in.cu_seqlens_k = IndexVector{0, 30, 5, 12};
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_cu_seqlens_k: segment 0: offsets must be non-decreasing") == 0);
    in = trl_input(base());
    in.cu_seqlens_k.reset();
    CHECK(error_of([&] { TreePlan::build(in); }).find("must be given together") != std::string::npos);
  }

  TEST_CASE("a parent after its child") {
    // Segment 0 attaches after segment 1's last token.
    TreeInput in;
    in.cu_seqlens_q = {0, 2, 4};
    in.kv_index = IndexVector{2, 3, 0, 1, 2, 3};
    in.cu_seqlens_k = IndexVector{0, 4, 6};
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_kv_index: segment 0: parent segment 1 comes after its child") == 0);
    TreeInput p;
    p.cu_seqlens_q = {0, 2, 4};
    p.segment_parents = IndexVector{1, -1};
    CHECK(error_of([&] { TreePlan::build(p); }).find("tree_segment_parents: segment 0: parent 1 does not come before its child") == 0);
    p.segment_parents = IndexVector{0, 0};  // self-cycle
    CHECK(error_of([&] { TreePlan::build(p); }).find("segment 0: parent 0 does not come before") != std::string::npos);
    p.segment_parents = IndexVector{-1, -7};
    CHECK(error_of([&] { TreePlan::build(p); }).find("segment 1: parent -7 is out of range") != std::string::npos);
    p.segment_parents = IndexVector{-1};
    CHECK(error_of([&] { TreePlan::build(p); }).find("tree_segment_parents: has 1 entries, expected 2") == 0);
  }

  TEST_CASE("parents and depths must agree with the key paths") {
    TreeInput in = trl_input(base());
    in.segment_parents = IndexVector{-1, 0, 1};
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_segment_parents: segment 2: parent is 1 but tree_kv_index says 0") == 0);
    in.segment_parents = IndexVector{-1, 0, 0};
    in.segment_depths = IndexVector{0, 3, 1};  // a token offset, Megatron-style, is refused
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_segment_depths: segment 1: depth is 3 but its level in the tree is 1") == 0);
    in.segment_depths = IndexVector{0, 1};
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_segment_depths: has 2 entries, expected 3") == 0);
  }

  TEST_CASE("no structure at all") {
    TreeInput in;
    in.cu_seqlens_q = {0, 4};
    CHECK(error_of([&] { TreePlan::build(in); }).find("no tree structure given") != std::string::npos);
  }

  TEST_CASE("conv width out of range") {
    auto plan = TreePlan::build(trl_input(base()));
    CHECK(error_of([&] { plan->conv_ancestors(0); }).find("conv width") == 0);
  }

  TEST_CASE("sizes are checked before anything is allocated and per-token tables are built on first use") {
    // issue 12 item 2: a 2-entry input naming a huge row was allocated (bad_alloc, gigabytes, or an
    // unnamed vector::_M_default_append error) before being refused.
    TreeInput in;
    in.segment_parents = IndexVector{-1};
    for (Index huge : {Index(1) << 40, Index(1) << 62, kMaxTokens + 1}) {
      in.cu_seqlens_q = {0, huge};
      CHECK(error_of([&] { TreePlan::build(in); }).find("tree_cu_seqlens_q: ends at " + std::to_string(huge) + ": a row holds at most") == 0);
    }
    in.cu_seqlens_q = {0, Index(1) << 28};
    in.num_tokens = 5;  // the row the caller holds
    CHECK(error_of([&] { TreePlan::build(in); }).find("tree_cu_seqlens_q: ends at 268435456 but the row has 5 tokens") == 0);
    in.num_tokens = -1;  // unknown row: planned with O(segments) memory
    auto plan = TreePlan::build(in);
    CHECK(plan->num_tokens() == (Index(1) << 28));
    CHECK(plan->path_token_total() == (Index(1) << 28));
    CHECK(plan->segment_of(12345) == 0);
    // The same through the TRL format: parents come from the key paths without per-token tables.
    TreeInput kv = trl_input(base());
    auto from_kv = TreePlan::build(kv);
    CHECK(from_kv->token_segment().size() == static_cast<size_t>(from_kv->num_tokens()));
    for (Index t = 0; t < from_kv->num_tokens(); ++t) CHECK(from_kv->segment_of(t) == from_kv->token_segment()[t]);
  }
}
