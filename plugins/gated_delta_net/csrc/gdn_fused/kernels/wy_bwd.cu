// (c) of the fused GDN backward, per (chunk, value head): the WY backward and the gate gradient.
// With du = dv_total, dw = -dv_total h^T, kb = beta exp(G) k^, vb = beta v, u = Ainv vb:
//   dvb = Ainv^T du, dkb = Ainv^T dw = -dvb h^T, dA = -(dkb w^T + dvb u^T) strictly lower
//   dAE = dA * exp(G_i - G_j), W2 = dAE * (k^ k^T), dKK = beta_i dAE
//   dk^ += beta exp(G) dkb + dKK k^ + dKK^T k^        (onto (b)'s dk_hv)
//   dv   = beta dvb                                   (at the tokens, in-type)
//   dbeta = <dvb, v> + exp(G) <dkb, k^> + rowsum(W2)
//   dG  += beta exp(G) <dkb, k^> + beta rowsum(W2) - colsum(beta W2) (written back: the total);
//   dg = reverse cumsum of dG
// (every dG term here is a genuine exp(G_a - G_b) term with a != b, or exp(G_i) itself: nothing cancels.)
#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

// 16 warps per CTA, two CTAs per SM (~101 KB of shared memory at K = V = 128). Regions reused
// across the phases:
//   R12: dv_total | vb (phase 1) -> h (phase 2) -> W2 (fp32) | w (phases 3-4)
//   Ai (phase 1) -> dKK (phases 3-4);  R5: u (phases 1-2a) -> dkb (phases 2b-4);  dvb, k^ own.
// dkb = -dvb h^T (equal to Ainv^T dw, without dw's product and buffer). (b)'s dk^ is read and
// written once, in phase 4.
constexpr int kWyWarps = 16;
constexpr int kWyThreads = kWyWarps * 32;
static_assert((C / 16) * (C / 16) == kWyWarps, "wy: one C x C tile of dA per warp");

__host__ __device__ inline size_t wy_w2_bytes() { return (static_cast<size_t>(C) * (C + 1) * 4 + 15) / 16 * 16; }
__host__ __device__ inline size_t wy_r12_bytes(int Kp, int ldk, int ldv) {
  const size_t a = 2 * static_cast<size_t>(C) * ldv * 2, b = static_cast<size_t>(Kp) * ldv * 2,
               c = wy_w2_bytes() + static_cast<size_t>(C) * ldk * 2;
  const size_t m = a > b ? a : b;
  return m > c ? m : c;
}
__host__ __device__ inline size_t wy_r5_bytes(int ldk, int ldv) {
  return static_cast<size_t>(C) * (ldk > ldv ? ldk : ldv) * 2;
}

