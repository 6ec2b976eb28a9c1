#include "tree_recurrence/tree_plan.h"

#include <algorithm>

namespace tree_recurrence {
namespace {

[[noreturn]] void fail(const std::string& field, const std::string& what) {
  throw TreeError(field + ": " + what);
}

std::string at_segment(Index s) { return "segment " + std::to_string(s) + ": "; }

// A given per-segment field must equal the one the plan derived: one entry per segment, each the same
// (mismatch(s, given, derived) words the error at the first segment that differs).
template <class Mismatch>
void check_given(const std::string& field, const IndexVector& given, const IndexVector& derived, Mismatch&& mismatch) {
  const auto S = derived.size();
  if (given.size() != S) fail(field, "has " + std::to_string(given.size()) + " entries, expected " + std::to_string(S));
  for (std::size_t s = 0; s < S; ++s)
    if (given[s] != derived[s]) fail(field, mismatch(static_cast<Index>(s), given[s], derived[s]));
}

void check_offsets(const IndexVector& cu, Index num_tokens) {
  if (cu.size() < 2) fail("tree_cu_seqlens_q", "needs at least 2 entries (one segment), got " + std::to_string(cu.size()));
  if (cu.front() != 0) fail("tree_cu_seqlens_q", "must start at 0, starts at " + std::to_string(cu.front()));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    if (cu[s + 1] <= cu[s])
      fail("tree_cu_seqlens_q", at_segment(static_cast<Index>(s)) + "offsets must increase strictly (empty or negative segment: " +
                                    std::to_string(cu[s]) + " -> " + std::to_string(cu[s + 1]) + ")");
  if (cu.back() > kMaxTokens)
    fail("tree_cu_seqlens_q", "ends at " + std::to_string(cu.back()) + ": a row holds at most " + std::to_string(kMaxTokens) + " tokens");
  if (num_tokens >= 0 && cu.back() != num_tokens)
    fail("tree_cu_seqlens_q", "ends at " + std::to_string(cu.back()) + " but the row has " + std::to_string(num_tokens) + " tokens");
}

}  // namespace

std::shared_ptr<TreePlan> TreePlan::build(const TreeInput& input) {
  std::shared_ptr<TreePlan> plan(new TreePlan());
  check_offsets(input.cu_seqlens_q, input.num_tokens);
  plan->seg_offsets_ = input.cu_seqlens_q;
  plan->num_tokens_ = input.cu_seqlens_q.back();
  const Index S = static_cast<Index>(input.cu_seqlens_q.size()) - 1;
  plan->seg_lengths_.resize(S);
  for (Index s = 0; s < S; ++s) plan->seg_lengths_[s] = plan->seg_offsets_[s + 1] - plan->seg_offsets_[s];

  if (input.kv_index || input.cu_seqlens_k) {
    if (!input.kv_index || !input.cu_seqlens_k)
      fail(input.kv_index ? "tree_cu_seqlens_k" : "tree_kv_index",
           "tree_kv_index and tree_cu_seqlens_k must be given together");
    plan->derive_parents(input);
  } else if (input.segment_parents) {
    plan->parents_ = *input.segment_parents;
  } else {
    fail("tree_segment_parents", "no tree structure given: pass tree_kv_index + tree_cu_seqlens_k or tree_segment_parents");
  }
  plan->check_parents(input);
  plan->build_topology();
  plan->build_paths();
  return plan;
}

Index TreePlan::segment_of(Index token) const {
  return static_cast<Index>(std::upper_bound(seg_offsets_.begin(), seg_offsets_.end(), token) - seg_offsets_.begin()) - 1;
}

// TRL's format: a segment's key path is its parent's path followed by its own tokens.
void TreePlan::derive_parents(const TreeInput& input) {
  const IndexVector& kv = *input.kv_index;
  const IndexVector& cu = *input.cu_seqlens_k;
  const Index S = num_segments();
  const Index K = static_cast<Index>(kv.size());
  if (static_cast<Index>(cu.size()) != S + 1)
    fail("tree_cu_seqlens_k", "has " + std::to_string(cu.size()) + " entries, expected " + std::to_string(S + 1) +
                                  " (one more than the segments of tree_cu_seqlens_q)");
  if (cu.front() != 0) fail("tree_cu_seqlens_k", "must start at 0, starts at " + std::to_string(cu.front()));
  if (cu.back() != K)
    fail("tree_cu_seqlens_k", "ends at " + std::to_string(cu.back()) + " but tree_kv_index has " + std::to_string(K) + " entries");
  // Range check as one vectorizable min/max pass; the slow search only runs to name the culprit.
  Index lowest = 0, highest = 0;
  if (K > 0) {
    lowest = highest = kv[0];
    for (Index i = 1; i < K; ++i) {
      lowest = std::min(lowest, kv[i]);
      highest = std::max(highest, kv[i]);
    }
  }
  if (lowest < 0 || highest >= num_tokens_)
    for (Index i = 0; i < K; ++i)
      if (kv[i] < 0 || kv[i] >= num_tokens_)
        fail("tree_kv_index", "entry " + std::to_string(i) + " is " + std::to_string(kv[i]) + ", outside the row [0, " +
                                  std::to_string(num_tokens_) + ")");
  parents_.assign(S, -1);
  for (Index s = 0; s < S; ++s) {
    const Index begin = cu[s], end = cu[s + 1], len = seg_lengths_[s];
    if (end < begin || end > K)
      fail("tree_cu_seqlens_k", at_segment(s) + "offsets must be non-decreasing within [0, " + std::to_string(K) + "], got " +
                                    std::to_string(begin) + " -> " + std::to_string(end));
    if (end - begin < len)
      fail("tree_kv_index", at_segment(s) + "key path has " + std::to_string(end - begin) + " entries, fewer than the segment's " +
                                std::to_string(len) + " tokens");
    for (Index i = 0; i < len; ++i)
      if (kv[end - len + i] != seg_offsets_[s] + i) [[unlikely]]
        fail("tree_kv_index", at_segment(s) + "key path must end in the segment's own tokens " + std::to_string(seg_offsets_[s]) +
                                  ".." + std::to_string(seg_offsets_[s + 1] - 1) + ", found token " + std::to_string(kv[end - len + i]) +
                                  " at path position " + std::to_string(end - len + i - begin));
    const Index prefix = end - len - begin;
    if (prefix == 0) continue;
    const Index last = kv[end - len - 1];
    const Index p = segment_of(last);
    if (p >= s)
      fail("tree_kv_index", at_segment(s) + "parent segment " + std::to_string(p) + " comes after its child (segments must be in DFS pre-order)");
    if (last != seg_offsets_[p + 1] - 1)
      fail("tree_kv_index", at_segment(s) + "key path attaches after token " + std::to_string(last) + ", which is not the last token of segment " +
                                std::to_string(p));
    if (cu[p + 1] - cu[p] != prefix || !std::equal(kv.begin() + cu[p], kv.begin() + cu[p + 1], kv.begin() + begin))
      fail("tree_kv_index", at_segment(s) + "key path prefix is not the key path of its parent segment " + std::to_string(p));
    parents_[s] = p;
  }
  if (input.segment_parents)
    check_given("tree_segment_parents", *input.segment_parents, parents_, [](Index s, Index given, Index want) {
      return at_segment(s) + "parent is " + std::to_string(given) + " but tree_kv_index says " + std::to_string(want);
    });
}

void TreePlan::check_parents(const TreeInput& input) {
  const Index S = num_segments();
  if (static_cast<Index>(parents_.size()) != S)
    fail("tree_segment_parents", "has " + std::to_string(parents_.size()) + " entries, expected " + std::to_string(S) +
                                     " (one per segment of tree_cu_seqlens_q)");
  levels_.assign(S, 0);
  for (Index s = 0; s < S; ++s) {
    const Index p = parents_[s];
    if (p < -1 || p >= S)
      fail("tree_segment_parents", at_segment(s) + "parent " + std::to_string(p) + " is out of range [-1, " + std::to_string(S) + ")");
    if (p >= s)
      fail("tree_segment_parents", at_segment(s) + "parent " + std::to_string(p) +
                                       " does not come before its child (segments must be in DFS pre-order; this also excludes cycles)");
    levels_[s] = p < 0 ? 0 : levels_[p] + 1;
  }
  if (input.segment_depths)
    check_given("tree_segment_depths", *input.segment_depths, levels_, [](Index s, Index given, Index want) {
      return at_segment(s) + "depth is " + std::to_string(given) + " but its level in the tree is " + std::to_string(want) +
             " (depth counts segments from the root, root = 0)";
    });
}

void TreePlan::build_topology() {
  const Index S = num_segments();
  Index num_levels = 0;
  for (Index s = 0; s < S; ++s) num_levels = std::max(num_levels, levels_[s] + 1);
  level_offsets_.assign(num_levels + 1, 0);
  for (Index s = 0; s < S; ++s) ++level_offsets_[levels_[s] + 1];
  for (Index l = 0; l < num_levels; ++l) level_offsets_[l + 1] += level_offsets_[l];
  level_segments_.resize(S);
  IndexVector cursor(level_offsets_.begin(), level_offsets_.end() - 1);
  for (Index s = 0; s < S; ++s) level_segments_[cursor[levels_[s]]++] = s;

  child_offsets_.assign(S + 1, 0);
  for (Index s = 0; s < S; ++s)
    if (parents_[s] >= 0) ++child_offsets_[parents_[s] + 1];
  for (Index s = 0; s < S; ++s) child_offsets_[s + 1] += child_offsets_[s];
  children_.resize(child_offsets_.back());
  IndexVector next(child_offsets_.begin(), child_offsets_.end() - 1);
  for (Index s = 0; s < S; ++s)
    if (parents_[s] >= 0) children_[next[parents_[s]]++] = s;
  leaves_.clear();
  for (Index s = 0; s < S; ++s) {
    if (child_offsets_[s + 1] == child_offsets_[s]) leaves_.push_back(s);
    max_segment_length_ = std::max(max_segment_length_, seg_lengths_[s]);
  }
  segment_start_.assign(S, 0);
  for (Index s = 0; s < S; ++s)
    if (parents_[s] >= 0) segment_start_[s] = segment_start_[parents_[s]] + seg_lengths_[parents_[s]];
}

void TreePlan::build_paths() {
  const Index S = num_segments();
  path_offsets_.assign(1, 0);
  IndexVector leaf_index(S, -1);
  for (Index i = 0; i < num_leaves(); ++i) {
    const Index leaf = leaves_[i];
    const Index length = segment_start_[leaf] + seg_lengths_[leaf];
    path_offsets_.push_back(path_offsets_.back() + length);
    max_path_length_ = std::max(max_path_length_, length);
    leaf_index[leaf] = i;
  }
  // A segment's outputs come from the first path through it: its own if it is a leaf, else its
  // first child's. Children come after parents, so one backward sweep settles every segment.
  segment_source_leaf_.assign(S, -1);
  for (Index s = S - 1; s >= 0; --s)
    segment_source_leaf_[s] = leaf_index[s] >= 0 ? leaf_index[s] : segment_source_leaf_[children_[child_offsets_[s]]];
}

const IndexVector& TreePlan::path_tokens() const {
  std::call_once(path_tokens_once_, [this] {
    path_tokens_.resize(path_offsets_.back());
    for (Index i = 0; i < num_leaves(); ++i)
      for (Index s = leaves_[i]; s >= 0; s = parents_[s]) {
        const Index base = path_offsets_[i] + segment_start_[s];
        for (Index t = 0; t < seg_lengths_[s]; ++t) path_tokens_[base + t] = seg_offsets_[s] + t;
      }
  });
  return path_tokens_;
}

const TreePlan::TokenTables& TreePlan::token_tables() const {
  std::call_once(token_tables_once_, [this] {
    TokenTables& t = token_tables_;
    t.position.resize(num_tokens_);
    t.source.resize(num_tokens_);
    t.segment.resize(num_tokens_);
    for (Index s = 0; s < num_segments(); ++s) {
      const Index source_base = path_offsets_[segment_source_leaf_[s]] + segment_start_[s];
      for (Index i = 0; i < seg_lengths_[s]; ++i) {
        t.position[seg_offsets_[s] + i] = segment_start_[s] + i;
        t.source[seg_offsets_[s] + i] = source_base + i;
        t.segment[seg_offsets_[s] + i] = s;
      }
    }
  });
  return token_tables_;
}

const IndexVector& TreePlan::conv_ancestors(Index width) const {
  if (width < 1 || width > 64) throw TreeError("conv width: must be in [1, 64], got " + std::to_string(width));
  std::lock_guard<std::mutex> lock(conv_mutex_);
  auto found = conv_ancestors_.find(width);
  if (found != conv_ancestors_.end()) return *found->second;
  const Index taps = width - 1;
  auto table = std::make_unique<IndexVector>(num_tokens_ * taps, -1);
  for (Index s = 0; s < num_segments(); ++s) {
    const Index base = seg_offsets_[s], length = seg_lengths_[s];
    // Tokens at least `taps` into their segment read only their own segment: a tight loop.
    for (Index i = std::min(taps, length); i < length; ++i) {
      Index* row = table->data() + (base + i) * taps;
      for (Index j = 0; j < taps; ++j) row[j] = base + i - 1 - j;
    }
    for (Index i = 0; i < std::min(taps, length); ++i) {
      Index* row = table->data() + (seg_offsets_[s] + i) * taps;
      // Step back through this segment, then through ancestors (which may be shorter than W).
      Index segment = s, local = i;
      for (Index j = 0; j < taps; ++j) {
        --local;
        while (local < 0 && segment >= 0) {
          segment = parents_[segment];
          if (segment >= 0) local += seg_lengths_[segment];
        }
        if (segment < 0) break;
        row[j] = seg_offsets_[segment] + local;
      }
    }
  }
  return *(conv_ancestors_[width] = std::move(table));
}

const std::pair<IndexVector, IndexVector>& TreePlan::conv_readers_of(Index width) const {
  const IndexVector& ancestors = conv_ancestors(width);
  std::lock_guard<std::mutex> lock(conv_mutex_);
  auto found = conv_readers_.find(width);
  if (found != conv_readers_.end()) return *found->second;
  auto csr = std::make_unique<std::pair<IndexVector, IndexVector>>();
  IndexVector& offsets = csr->first;
  offsets.assign(num_tokens_ + 1, 0);
  for (Index a : ancestors)
    if (a >= 0) ++offsets[a + 1];
  for (Index u = 0; u < num_tokens_; ++u) offsets[u + 1] += offsets[u];
  csr->second.resize(offsets.back());
  IndexVector next(offsets.begin(), offsets.end() - 1);
  for (Index r = 0; r < static_cast<Index>(ancestors.size()); ++r)
    if (ancestors[r] >= 0) csr->second[next[ancestors[r]]++] = r;
  return *(conv_readers_[width] = std::move(csr));
}

ChunkTables TreePlan::chunk_tables(Index chunk_size) const {
  if (chunk_size < 1 || chunk_size > kMaxChunkSize)
    throw TreeError("chunk_size: must be in [1, " + std::to_string(kMaxChunkSize) + "], got " + std::to_string(chunk_size));
  const Index S = num_segments();
  ChunkTables t;
  t.chunk_size = chunk_size;
  t.seg_chunk_offsets.assign(S + 1, 0);
  for (Index s = 0; s < S; ++s) t.seg_chunk_offsets[s + 1] = t.seg_chunk_offsets[s] + (seg_lengths_[s] + chunk_size - 1) / chunk_size;
  t.num_chunks = t.seg_chunk_offsets.back();  // <= num_tokens: the grid has at most kMaxTokens * kMaxChunkSize entries
  t.gather.assign(t.num_chunks * chunk_size, -1);
  t.scatter.resize(num_tokens_);
  for (Index s = 0; s < S; ++s) {
    const Index first = seg_offsets_[s], end = seg_offsets_[s + 1];
    for (Index c = t.seg_chunk_offsets[s]; c < t.seg_chunk_offsets[s + 1]; ++c) {
      const Index start = first + (c - t.seg_chunk_offsets[s]) * chunk_size;
      const Index count = std::min(chunk_size, end - start);
      for (Index i = 0; i < count; ++i) {
        t.gather[c * chunk_size + i] = start + i;
        t.scatter[start + i] = c * chunk_size + i;
      }
    }
  }
  t.root_index.assign(S, -1);
  Index roots = 0;
  for (Index s = 0; s < S; ++s)
    if (parents_[s] < 0) t.root_index[s] = roots++;
  return t;
}

const std::vector<std::string>& TreePlan::array_names() {
  static const std::vector<std::string> names{
      "seg_offsets",   "seg_lengths",  "parents",        "levels",         "level_offsets",
      "level_segments", "child_offsets", "children",     "leaves",         "path_offsets",
      "path_tokens",   "token_source", "token_segment",  "token_position", "segment_start",
      "segment_source_leaf"};
  return names;
}

const IndexVector& TreePlan::array(const std::string& name) const {
  static const std::map<std::string, IndexVector TreePlan::*> members{
      {"seg_offsets", &TreePlan::seg_offsets_},       {"seg_lengths", &TreePlan::seg_lengths_},
      {"parents", &TreePlan::parents_},               {"levels", &TreePlan::levels_},
      {"level_offsets", &TreePlan::level_offsets_},   {"level_segments", &TreePlan::level_segments_},
      {"child_offsets", &TreePlan::child_offsets_},   {"children", &TreePlan::children_},
      {"leaves", &TreePlan::leaves_},                 {"path_offsets", &TreePlan::path_offsets_},
      {"segment_start", &TreePlan::segment_start_},   {"segment_source_leaf", &TreePlan::segment_source_leaf_}};
  if (name == "path_tokens") return path_tokens();
  if (name == "token_source") return token_source();
  if (name == "token_segment") return token_segment();
  if (name == "token_position") return token_position();
  auto found = members.find(name);
  if (found == members.end()) throw std::out_of_range("TreePlan has no array named '" + name + "'");
  return this->*(found->second);
}

}  // namespace tree_recurrence
