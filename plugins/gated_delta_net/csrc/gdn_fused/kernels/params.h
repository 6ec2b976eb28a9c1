// POD parameter blocks and launchers of the fused GDN forward kernels: prep_fwd.cu and
// out_fwd.cu. No ATen: the only header the .cu files share with gdn_fused_fwd.cpp. Math and buffer
// layouts: ../gdn_fused.h. All pointers are device pointers to contiguous row-major arrays, 16-byte
// aligned (q, k, v, and every in-type buffer); K and V are multiples of 8, 8..128.
#pragma once

#include <cstdint>

#include "tree_recurrence/kernels/dtype.h"

namespace tree_recurrence::gdn::fused::kernels {

enum class InType { BFloat16, Float16 };

constexpr int kChunk = 64;
constexpr int kMaxDim = 128;

// Stage 1 (grid tile_grid: value head fastest, 128 threads): per chunk and value head, from the
// chunk's rows (gather, -1 = pad: k = v = 0, g = beta = 0):
//   G (NC, HV, C) f32, Ainv (NC, HV, C, C) in, w (NC, HV, C, K) in, u (NC, HV, C, V) in,
//   kd (NC, HV, C, K) in, decay (NC, HV) f32; rk (T, HK) f32 (written by the hv % groups == 0 block
//   of each key head; 1 without l2norm). q is not read here: rq is written by stage 3, which loads q.
struct PrepParams {
  int64_t num_chunks = 0;  // NC
  int64_t tokens = 0;      // T
  int key_heads = 0;       // HK
  int value_heads = 0;     // HV (multiple of HK)
  int k_dim = 0;           // K
  int v_dim = 0;           // V
  bool l2norm = true;      // q and k l2-normalised first (fused_host.h: set_scalars)
  InType in = InType::BFloat16;

  const int64_t* gather = nullptr;  // (NC, C)
  const void* k = nullptr;          // (T, HK, K) in
  const void* v = nullptr;          // (T, HV, V) in
  const void* g = nullptr;          // (T, HV) of g_type
  const void* beta = nullptr;       // (T, HV) of beta_type
  // float32, bfloat16 or float16 each, read as they are (widened to fp32 exactly: no cast copy)
  tree_recurrence::kernels::DType g_type = tree_recurrence::kernels::DType::Float32;
  tree_recurrence::kernels::DType beta_type = tree_recurrence::kernels::DType::Float32;

  float* G = nullptr;
  void* Ainv = nullptr;
  void* w = nullptr;
  void* u = nullptr;
  void* kd = nullptr;
  float* decay = nullptr;
  float* rk = nullptr;
};

// Stage 3 (grid tile_grid, 256 threads: 4 row blocks x 2 column halves of 64):
//   o_i = exp(G_i) q^_i h[c] + sum_{j <= i} exp(G_i - G_j) <q^_i, k^_j> v_new_j, q^ = l2norm(q) scale,
//   k^ = l2norm(k) (recomputed bit for bit as prep_fwd computes them), written at token gather[c][i]
//   of o (T, HV, V) in the input type; rq (T, HK) f32, q's norm factor (1 without l2norm), by the
//   hv % groups == 0 block of each key head.
struct OutParams {
  int64_t num_chunks = 0;
  int64_t tokens = 0;
  int key_heads = 0;
  int value_heads = 0;
  int k_dim = 0;
  int v_dim = 0;
  float scale = 1.f;
  bool l2norm = true;      // q and k l2-normalised first (fused_host.h: set_scalars)
  InType in = InType::BFloat16;

  const int64_t* gather = nullptr;  // (NC, C)
  const void* q = nullptr;          // (T, HK, K) in
  const void* k = nullptr;          // (T, HK, K) in
  const float* G = nullptr;         // (NC, HV, C)
  const void* h = nullptr;          // (NC, HV, K, V) in
  const void* v_new = nullptr;      // (NC, HV, C, V) in
  void* o = nullptr;                // (T, HV, V) in
  float* rq = nullptr;              // (T, HK)
};

// Return an empty string on success, else the launch error (no host sync).
const char* launch_prep_fwd(const PrepParams& p, void* cuda_stream);
const char* launch_out_fwd(const OutParams& p, void* cuda_stream);

}  // namespace tree_recurrence::gdn::fused::kernels
