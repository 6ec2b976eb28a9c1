// (b) of the fused GDN backward, per (chunk, value head), after the reverse state pass:
//   dP   = E * (dO v_new^T)                       (E_ij = exp(G_i - G_j), j <= i)
//   dq^  = exp(G) (dO h^T) + dP k^
//   dk^  = exp(G_last - G) (v_new dS^T) + dP^T q^  (dS: gradient of the state leaving the chunk)
//   dG_i = <dq^_i, q^_i> - <dk^_i, k^_i>, and dG_last += exp(G_last) <h, dS> + sum_j <kd part_j, k^_j>
// dq^, dk^ (fp32, chunk-major per value head) and dG go to workspaces; (c) adds the WY terms.
#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

// 16 warps per CTA (one CTA per SM at K = V = 128: latency-bound); tiles by cp.async, dP's
// operands (dO, v_new) in the first group, q^, k^, h, dS in the second.
constexpr int kDqkWarps = 16;
constexpr int kDqkThreads = kDqkWarps * 32;

template <typename T>
__global__ void __launch_bounds__(kDqkThreads) dqk_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const int64_t c = blockIdx.x, hv = blockIdx.y;
  const int64_t HV = p.hv, HK = p.hk, hk = hv / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldk = pitch_of(Kp), ldv = pitch_of(Vp);
  Smem sm{smem_raw};
  T* qh = sm.take<T>(C * ldk);
  T* kh = sm.take<T>(C * ldk);
  T* dO = sm.take<T>(C * ldv);
  T* vn = sm.take<T>(C * ldv);
  T* h = sm.take<T>(Kp * ldv);
  T* dS = sm.take<T>(Kp * ldv);
  T* dP = sm.take<T>(C * kPitchC);
  float* G = sm.take<float>(C);
  float* partQ = sm.take<float>(C * 8);
  float* partK = sm.take<float>(C * 8);
  float* red = sm.take<float>(kDqkThreads + 1);
  float* rqs = sm.take<float>(C);  // rq scale of the row's token (0 for padding rows)
  float* rks = sm.take<float>(C);
  int64_t* tok = sm.take<int64_t>(C);

  const int64_t ch = c * HV + hv;
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    G[i] = p.G[ch * C + i];
    const int64_t t = p.gather[c * C + i];
    tok[i] = t;
    rqs[i] = t >= 0 ? p.rq[t * HK + hk] * p.scale : 0.f;
    rks[i] = t >= 0 ? p.rk[t * HK + hk] * 1.f : 0.f;
  }
  __syncthreads();
  async_matrix<T>(dO, ldv, static_cast<const T*>(p.do_c) + ch * C * V, C, C, V, Vp);
  async_matrix<T>(vn, ldv, static_cast<const T*>(p.v_new) + ch * C * V, C, C, V, Vp);
  mma::cp_async_commit();
  async_token_rows<T>(qh, ldk, static_cast<const T*>(p.q), tok, HK, hk, K, Kp);
  async_token_rows<T>(kh, ldk, static_cast<const T*>(p.k), tok, HK, hk, K, Kp);
  async_matrix<T>(h, ldv, static_cast<const T*>(p.h) + ch * static_cast<int64_t>(K) * V, K, Kp, V, Vp);
  async_matrix<T>(dS, ldv, static_cast<const T*>(p.grad_state_out) + ch * static_cast<int64_t>(K) * V, K, Kp, V, Vp);
  mma::cp_async_commit();
  mma::cp_async_wait<1>();
  __syncthreads();

  const int warp = threadIdx.x / 32;
  // dP(i, j) = exp(G_i - G_j) <dO_i, v_new_j> for j <= i.
  for (int t = warp; t < (C / 16) * (C / 16); t += kDqkWarps) {
    const int r0 = (t / (C / 16)) * 16, c0 = (t % (C / 16)) * 16;
    FragC acc[1][2];
    zero(acc);
    if (r0 + 15 >= c0) tile_mma<T, true, false>(acc, dO, ldv, vn, ldv, r0, c0, Vp / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = el_row(r0, e), j = el_col(c0, nt, e);
        dP[i * kPitchC + j] = mma::Elem<T>::from_float(j <= i ? acc[0][nt].x[e] * expf(G[i] - G[j]) : 0.f);
      }
  }
  mma::cp_async_wait<0>();
  __syncthreads();
  scale_rows<T>(qh, ldk, Kp, rqs);  // q^ = scale rq q
  scale_rows<T>(kh, ldk, Kp, rks);  // k^ = rk k
  // <h, dS> (fixed per-thread order, then block_sum).
  float hds = 0.f;
  for (int idx = threadIdx.x; idx < K * V; idx += blockDim.x) {
    const int r = idx / V, col = idx % V;
    hds += mma::Elem<T>::to_float(h[r * ldv + col]) * mma::Elem<T>::to_float(dS[r * ldv + col]);
  }
  __syncthreads();

  const float g_last = G[C - 1];
  float* dq_out = p.dq_hv + ch * C * K;
  float* dk_out = p.dk_hv + ch * C * K;
  float kd_sum = 0.f;
  for (int t = warp; t < (C / 16) * (Kp / 16); t += kDqkWarps) {
    const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
    // dq^ = exp(G) (dO h^T) + dP k^
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, false>(acc, dO, ldv, h, ldv, r0, c0, Vp / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][nt].x[e] *= expf(G[el_row(r0, e)]);
    tile_mma<T, true, true>(acc, dP, kPitchC, kh, ldk, r0, c0, C / 16);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = el_row(r0, e), col = el_col(c0, nt, e);
        s[e >> 1] += acc[0][nt].x[e] * mma::Elem<T>::to_float(qh[i * ldk + col]);
        if (col < K) dq_out[i * K + col] = acc[0][nt].x[e];
      }
    tile_rowdot_store(s[0], s[1], partQ, r0, c0);

    // dk^ = exp(G_last - G) (v_new dS^T) + dP^T q^
    zero(acc);
    tile_mma<T, true, false>(acc, vn, ldv, dS, ldv, r0, c0, Vp / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        acc[0][nt].x[e] *= expf(g_last - G[j]);
        kd_sum += acc[0][nt].x[e] * mma::Elem<T>::to_float(kh[j * ldk + col]);
      }
    tile_mma<T, false, true>(acc, dP, kPitchC, qh, ldk, r0, c0, C / 16);
    s[0] = s[1] = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        s[e >> 1] += acc[0][nt].x[e] * mma::Elem<T>::to_float(kh[j * ldk + col]);
        if (col < K) dk_out[j * K + col] = acc[0][nt].x[e];
      }
    tile_rowdot_store(s[0], s[1], partK, r0, c0);
  }
  const float hds_all = block_sum<kDqkThreads>(hds, red);  // (contains __syncthreads: parts are complete after it)
  const float kd_all = block_sum<kDqkThreads>(kd_sum, red);
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float d = row_parts(partQ, i, Kp / 16) - row_parts(partK, i, Kp / 16);
    if (i == C - 1) d += expf(g_last) * hds_all + kd_all;
    p.dG[ch * C + i] = d;
  }
}