template <typename T>
__global__ void __launch_bounds__(kWyThreads, 2) wy_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const int64_t c = blockIdx.x, hv = blockIdx.y;
  const int64_t HV = p.hv, HK = p.hk, hk = hv / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldk = pitch_of(Kp), ldv = pitch_of(Vp);
  Smem sm{smem_raw};
  char* R12 = sm.take<char>(wy_r12_bytes(Kp, ldk, ldv));
  T* dvt = reinterpret_cast<T*>(R12);
  T* vb = dvt + C * ldv;
  T* h = reinterpret_cast<T*>(R12);
  float* W2 = reinterpret_cast<float*>(R12);
  T* w = reinterpret_cast<T*>(R12 + wy_w2_bytes());
  T* Ai = sm.take<T>(C * kPitchC);
  T* dKK = Ai;
  T* dvb = sm.take<T>(C * ldv);
  char* R5 = sm.take<char>(wy_r5_bytes(ldk, ldv));
  T* u = reinterpret_cast<T*>(R5);
  T* dkb = reinterpret_cast<T*>(R5);
  T* kh = sm.take<T>(C * ldk);
  float* G = sm.take<float>(C);
  float* beta = sm.take<float>(C);
  float* dGs = sm.take<float>(C);
  float* partV = sm.take<float>(C * 8);
  float* partKB = sm.take<float>(C * 8);
  float* rks = sm.take<float>(C);    // rk of the row's token (0 for padding rows)
  float* dGin = sm.take<float>(C);   // (b)'s dG
  float* rowW = sm.take<float>(C);   // rowsum(W2)
  float* colW = sm.take<float>(C);   // colsum(beta W2)
  int64_t* tok = sm.take<int64_t>(C);

  const int64_t ch = c * HV + hv;
  const T* v = static_cast<const T*>(p.v);
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    G[i] = p.G[ch * C + i];
    dGin[i] = p.dG[ch * C + i];
    const int64_t t = p.gather[c * C + i];
    tok[i] = t;
    beta[i] = t >= 0 ? p.beta[t * HV + hv] : 0.f;
    rks[i] = t >= 0 ? p.rk[t * HK + hk] : 0.f;
  }
  __syncthreads();
  // group 0: phase 1's operands; group 1: k^
  async_matrix<T>(Ai, kPitchC, static_cast<const T*>(p.Ainv) + ch * C * C, C, C, C, C);
  async_matrix<T>(dvt, ldv, static_cast<const T*>(p.dv_total) + ch * C * V, C, C, V, Vp);
  async_token_rows<T>(vb, ldv, v, tok, HV, hv, V, Vp);
  mma::cp_async_commit();
  async_token_rows<T>(kh, ldk, static_cast<const T*>(p.k), tok, HK, hk, K, Kp);
  mma::cp_async_commit();
  mma::cp_async_wait<1>();
  __syncthreads();
  scale_rows<T>(vb, ldv, Vp, beta);  // vb = beta v (in place)
  __syncthreads();

  const int warp = threadIdx.x / 32;
  T* dv_out = static_cast<T*>(p.dv);
  // Phase 1: dvb = Ainv^T dv_total and u = Ainv vb (C x V); dv = beta dvb at the tokens.
  for (int t = warp; t < (C / 16) * (Vp / 16); t += kWyWarps) {
    const int r0 = (t / (Vp / 16)) * 16, c0 = (t % (Vp / 16)) * 16;
    float vv[2][4];  // v at the tokens, fetched before the MMAs
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        const int64_t tj = tok[j];
        vv[nt][e] = (tj >= 0 && col < V) ? mma::Elem<T>::to_float(v[(tj * HV + hv) * V + col]) : 0.f;
      }
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, false, true>(acc, Ai, kPitchC, dvt, ldv, r0, c0, C / 16);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        const float x = acc[0][nt].x[e];
        dvb[j * ldv + col] = mma::Elem<T>::from_float(x);
        const int64_t tj = tok[j];
        if (tj >= 0 && col < V) {
          dv_out[(tj * HV + hv) * V + col] = mma::Elem<T>::from_float(beta[j] * x);
          s[e >> 1] += x * vv[nt][e];
        }
      }
    tile_rowdot_store(s[0], s[1], partV, r0, c0);
    zero(acc);
    tile_mma<T, true, true>(acc, Ai, kPitchC, vb, ldv, r0, c0, C / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        u[el_row(r0, e) * ldv + el_col(c0, nt, e)] = mma::Elem<T>::from_float(acc[0][nt].x[e]);
  }
  __syncthreads();  // dv_total, vb, Ainv are dead: R12 takes h
  async_matrix<T>(h, ldv, static_cast<const T*>(p.h) + ch * static_cast<int64_t>(K) * V, K, Kp, V, Vp);
  mma::cp_async_commit();
  // Phase 2a (while h arrives): the warp's C x C tile of dvb u^T (held in registers until phase 3).
  const int ar0 = (warp / (C / 16)) * 16, ac0 = (warp % (C / 16)) * 16;
  const bool lower = ar0 + 15 > ac0;
  FragC accA[1][2];
  zero(accA);
  if (lower) tile_mma<T, true, false>(accA, dvb, ldv, u, ldv, ar0, ac0, Vp / 16);
  mma::cp_async_wait<0>();  // k^ and h
  __syncthreads();          // u is dead: R5 takes dkb
  scale_rows<T>(kh, ldk, Kp, rks);  // k^ = rk k
  __syncthreads();

  // Phase 2b: dkb = -dvb h^T (C x K); partKB: <dkb, k^> (fp32 dkb).
  for (int t = warp; t < (C / 16) * (Kp / 16); t += kWyWarps) {
    const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, false>(acc, dvb, ldv, h, ldv, r0, c0, Vp / 16);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        const float x = -acc[0][nt].x[e];
        dkb[j * ldk + col] = mma::Elem<T>::from_float(x);
        s[e >> 1] += x * mma::Elem<T>::to_float(kh[j * ldk + col]);
      }
    tile_rowdot_store(s[0], s[1], partKB, r0, c0);
  }
  __syncthreads();  // h is dead: R12 takes W2 | w
  async_matrix<T>(w, ldk, static_cast<const T*>(p.w) + ch * C * K, C, C, K, Kp);
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();

  // Phase 3: dA = -(dvb u^T + dkb w^T), KK = k^ k^T, strictly lower: W2 and dKK (into Ainv's place).
  {
    FragC kk[1][2];
    zero(kk);
    if (lower) {
      tile_mma<T, true, false>(accA, dkb, ldk, w, ldk, ar0, ac0, Kp / 16);
      tile_mma<T, true, false>(kk, kh, ldk, kh, ldk, ar0, ac0, Kp / 16);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = el_row(ar0, e), j = el_col(ac0, nt, e);
        const float dae = j < i ? -accA[0][nt].x[e] * expf(G[i] - G[j]) : 0.f;
        W2[i * (C + 1) + j] = dae * kk[0][nt].x[e];
        dKK[i * kPitchC + j] = mma::Elem<T>::from_float(beta[i] * dae);
      }
  }
  __syncthreads();

  // Phase 4: dk^ = (b)'s dk^ + beta exp(G) dkb + dKK k^ + dKK^T k^, read and written once; rowsum /
  // colsum of W2 split over two thread ranges; then dbeta, dG, dg.
  float* dk_io = p.dk_hv + ch * C * K;
  for (int t = warp; t < (C / 16) * (Kp / 16); t += kWyWarps) {
    const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
    float prev[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        prev[nt][e] = col < K ? dk_io[j * K + col] : 0.f;
      }
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, true>(acc, dKK, kPitchC, kh, ldk, r0, c0, C / 16);
    tile_mma<T, false, true>(acc, dKK, kPitchC, kh, ldk, r0, c0, C / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        const float kbj = beta[j] * expf(G[j]) * mma::Elem<T>::to_float(dkb[j * ldk + col]);
        if (col < K) dk_io[j * K + col] = (prev[nt][e] + kbj) + acc[0][nt].x[e];
      }
  }
  if (threadIdx.x < C) {
    const int i = threadIdx.x;
    float row = 0.f;
    for (int j = 0; j < C; ++j) row += W2[i * (C + 1) + j];
    rowW[i] = row;
  } else if (threadIdx.x < 2 * C) {
    const int i = threadIdx.x - C;
    float colsum = 0.f;
    for (int m = 0; m < C; ++m) colsum += beta[m] * W2[m * (C + 1) + i];
    colW[i] = colsum;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    const float row = rowW[i], colsum = colW[i];
    const float eg = expf(G[i]), kb = row_parts(partKB, i, Kp / 16);
    const float db = row_parts(partV, i, Vp / 16) + eg * kb + row;
    dGs[i] = dGin[i] + beta[i] * eg * kb + beta[i] * row - colsum;
    p.dG[ch * C + i] = dGs[i];  // the total
    if (tok[i] >= 0) p.dbeta[tok[i] * HV + hv] = db;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float s = 0.f;
    for (int m = C - 1; m >= i; --m) s += dGs[m];
    if (tok[i] >= 0) p.dg[tok[i] * HV + hv] = s;
  }
}

