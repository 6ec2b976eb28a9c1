// TreePlan: everything the tree kernels need about one tree-packed row, built once on the host.
//
// Input: the tree metadata a forward receives, in one of three forms (see docs/tree-format.md):
//   * TRL 1.16: cu_seqlens_q (S+1) + kv_index (K) + cu_seqlens_k (S+1); parents are read off the
//     key paths (a segment's path is its parent's path followed by its own tokens);
//   * the same plus segment_parents (S) and segment_depths (S, the segment's level, root 0),
//     which are checked against the key paths;
//   * cu_seqlens_q + segment_parents alone.
// Errors: TreeError (a std::invalid_argument, ValueError in Python) naming the field, the
// segment and what was expected. Nothing is trusted: every index is range-checked.
// Layout of every array: docs/architecture.md.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace tree_recurrence {

using Index = int64_t;
using IndexVector = std::vector<Index>;

class TreeError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct TreeInput {
  IndexVector cu_seqlens_q;
  std::optional<IndexVector> kv_index;
  std::optional<IndexVector> cu_seqlens_k;
  std::optional<IndexVector> segment_parents;
  std::optional<IndexVector> segment_depths;
  Index num_tokens = -1;  // length of the row when known (input_ids), else taken from cu_seqlens_q
};

// Sizes are validated before anything is allocated: a row holds at most kMaxTokens tokens (so no
// index sum of a plan can overflow int64), build() allocates O(segments) beyond copies of its
// inputs, and every O(tokens) table is built on first use. A tiny input naming a huge row is
// therefore refused (num_tokens given) or planned in microseconds without per-token memory.
constexpr Index kMaxTokens = (Index(1) << 31) - 1;
// The largest chunk a chunked kernel may ask for (the grid is chunks x chunk_size entries).
constexpr Index kMaxChunkSize = Index(1) << 16;

// Segment-aligned chunks of a plan for chunked recurrent kernels: a chunk never crosses a segment
// boundary; a segment of L tokens has ceil(L / C) chunks, in token order (docs/architecture.md).
struct ChunkTables {
  Index chunk_size = 0;
  Index num_chunks = 0;
  IndexVector gather;             // num_chunks x chunk_size, row-major: token of each grid entry, -1 for padding
  IndexVector scatter;            // N: each token's position in the flattened grid (increasing)
  IndexVector seg_chunk_offsets;  // S+1: the chunks of segment s are [off[s], off[s+1])
  IndexVector root_index;         // S: a root's index among the roots (segment order), -1 for the others
};

class TreePlan {
 public:
  static std::shared_ptr<TreePlan> build(const TreeInput& input);

  Index num_tokens() const { return num_tokens_; }
  Index num_segments() const { return static_cast<Index>(seg_lengths_.size()); }
  Index num_leaves() const { return static_cast<Index>(leaves_.size()); }
  Index num_levels() const { return static_cast<Index>(level_offsets_.size()) - 1; }
  Index path_token_total() const { return path_offsets_.back(); }
  Index saved_tokens() const { return path_token_total() - num_tokens_; }
  Index max_path_length() const { return max_path_length_; }
  Index max_segment_length() const { return max_segment_length_; }
  bool is_chains() const { return num_levels() <= 1; }

  const IndexVector& seg_offsets() const { return seg_offsets_; }
  const IndexVector& seg_lengths() const { return seg_lengths_; }
  const IndexVector& parents() const { return parents_; }
  const IndexVector& levels() const { return levels_; }
  const IndexVector& level_offsets() const { return level_offsets_; }
  const IndexVector& level_segments() const { return level_segments_; }
  const IndexVector& child_offsets() const { return child_offsets_; }
  const IndexVector& children() const { return children_; }
  const IndexVector& leaves() const { return leaves_; }
  const IndexVector& path_offsets() const { return path_offsets_; }
  // O(sum of path lengths): built on first use (rescan and attention need it, fork does not).
  const IndexVector& path_tokens() const;
  // O(tokens): built on first use (together), like path_tokens.
  const IndexVector& token_source() const { return token_tables().source; }
  const IndexVector& token_segment() const { return token_tables().segment; }
  const IndexVector& token_position() const { return token_tables().position; }
  // The segment holding token t (binary search; t must be in [0, num_tokens)).
  Index segment_of(Index token) const;
  const IndexVector& segment_start() const { return segment_start_; }
  const IndexVector& segment_source_leaf() const { return segment_source_leaf_; }

  // N x (width-1), row-major: column j is the token j+1 steps back on the token's path, or -1.
  // Computed once per width and cached (thread-safe).
  const IndexVector& conv_ancestors(Index width) const;
  // Reverse of conv_ancestors(width), as CSR: readers of token u are the flat indices
  // r = t*(width-1) + (j-1) with conv_ancestors[r] == u, increasing. Offsets have N+1 entries.
  // The CUDA conv backward gathers through it (deterministic, no atomics).
  const IndexVector& conv_reader_offsets(Index width) const { return conv_readers_of(width).first; }
  const IndexVector& conv_readers(Index width) const { return conv_readers_of(width).second; }

  // The chunk tables for chunks of chunk_size tokens (in [1, kMaxChunkSize], else TreeError), built on
  // each call (O(chunks x chunk_size)); the caller caches them (Python: TreePlan.cached, the one cache).
  ChunkTables chunk_tables(Index chunk_size) const;

  // Names of the arrays above, for generic export (bindings, doctor).
  static const std::vector<std::string>& array_names();
  const IndexVector& array(const std::string& name) const;

 private:
  TreePlan() = default;
  void derive_parents(const TreeInput& input);
  void check_parents(const TreeInput& input);
  void build_topology();
  void build_paths();
  struct TokenTables {
    IndexVector source, segment, position;
  };
  const TokenTables& token_tables() const;
  const std::pair<IndexVector, IndexVector>& conv_readers_of(Index width) const;

  Index num_tokens_ = 0;
  Index max_path_length_ = 0;
  Index max_segment_length_ = 0;
  IndexVector seg_offsets_, seg_lengths_, parents_, levels_, level_offsets_, level_segments_;
  IndexVector child_offsets_, children_, leaves_, path_offsets_;
  mutable IndexVector path_tokens_;
  IndexVector segment_start_, segment_source_leaf_;
  mutable TokenTables token_tables_;
  mutable std::once_flag token_tables_once_;
  mutable std::mutex conv_mutex_;
  mutable std::once_flag path_tokens_once_;
  mutable std::map<Index, std::unique_ptr<IndexVector>> conv_ancestors_;
  mutable std::map<Index, std::unique_ptr<std::pair<IndexVector, IndexVector>>> conv_readers_;
};

}  // namespace tree_recurrence