size_t dqk_smem(const GdnBwdParams& p) {
  const int Kp = round16(static_cast<int>(p.k_dim)), ldk = pitch_of(Kp), ldv = pitch_of(round16(static_cast<int>(p.v_dim)));
  return 2 * smem_bytes<uint16_t>(C * ldk) + 2 * smem_bytes<uint16_t>(C * ldv) + 2 * smem_bytes<uint16_t>(Kp * ldv) +
         smem_bytes<uint16_t>(C * kPitchC) + smem_bytes<float>(C) + 2 * smem_bytes<float>(C * 8) +
         smem_bytes<float>(kDqkThreads + 1) + 2 * smem_bytes<float>(C) + smem_bytes<int64_t>(C);
}

template <typename T>
const char* launch(const GdnBwdParams& p, void* stream) {
  if (p.num_chunks == 0) return "";
  const size_t bytes = dqk_smem(p);
  cudaError_t e = cudaFuncSetAttribute(dqk_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  dqk_kernel<T><<<dim3(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.hv)), kDqkThreads, bytes,
                  static_cast<cudaStream_t>(stream)>>>(p);
  return launch_error();
}

}  // namespace
}  // namespace bwd

const char* gdn_bwd_dqk(const GdnBwdParams& p, void* stream) {
  return p.in == BwdDType::BFloat16 ? bwd::launch<__nv_bfloat16>(p, stream) : bwd::launch<__half>(p, stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