size_t wy_smem(const GdnBwdParams& p) {
  const int Kp = round16(static_cast<int>(p.k_dim)), ldk = pitch_of(Kp), ldv = pitch_of(round16(static_cast<int>(p.v_dim)));
  return smem_bytes<char>(wy_r12_bytes(Kp, ldk, ldv)) + smem_bytes<uint16_t>(C * kPitchC) + smem_bytes<uint16_t>(C * ldv) +
         smem_bytes<char>(wy_r5_bytes(ldk, ldv)) + smem_bytes<uint16_t>(C * ldk) + 3 * smem_bytes<float>(C) +
         2 * smem_bytes<float>(C * 8) + 4 * smem_bytes<float>(C) + smem_bytes<int64_t>(C);
}

template <typename T>
const char* launch(const GdnBwdParams& p, void* stream) {
  if (p.num_chunks == 0) return "";
  const size_t bytes = wy_smem(p);
  cudaError_t e = cudaFuncSetAttribute(wy_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  e = cudaFuncSetAttribute(wy_kernel<T>, cudaFuncAttributePreferredSharedMemoryCarveout,
                           static_cast<int>(cudaSharedmemCarveoutMaxShared));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  wy_kernel<T><<<dim3(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.hv)), kWyThreads, bytes,
                 static_cast<cudaStream_t>(stream)>>>(p);
  return launch_error();
}

}  // namespace
}  // namespace bwd

const char* gdn_bwd_wy(const GdnBwdParams& p, void* stream) {
  return p.in == BwdDType::BFloat16 ? bwd::launch<__nv_bfloat16>(p, stream) : bwd::launch<__half>(p, stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
