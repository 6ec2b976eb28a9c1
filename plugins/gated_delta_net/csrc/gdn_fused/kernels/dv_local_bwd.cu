// (a) of the fused GDN backward, per (chunk, value head), before the reverse state pass:
//   dv_local_j = sum_{i >= j} exp(G_i - G_j) <q^_i, k^_j> dO_i   (Pt = (E * q^ k^T)^T, then Pt dO)
//   q_g = exp(G) q^ in chunk-major layout (the pass reads it); dO is read at the tokens (grad_o
//   through gather, pads zero).
#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

// 8 warps per CTA, about 53 KB of shared memory at K = V = 128 (4 CTAs per SM, <= 64 registers);
// tiles by cp.async; Pt is computed into registers and, after a barrier, written over the dead
// q^ / k^ rows; dv_local is staged in the dead dO rows and leaves with 16-byte stores, q_g 16 bytes
// at a time.
constexpr int kDvWarps = 8;
constexpr int kDvThreads = kDvWarps * 32;

__host__ __device__ inline size_t bytes16(size_t n) { return (n + 15) / 16 * 16; }
// bytes of the q^ / k^ region (later Pt): 2 tiles of C x ldk in-type elements, at least C x kPitchC
__host__ __device__ inline size_t dv_qk_region(int64_t k_dim) {
  const int ldk = pitch_of(round16(static_cast<int>(k_dim)));
  const size_t qk = 2 * bytes16(2 * static_cast<size_t>(C) * ldk), pt = bytes16(2 * static_cast<size_t>(C) * kPitchC);
  return qk > pt ? qk : pt;
}
size_t dv_local_smem(const GdnBwdParams& p) {
  const int ldv = pitch_of(round16(static_cast<int>(p.v_dim)));
  return dv_qk_region(p.k_dim) + smem_bytes<uint16_t>(C * ldv) + 3 * smem_bytes<float>(C) + smem_bytes<int64_t>(C);
}

template <typename T>
__global__ void __launch_bounds__(kDvThreads, 4) dv_local_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const int64_t c = blockIdx.x, hv = blockIdx.y;
  const int64_t HV = p.hv, HK = p.hk, hk = hv / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldk = pitch_of(Kp), ldv = pitch_of(Vp);
  Smem sm{smem_raw};
  char* region = sm.take<char>(dv_qk_region(p.k_dim));
  T* qh = reinterpret_cast<T*>(region);
  T* kh = qh + bytes16(2 * static_cast<size_t>(C) * ldk) / sizeof(T);
  T* Pt = qh;  // after the barrier that ends every read of q^, k^
  T* dO = sm.take<T>(C * ldv);
  float* G = sm.take<float>(C);
  float* rqs = sm.take<float>(C);
  float* rks = sm.take<float>(C);
  int64_t* tok = sm.take<int64_t>(C);

  const int64_t ch = c * HV + hv;
  row_tables(p, c, ch, hk, G, tok, rqs, rks);
  async_token_rows<T>(qh, ldk, static_cast<const T*>(p.q), tok, HK, hk, K, Kp);
  async_token_rows<T>(kh, ldk, static_cast<const T*>(p.k), tok, HK, hk, K, Kp);
  async_token_rows<T>(dO, ldv, static_cast<const T*>(p.grad_o), tok, HV, hv, V, Vp);
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();
  scale_rows<T>(qh, ldk, Kp, rqs);
  scale_rows<T>(kh, ldk, Kp, rks);
  __syncthreads();

  {
    T* qg = static_cast<T*>(p.q_g) + ch * C * K;
    for (int idx = threadIdx.x; idx < C * (K / 8); idx += blockDim.x) {
      const int i = idx / (K / 8), c8 = (idx % (K / 8)) * 8;
      uint4 val = *reinterpret_cast<const uint4*>(qh + i * ldk + c8);
      const float eg = expf(G[i]);
      T* e = reinterpret_cast<T*>(&val);
#pragma unroll
      for (int m = 0; m < 8; ++m) e[m] = mma::Elem<T>::from_float(mma::Elem<T>::to_float(e[m]) * eg);
      *reinterpret_cast<uint4*>(qg + i * K + c8) = val;
    }
  }

  const int warp = threadIdx.x / 32;
  // Pt tiles t = warp, warp + 8 (16 tiles of 16 x 16) in registers, then over q^ / k^
  constexpr int kPtPer = (C / 16) * (C / 16) / kDvWarps;  // 2
  FragC pacc[kPtPer][1][2];
#pragma unroll
  for (int n = 0; n < kPtPer; ++n) {
    const int t = warp + n * kDvWarps;
    const int r0 = (t / (C / 16)) * 16, c0 = (t % (C / 16)) * 16;
    zero(pacc[n]);
    if (c0 + 15 >= r0) tile_mma<T, true, false>(pacc[n], kh, ldk, qh, ldk, r0, c0, Kp / 16);
  }
  __syncthreads();  // every read of q^, k^ done: Pt goes over them
#pragma unroll
  for (int n = 0; n < kPtPer; ++n) {
    const int t = warp + n * kDvWarps;
    const int r0 = (t / (C / 16)) * 16, c0 = (t % (C / 16)) * 16;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), i = el_col(c0, nt, e);
        const float val = i >= j ? pacc[n][0][nt].x[e] * expf(G[i] - G[j]) : 0.f;
        Pt[j * kPitchC + i] = mma::Elem<T>::from_float(val);
      }
  }
  __syncthreads();
  // dv_local = Pt dO: up to 4 tiles per warp in registers; after a barrier staged over dO
  constexpr int kDvPer = (C / 16) * (128 / 16) / kDvWarps;  // 4 (V <= 128)
  const int ntiles = (C / 16) * (Vp / 16);
  FragC acc[kDvPer][1][2];
#pragma unroll
  for (int n = 0; n < kDvPer; ++n) zero(acc[n]);
  for_warp_tiles<kDvPer, kDvWarps>(warp, ntiles, Vp / 16, [&](int n, int r0, int c0) {
    tile_mma<T, true, true>(acc[n], Pt, kPitchC, dO, ldv, r0, c0, C / 16);
  });
  __syncthreads();  // every read of dO done
  for_warp_tiles<kDvPer, kDvWarps>(warp, ntiles, Vp / 16, [&](int n, int r0, int c0) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        *reinterpret_cast<uint32_t*>(dO + j * ldv + col) = mma::Elem<T>::pack(acc[n][0][nt].x[e], acc[n][0][nt].x[e + 1]);
      }
  });
  __syncthreads();
  T* out = static_cast<T*>(p.dv_local) + ch * C * V;
  for (int idx = threadIdx.x; idx < C * (V / 8); idx += blockDim.x) {
    const int i = idx / (V / 8), c8 = (idx % (V / 8)) * 8;
    *reinterpret_cast<uint4*>(out + i * V + c8) = *reinterpret_cast<const uint4*>(dO + i * ldv + c8);
  }
}

}  // namespace
}  // namespace bwd

const char* gdn_bwd_dv_local(const GdnBwdParams& p, void* stream) {
  using namespace bwd;
  return launch_chunks(dv_local_kernel<__nv_bfloat16>, dv_local_kernel<__half>, kDvThreads, dv_local_smem(p), p, stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
