// (a) of the fused GDN backward, per (chunk, value head), before the reverse state pass:
//   dv_local_j = sum_{i >= j} exp(G_i - G_j) <q^_i, k^_j> dO_i   (Pt = (E * q^ k^T)^T, then Pt dO)
//   q_g = exp(G) q^ and dO in chunk-major layout (the pass reads both).
#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) dv_local_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const int64_t c = blockIdx.x, hv = blockIdx.y;
  const int64_t HV = p.hv, HK = p.hk, hk = hv / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldk = pitch_of(Kp), ldv = pitch_of(Vp);
  Smem sm{smem_raw};
  T* qh = sm.take<T>(C * ldk);
  T* kh = sm.take<T>(C * ldk);
  T* dO = sm.take<T>(C * ldv);
  T* Pt = sm.take<T>(C * kPitchC);
  float* G = sm.take<float>(C);
  int64_t* tok = sm.take<int64_t>(C);

  const int64_t ch = c * HV + hv;  // (chunk, head) tile index
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    G[i] = p.G[ch * C + i];
    tok[i] = p.gather[c * C + i];
  }
  __syncthreads();
  load_token_rows<T, true>(qh, ldk, static_cast<const T*>(p.q), tok, HK, hk, K, Kp, p.rq, HK, hk, p.scale);
  load_token_rows<T, true>(kh, ldk, static_cast<const T*>(p.k), tok, HK, hk, K, Kp, p.rk, HK, hk, 1.f);
  load_token_rows<T, false>(dO, ldv, static_cast<const T*>(p.grad_o), tok, HV, hv, V, Vp, nullptr, 0, 0, 1.f);
  __syncthreads();

  // q_g and dO chunk-major (q_g from the rounded q^, times exp(G_i) <= 1).
  {
    T* qg = static_cast<T*>(p.q_g) + ch * C * K;
    for (int idx = threadIdx.x; idx < C * K; idx += blockDim.x) {
      const int i = idx / K, col = idx % K;
      qg[idx] = mma::Elem<T>::from_float(mma::Elem<T>::to_float(qh[i * ldk + col]) * expf(G[i]));
    }
    T* doc = static_cast<T*>(p.do_c) + ch * C * V;
    for (int idx = threadIdx.x; idx < C * V; idx += blockDim.x) doc[idx] = dO[(idx / V) * ldv + idx % V];
  }

  const int warp = threadIdx.x / 32;
  // Pt(j, i) = exp(G_i - G_j) <k^_j, q^_i> for i >= j, else 0.
  for (int t = warp; t < (C / 16) * (C / 16); t += kWarps) {
    const int r0 = (t / (C / 16)) * 16, c0 = (t % (C / 16)) * 16;
    FragC acc[1][2];
    zero(acc);
    if (c0 + 15 >= r0) tile_mma<T, true, false>(acc, kh, ldk, qh, ldk, r0, c0, Kp / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), i = el_col(c0, nt, e);
        const float val = i >= j ? acc[0][nt].x[e] * expf(G[i] - G[j]) : 0.f;
        Pt[j * kPitchC + i] = mma::Elem<T>::from_float(val);
      }
  }
  __syncthreads();
  // dv_local = Pt dO.
  T* out = static_cast<T*>(p.dv_local) + ch * C * V;
  for (int t = warp; t < (C / 16) * (Vp / 16); t += kWarps) {
    const int r0 = (t / (Vp / 16)) * 16, c0 = (t % (Vp / 16)) * 16;
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, true>(acc, Pt, kPitchC, dO, ldv, r0, c0, C / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        if (col < V) out[j * V + col] = mma::Elem<T>::from_float(acc[0][nt].x[e]);
      }
  }
}

size_t dv_local_smem(const GdnBwdParams& p) {
  const int ldk = pitch_of(round16(static_cast<int>(p.k_dim))), ldv = pitch_of(round16(static_cast<int>(p.v_dim)));
  return 2 * smem_bytes<uint16_t>(C * ldk) + smem_bytes<uint16_t>(C * ldv) + smem_bytes<uint16_t>(C * kPitchC) +
         smem_bytes<float>(C) + smem_bytes<int64_t>(C);
}

template <typename T>
const char* launch(const GdnBwdParams& p, void* stream) {
  if (p.num_chunks == 0) return "";
  const size_t bytes = dv_local_smem(p);
  cudaError_t e = cudaFuncSetAttribute(dv_local_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  dv_local_kernel<T><<<dim3(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.hv)), kThreads, bytes,
                       static_cast<cudaStream_t>(stream)>>>(p);
  return launch_error();
}

}  // namespace
}  // namespace bwd

const char* gdn_bwd_dv_local(const GdnBwdParams& p, void* stream) {
  return p.in == BwdDType::BFloat16 ? bwd::launch<__nv_bfloat16>(p, stream) : bwd::launch<__half>(p, stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
