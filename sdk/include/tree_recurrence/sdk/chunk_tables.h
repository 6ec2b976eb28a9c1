// The plan's chunk tables (TreePlan.chunk_tables(chunk, device)) as a family's chunked / fused ops take
// them: one parameter list for the op signatures, one struct for the code behind them, one way to keep
// them in an autograd context.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <vector>

#include "tree_recurrence/sdk/check.h"

// The tables as an op's parameters, in schema order (gather ... children), and the same names as the
// arguments of a call: `at::Tensor op(const at::Tensor& x, TREE_RECURRENCE_CHUNK_TABLE_PARAMS, ...)`.
#define TREE_RECURRENCE_CHUNK_TABLE_PARAMS                                                                  \
  const at::Tensor &gather, const at::Tensor &scatter, const at::Tensor &seg_chunk_offsets,                 \
      const at::Tensor &parents, const at::Tensor &root_index, const at::Tensor &level_segments,            \
      at::IntArrayRef level_offsets, const at::Tensor &child_offsets, const at::Tensor &children
#define TREE_RECURRENCE_CHUNK_TABLE_ARGS \
  gather, scatter, seg_chunk_offsets, parents, root_index, level_segments, level_offsets, child_offsets, children
// The same parameters in an op schema string ("x(Tensor a, " TREE_RECURRENCE_CHUNK_TABLE_SCHEMA ", ...)"): the
// names the engine's load check expects of a chunked native op (tree_recurrence/_native_schema.py).
#define TREE_RECURRENCE_CHUNK_TABLE_SCHEMA                                                              \
  "Tensor gather, Tensor scatter, Tensor seg_chunk_offsets, Tensor parents, Tensor root_index, Tensor " \
  "level_segments, int[] level_offsets, Tensor child_offsets, Tensor children"

namespace tree_recurrence {

// An op's check of the two token tables: gather (chunks, chunk_size) int64, scatter (T) int64.
inline void check_gather_scatter(const char* op, const at::Tensor& gather, const at::Tensor& scatter, int64_t T) {
  TR_CHECK_VALUE(gather.dim() == 2 && gather.size(1) > 0 && gather.scalar_type() == at::kLong, op,
                 ": gather must be an int64 (chunks, chunk_size) table (TreePlan.chunk_tables), got ",
                 gather.scalar_type(), " ", gather.sizes());
  TR_CHECK_VALUE(scatter.dim() == 1 && scatter.size(0) == T && scatter.scalar_type() == at::kLong, op,
                 ": scatter must be an int64 (tokens=", T, ") table (TreePlan.chunk_tables), got ",
                 scatter.scalar_type(), " ", scatter.sizes());
}

// The tables held (level_offsets copied to the host vector the kernels' launchers read).
struct ChunkTableSet {
  at::Tensor gather, scatter, seg_chunk_offsets, parents, root_index, level_segments;
  std::vector<int64_t> level_offsets;
  at::Tensor child_offsets, children;

  static ChunkTableSet of(TREE_RECURRENCE_CHUNK_TABLE_PARAMS) {
    return {gather, scatter, seg_chunk_offsets, parents, root_index, level_segments,
            std::vector<int64_t>(level_offsets.begin(), level_offsets.end()), child_offsets, children};
  }

  // Into / out of an autograd context's saved_data (a torch::autograd::AutogradContext), one key a table.
  template <class Context>
  void save(Context* ctx) const {
    each_tensor(*this, [&](const char* name, const at::Tensor& table) { ctx->saved_data[name] = table; });
    ctx->saved_data["level_offsets"] = c10::IValue(c10::List<int64_t>(level_offsets));
  }
  template <class Context>
  static ChunkTableSet load(Context* ctx) {
    ChunkTableSet t;
    each_tensor(t, [&](const char* name, at::Tensor& table) { table = ctx->saved_data[name].toTensor(); });
    t.level_offsets = ctx->saved_data["level_offsets"].toIntVector();
    return t;
  }

  // f(name, table) for the tensor tables, in schema order.
  template <class Self, class F>
  static void each_tensor(Self& t, F&& f) {
    f("gather", t.gather), f("scatter", t.scatter), f("seg_chunk_offsets", t.seg_chunk_offsets);
    f("parents", t.parents), f("root_index", t.root_index), f("level_segments", t.level_segments);
    f("child_offsets", t.child_offsets), f("children", t.children);
  }
};

}  // namespace tree_recurrence
