#include "tree_recurrence/kernels/chunk_state_pass.h"
#include "tree_recurrence/kernels/dtype.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

namespace tree_recurrence::kernels {

const char* chunk_dtype_name(ChunkDType dtype) { return element_type_name(dtype); }

namespace {

void require(bool ok, const std::string& what) { kernels::require(ok, "chunk_state_pass", what); }

std::string at(const char* table, int64_t i) { return std::string(table) + "[" + std::to_string(i) + "]"; }

int64_t head_end_of(const ChunkStatePassParams& p) { return p.head_end < 0 ? p.heads : std::min(p.head_end, p.heads); }

// The state a root starts from (into `state`, K*V).
template <typename T>
void load_root_state(const ChunkStatePassParams& p, int64_t s, int64_t head, T* state) {
  const int64_t kv = p.k_dim * p.v_dim;
  if (!p.initial_state) {
    std::fill(state, state + kv, T(0));
    return;
  }
  const T* init = static_cast<const T*>(p.initial_state);
  const int64_t row = p.initial_per_root ? p.root_index[s] * p.heads + head : head;
  std::copy(init + row * kv, init + (row + 1) * kv, state);
}

// The params' buffers typed (on the CPU inputs and states share one type T), in the order the
// kernels below bind them.
template <typename T>
struct Buffers {
  const T *w, *u, *kd, *decay, *grad_h, *grad_v_new;
  T *h, *v_new, *grad_u, *grad_state, *grad_initial_roots, *workspace;
  explicit Buffers(const ChunkStatePassParams& p)
      : w(static_cast<const T*>(p.w)), u(static_cast<const T*>(p.u)), kd(static_cast<const T*>(p.kd)),
        decay(static_cast<const T*>(p.decay)), grad_h(static_cast<const T*>(p.grad_h)),
        grad_v_new(static_cast<const T*>(p.grad_v_new)), h(static_cast<T*>(p.h)), v_new(static_cast<T*>(p.v_new)),
        grad_u(static_cast<T*>(p.grad_u)), grad_state(static_cast<T*>(p.grad_state)),
        grad_initial_roots(static_cast<T*>(p.grad_initial_roots)), workspace(static_cast<T*>(p.workspace)) {}
};

template <typename T>
void forward_impl(const ChunkStatePassParams& p) {
  const int64_t H = p.heads, C = p.chunk, K = p.k_dim, V = p.v_dim, KV = K * V;
  // the workspace: the final states of segments with children
  const auto [w, u, kd, decay, grad_h_, grad_v_new_, h, v_new, grad_u_, grad_state_, grad_init_, final_state] = Buffers<T>(p);
  std::vector<T> state(static_cast<size_t>(KV));
  for (int64_t level = 0; level < p.num_levels; ++level) {
    for (int64_t i = p.level_offsets[level]; i < p.level_offsets[level + 1]; ++i) {
      const int64_t s = p.level_segments[i];
      for (int64_t head = p.head_begin; head < head_end_of(p); ++head) {
        if (p.parents[s] >= 0) {
          const T* src = final_state + (p.parents[s] * H + head) * KV;
          std::copy(src, src + KV, state.data());
        } else {
          load_root_state(p, s, head, state.data());
        }
        for (int64_t c = p.seg_chunk_offsets[s]; c < p.seg_chunk_offsets[s + 1]; ++c) {
          const int64_t ch = c * H + head;
          std::copy(state.begin(), state.end(), h + ch * KV);
          T* vn = v_new + ch * C * V;
          const T* uc = u + ch * C * V;
          std::copy(uc, uc + C * V, vn);
          if (w) {
            const T* wc = w + ch * C * K;
            for (int64_t t = 0; t < C; ++t)
              for (int64_t k = 0; k < K; ++k) {
                const T a = wc[t * K + k];
                const T* row = state.data() + k * V;
                for (int64_t j = 0; j < V; ++j) vn[t * V + j] -= a * row[j];
              }
          }
          const T d = decay[ch];
          for (int64_t e = 0; e < KV; ++e) state[e] *= d;
          const T* kc = kd + ch * C * K;
          for (int64_t t = 0; t < C; ++t)
            for (int64_t k = 0; k < K; ++k) {
              const T a = kc[t * K + k];
              T* row = state.data() + k * V;
              for (int64_t j = 0; j < V; ++j) row[j] += a * vn[t * V + j];
            }
        }
        if (p.child_offsets[s + 1] > p.child_offsets[s])
          std::copy(state.begin(), state.end(), final_state + (s * H + head) * KV);
      }
    }
  }
}

template <typename T>
void backward_impl(const ChunkStatePassParams& p) {
  const int64_t H = p.heads, C = p.chunk, K = p.k_dim, V = p.v_dim, KV = K * V;
  // the workspace: the gradient entering each non-root segment
  const auto [w, u_, kd, decay, grad_h, grad_v_new, h_, v_new_, grad_u, grad_state, grad_init, state_grad_in] = Buffers<T>(p);
  std::vector<T> dS(static_cast<size_t>(KV)), next(static_cast<size_t>(KV));
  for (int64_t level = p.num_levels - 1; level >= 0; --level) {
    for (int64_t i = p.level_offsets[level]; i < p.level_offsets[level + 1]; ++i) {
      const int64_t s = p.level_segments[i];
      for (int64_t head = p.head_begin; head < head_end_of(p); ++head) {
        std::fill(dS.begin(), dS.end(), T(0));
        for (int64_t e = p.child_offsets[s]; e < p.child_offsets[s + 1]; ++e) {
          const T* src = state_grad_in + (p.children[e] * H + head) * KV;
          for (int64_t x = 0; x < KV; ++x) dS[x] += src[x];
        }
        for (int64_t c = p.seg_chunk_offsets[s + 1] - 1; c >= p.seg_chunk_offsets[s]; --c) {
          const int64_t ch = c * H + head;
          std::copy(dS.begin(), dS.end(), grad_state + ch * KV);
          T* dv = grad_u + ch * C * V;
          if (grad_v_new) {
            const T* g = grad_v_new + ch * C * V;
            std::copy(g, g + C * V, dv);
          } else {
            std::fill(dv, dv + C * V, T(0));
          }
          const T* kc = kd + ch * C * K;
          for (int64_t t = 0; t < C; ++t)
            for (int64_t k = 0; k < K; ++k) {
              const T a = kc[t * K + k];
              const T* row = dS.data() + k * V;
              for (int64_t j = 0; j < V; ++j) dv[t * V + j] += a * row[j];
            }
          const T d = decay[ch];
          if (grad_h) {
            const T* g = grad_h + ch * KV;
            for (int64_t x = 0; x < KV; ++x) next[x] = g[x] + d * dS[x];
          } else {
            for (int64_t x = 0; x < KV; ++x) next[x] = d * dS[x];
          }
          if (w) {
            const T* wc = w + ch * C * K;
            for (int64_t t = 0; t < C; ++t)
              for (int64_t k = 0; k < K; ++k) {
                const T a = wc[t * K + k];
                T* row = next.data() + k * V;
                for (int64_t j = 0; j < V; ++j) row[j] -= a * dv[t * V + j];
              }
          }
          dS.swap(next);
        }
        if (p.parents[s] >= 0)
          std::copy(dS.begin(), dS.end(), state_grad_in + (s * H + head) * KV);
        else if (grad_init)
          std::copy(dS.begin(), dS.end(), grad_init + (p.root_index[s] * H + head) * KV);
      }
    }
  }
}

template <typename Fn>
void run_cpu(const ChunkStatePassParams& p, bool backward, Fn&& fn) {
  check_chunk_state_params(p, backward);
  require(p.in == p.acc && (p.acc == ChunkDType::Float32 || p.acc == ChunkDType::Float64),
          std::string("the CPU kernels compute in float32 or float64 (inputs widened by the caller), got ") +
              chunk_dtype_name(p.in) + " inputs with " + chunk_dtype_name(p.acc) + " states");
  check_chunk_state_tables_cpu(p);
  if (p.num_chunks == 0 || p.heads == 0) return;
  if (p.acc == ChunkDType::Float32) fn(float{});
  else fn(double{});
}

}  // namespace

void check_chunk_state_params(const ChunkStatePassParams& p, bool backward) {
  require(p.num_chunks >= 0 && p.heads >= 0 && p.k_dim >= 0 && p.v_dim >= 0 && p.num_segments >= 0,
          "negative sizes");
  require(p.chunk >= 1 && p.chunk <= kChunkStateMaxChunk,
          "chunk length C = " + std::to_string(p.chunk) + " is outside 1.." + std::to_string(kChunkStateMaxChunk));
  require(p.acc == ChunkDType::Float32 || p.acc == ChunkDType::Float64, "state type must be float32 or float64");
  require(p.level_offsets && p.num_levels >= 0, "level_offsets are required");
  require(p.level_offsets[0] == 0 && p.level_offsets[p.num_levels] == p.num_segments,
          "level_offsets must run from 0 to the number of segments " + std::to_string(p.num_segments) + ", got " +
              std::to_string(p.level_offsets[0]) + ".." + std::to_string(p.level_offsets[p.num_levels]));
  for (int64_t l = 0; l < p.num_levels; ++l)
    require(p.level_offsets[l] <= p.level_offsets[l + 1], "level_offsets decrease at " + at("level_offsets", l + 1));
  const int64_t roots = p.num_levels > 0 ? p.level_offsets[1] : 0;
  require(p.num_segments == 0 || roots > 0, "level 0 (the roots) is empty");
  require(p.num_roots == roots, "num_roots " + std::to_string(p.num_roots) + " differs from the size of level 0 (" +
                                    std::to_string(roots) + ")");
  require(p.num_chunks >= p.num_segments, "fewer chunks than segments (every segment has at least one chunk)");
  const bool empty = p.num_chunks == 0 || p.heads == 0;
  require(p.num_segments == 0 || (p.seg_chunk_offsets && p.parents && p.root_index && p.level_segments && p.child_offsets &&
                                   (p.children || p.num_segments == roots)),
          "index tables are required");
  require(empty || ((backward || p.u) && p.kd && p.decay && p.h && p.v_new), "u, kd, decay, h and v_new are required");
  require(empty || p.num_segments == 0 || p.workspace, "workspace is required");
  if (backward) require(empty || (p.grad_u && p.grad_state), "grad_u and grad_state are required");
}

void check_chunk_state_tables_cpu(const ChunkStatePassParams& p) {
  const int64_t S = p.num_segments, R = p.num_roots;
  if (S == 0) {
    require(p.num_chunks == 0, "no segments but " + std::to_string(p.num_chunks) + " chunks");
    return;
  }
  const int64_t* off = p.seg_chunk_offsets;
  require(off[0] == 0, "seg_chunk_offsets[0] must be 0, got " + std::to_string(off[0]));
  for (int64_t s = 0; s < S; ++s)
    require(off[s + 1] > off[s], at("seg_chunk_offsets", s + 1) + " = " + std::to_string(off[s + 1]) +
                                     ": every segment needs at least one chunk (offsets must increase strictly)");
  require(off[S] == p.num_chunks, at("seg_chunk_offsets", S) + " = " + std::to_string(off[S]) +
                                      " must equal the number of chunks " + std::to_string(p.num_chunks));
  std::vector<int64_t> level(static_cast<size_t>(S), -1);
  for (int64_t l = 0; l < p.num_levels; ++l)
    for (int64_t i = p.level_offsets[l]; i < p.level_offsets[l + 1]; ++i) {
      const int64_t s = p.level_segments[i];
      require(s >= 0 && s < S, at("level_segments", i) + " = " + std::to_string(s) + " is outside [0, " +
                                   std::to_string(S) + ")");
      require(level[s] < 0, at("level_segments", i) + ": segment " + std::to_string(s) + " is listed twice");
      level[s] = l;
    }
  std::vector<char> root_seen(static_cast<size_t>(R), 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t parent = p.parents[s];
    require(parent >= -1 && parent < s, at("parents", s) + " = " + std::to_string(parent) +
                                            ", expected -1 or an earlier segment");
    if (parent < 0) {
      require(level[s] == 0, "segment " + std::to_string(s) + " is a root but level_segments puts it at level " +
                                 std::to_string(level[s]));
      const int64_t r = p.root_index[s];
      require(r >= 0 && r < R, at("root_index", s) + " = " + std::to_string(r) + " for a root, expected [0, " +
                                   std::to_string(R) + ")");
      require(!root_seen[r], at("root_index", s) + " = " + std::to_string(r) + " is used by two roots");
      root_seen[r] = 1;
    } else {
      require(level[s] == level[parent] + 1, "segment " + std::to_string(s) + " is at level " + std::to_string(level[s]) +
                                                 " in level_segments but its parent " + std::to_string(parent) +
                                                 " is at level " + std::to_string(level[parent]));
      require(p.root_index[s] == -1, at("root_index", s) + " = " + std::to_string(p.root_index[s]) +
                                         " for a non-root, expected -1");
    }
  }
  const int64_t* co = p.child_offsets;
  require(co[0] == 0, "child_offsets[0] must be 0");
  for (int64_t s = 0; s < S; ++s) require(co[s + 1] >= co[s], "child_offsets decrease at " + at("child_offsets", s + 1));
  require(co[S] == S - R, at("child_offsets", S) + " = " + std::to_string(co[S]) + ", expected the number of non-roots " +
                              std::to_string(S - R));
  std::vector<char> child_seen(static_cast<size_t>(S), 0);
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t e = co[s]; e < co[s + 1]; ++e) {
      const int64_t child = p.children[e];
      require(child >= 0 && child < S && p.parents[child] == s,
              at("children", e) + " = " + std::to_string(child) + " is not a child of segment " + std::to_string(s));
      require(!child_seen[child], at("children", e) + " = " + std::to_string(child) + " is listed twice");
      child_seen[child] = 1;
    }
  }
}

void chunk_state_pass_forward_cpu(const ChunkStatePassParams& params) {
  run_cpu(params, false, [&](auto tag) { forward_impl<decltype(tag)>(params); });
}

void chunk_state_pass_backward_cpu(const ChunkStatePassParams& params) {
  run_cpu(params, true, [&](auto tag) { backward_impl<decltype(tag)>(params); });
}

}  // namespace tree_recurrence::kernels
