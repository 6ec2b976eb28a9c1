// The arguments of the gated_delta_net ops, declared once: the op schemas' shared parts, the struct every
// entry point takes (the schema binding in ops.cpp, the ATen composite, the fused CUDA path, the float64
// token oracle) and its one way into and out of an autograd context. An argument added here reaches
// every op through the schema strings below and the binding by name in ops.cpp; only the paths that use
// it change besides.
//
//   q, k (T, HK, K); v (T, HV, V), HV a multiple of HK (value head h reads key head h / (HV / HK));
//   g (T, HV) log decays (<= 0); beta (T, HV);
//   tables: the plan's chunk tables on the inputs' device (TreePlan.chunk_tables; sdk/chunk_tables.h),
//     or for the token oracle the plan's host seg_offsets (S+1) and parents (S), int64;
//   initial_state None (zeros), (HV, K, V) or (1, HV, K, V) shared by every root, or (R, HV, K, V) one
//     per root in root order;
//   scale: q's factor, <= 0 means K^-0.5 (what the models use);
//   use_qk_l2norm: q and k normalised first, x * rsqrt(sum x^2 + 1e-6) (transformers' l2norm).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cmath>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "tree_recurrence/sdk/chunk_tables.h"

// The schema's parts before and after the tables:
//   "op(" TREE_RECURRENCE_GDN_INPUTS_SCHEMA ", <tables>, " TREE_RECURRENCE_GDN_SCALARS_SCHEMA ") -> Tensor"
#define TREE_RECURRENCE_GDN_INPUTS_SCHEMA "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta"
#define TREE_RECURRENCE_GDN_SCALARS_SCHEMA "Tensor? initial_state, float scale, bool use_qk_l2norm"

namespace tree_recurrence::gdn {

// The chunked ops' tables (sdk/chunk_tables.h).
using Tables = ::tree_recurrence::ChunkTableSet;

// The token oracle's tables: the plan's host arrays.
struct TokenTables {
  at::Tensor seg_offsets, parents;

  template <class Self, class F>
  static void each_tensor(Self& t, F&& f) {
    f("seg_offsets", t.seg_offsets), f("parents", t.parents);
  }
};

template <class TablesT>
struct ArgsOf {
  at::Tensor q, k, v, g, beta;
  TablesT tables;
  std::optional<at::Tensor> initial_state;
  double scale = 0.0;
  bool use_qk_l2norm = false;

  // f(name, field) by schema name, in schema order: the differentiable inputs (initial_state aside)...
  template <class Self, class F>
  static void each_input(Self& a, F&& f) {
    f("q", a.q), f("k", a.k), f("v", a.v), f("g", a.g), f("beta", a.beta);
  }
  // ... and the scalars (bound, saved and loaded through this list only).
  template <class Self, class F>
  static void each_scalar(Self& a, F&& f) {
    f("scale", a.scale), f("use_qk_l2norm", a.use_qk_l2norm);
  }

  bool has_initial_state() const { return initial_state.has_value() && initial_state->defined(); }
  // scale, or K^-0.5 when it is <= 0.
  double resolved_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(2))); }

  // Into an autograd context (a torch::autograd::AutogradContext, inside the Function's forward): q, k,
  // v, g, beta, initial_state (undefined when None), then `extra` through save_for_backward (version
  // checked, seen by saved-tensor hooks), the scalars and the tables into saved_data.
  template <class Context>
  void save(Context* ctx, const std::vector<at::Tensor>& extra) const {
    std::vector<at::Tensor> tensors;
    each_input(*this, [&](const char*, const at::Tensor& t) { tensors.push_back(t); });
    tensors.push_back(has_initial_state() ? *initial_state : at::Tensor());
    tensors.insert(tensors.end(), extra.begin(), extra.end());
    ctx->save_for_backward(tensors);
    ctx->saved_data["has_initial_state"] = has_initial_state();
    each_scalar(*this, [&](const char* name, const auto& x) { ctx->saved_data[name] = x; });
    tables.save(ctx);
  }
  // Out of it, in the backward: the arguments and save's `extra`.
  template <class Context>
  static std::pair<ArgsOf, std::vector<at::Tensor>> load(Context* ctx) {
    std::vector<at::Tensor> saved = ctx->get_saved_variables();
    ArgsOf a;
    size_t i = 0;
    each_input(a, [&](const char*, at::Tensor& t) { t = saved[i++]; });
    if (ctx->saved_data["has_initial_state"].toBool()) a.initial_state = saved[i];
    ++i;
    each_scalar(a, [&](const char* name, auto& x) { x = ctx->saved_data[name].template to<std::decay_t<decltype(x)>>(); });
    a.tables = TablesT::load(ctx);
    return {std::move(a), std::vector<at::Tensor>(saved.begin() + i, saved.end())};
  }
};

// gdn_tree_scan and its fused stages.
using GdnArgs = ArgsOf<Tables>;
// gdn_token_scan.
using GdnTokenArgs = ArgsOf<TokenTables>;

}  // namespace tree_recurrence::gdn
