// POD parameters and launchers of the fused GDN backward's chunk-local kernels. No ATen:
// gdn_fused_bwd.cpp fills these from the tensors; the .cu files include only this header,
// <cuda_*.h> and the SDK's mma.cuh. Math and buffer layouts: ../gdn_fused.h and
// tests/python/gdn_bwd_reference.py (the float64 twin of every stage).
//
// Order (one launch each; dO is read at the tokens, grad_o through gather, pads zero):
//   gdn_bwd_dv_local  (a)  dv_local = (E * q^ k^T)^T dO, q_g = exp(G) q^
//   chunk_state_pass_tc_backward (SDK): grad_state_out (dS), dv_total (over dv_local), grad_initial
//   gdn_bwd_dqk       (b)  dq_hv per key head (summed over its value heads), dk_hv (intra-chunk + kd
//                          part), dG (fp32)
//   gdn_bwd_wy        (c)  the WY backward: dv, dbeta, dk_hv +=, dG +=, dg = reverse cumsum of dG
//   gdn_bwd_finalize  (d)  dq, dk at the tokens: dk's value heads of a key head summed in order, scale,
//                          l2norm backward (one warp per (token, key head))
// Everything deterministic (fixed reduction order, no atomics); 64-bit offsets.
#pragma once

#include <cstdint>

namespace tree_recurrence::gdn::fused::kernels {

constexpr int kBwdChunk = 64;  // C
constexpr int kBwdMaxDim = 128;  // K, V <= 128, multiples of 8

enum class BwdDType { BFloat16, Float16 };

struct GdnBwdParams {
  int64_t num_chunks = 0;  // NC
  int64_t tokens = 0;      // T
  int64_t hk = 0, hv = 0;  // key heads, value heads (hv a multiple of hk)
  int64_t k_dim = 0, v_dim = 0;
  float scale = 1.f;       // the scale already resolved (1/sqrt(K) when the op got 0)
  bool l2norm = true;      // q and k l2-normalised first (fused_host.h: set_scalars)
  BwdDType in = BwdDType::BFloat16;

  const int64_t* gather = nullptr;   // (NC, C) token or -1
  const int64_t* scatter = nullptr;  // (T) flat chunk position c * C + i

  // token-major inputs (in-type unless said)
  const void* q = nullptr;        // (T, HK, K)
  const void* k = nullptr;        // (T, HK, K)
  const void* v = nullptr;        // (T, HV, V)
  const void* grad_o = nullptr;   // (T, HV, V), read by (a) and (b) through gather
  const float* beta = nullptr;    // (T, HV) fp32
  const float* rq = nullptr;      // (T, HK)
  const float* rk = nullptr;      // (T, HK)

  // saved by the forward (chunk-major)
  const float* G = nullptr;       // (NC, HV, C)
  const void* Ainv = nullptr;     // (NC, HV, C, C)
  const void* w = nullptr;        // (NC, HV, C, K)
  const void* h = nullptr;        // (NC, HV, K, V)
  const void* v_new = nullptr;    // (NC, HV, C, V)

  // (a) outputs, (b) inputs
  void* dv_local = nullptr;       // (NC, HV, C, V) in
  void* q_g = nullptr;            // (NC, HV, C, K) in
  // from the state pass
  const void* grad_state_out = nullptr;  // (NC, HV, K, V) in
  const void* dv_total = nullptr;        // (NC, HV, C, V) in

  // (b) / (c) workspaces, fp32 chunk-major
  float* dq_hv = nullptr;   // (NC, HK, C, K) gradient wrt q^, summed over the value heads of each key
                            // head (in increasing order, from 0)
  float* dk_hv = nullptr;   // (NC, HV, C, K) gradient wrt k^ of each value head
  float* dG = nullptr;      // (NC, HV, C)   gradient wrt the chunk-local cumulative G

  // (c) / (d) outputs at the tokens: dv, dq, dk in-type (final there: no fp32 copy, no cast),
  // dbeta, dg fp32 (the caller casts)
  void* dv = nullptr;       // (T, HV, V) in
  float* dbeta = nullptr;   // (T, HV)
  float* dg = nullptr;      // (T, HV)
  void* dq = nullptr;       // (T, HK, K) in
  void* dk = nullptr;       // (T, HK, K) in
};

// Each returns "" on success, else the CUDA error string (no host sync).
const char* gdn_bwd_dv_local(const GdnBwdParams& p, void* stream);
const char* gdn_bwd_dqk(const GdnBwdParams& p, void* stream);
const char* gdn_bwd_wy(const GdnBwdParams& p, void* stream);
const char* gdn_bwd_finalize(const GdnBwdParams& p, void* stream);

}  // namespace tree_recurrence::gdn::fused::kernels
