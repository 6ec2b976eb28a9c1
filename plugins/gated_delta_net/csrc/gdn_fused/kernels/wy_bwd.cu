// (c) of the fused GDN backward, per (chunk, value head): the WY backward and the gate gradient.
// With du = dv_total, dw = -dv_total h^T, kb = beta exp(G) k^, vb = beta v, u = Ainv vb:
//   dkb = Ainv^T dw, dvb = Ainv^T du, dA = -(dkb w^T + dvb u^T) strictly lower
//   dAE = dA * exp(G_i - G_j), W2 = dAE * (k^ k^T), dKK = beta_i dAE
//   dk^ += beta exp(G) dkb + dKK k^ + dKK^T k^        (onto (b)'s dk_hv)
//   dv   = beta dvb                                   (at the tokens, in-type)
//   dbeta = <dvb, v> + exp(G) <dkb, k^> + rowsum(W2)
//   dG  += beta exp(G) <dkb, k^> + beta rowsum(W2) - colsum(beta W2) (written back: the total);
//   dg = reverse cumsum of dG
#include <cstdlib>

#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

// 16 warps per CTA (the kernel is latency-bound at one CTA per SM: 214 KB of shared memory at
// K = V = 128); all tiles arrive by cp.async in two groups (phase 1's operands first); dk^ is read
// once and written once (phase 2's term held in registers until phase 4, same sums as before).
constexpr int kWyWarps = 16;
constexpr int kWyThreads = kWyWarps * 32;
constexpr int kWyMaxKTiles = (C / 16) * (kBwdMaxDim / 16) / kWyWarps;  // C x K tiles per warp
static_assert((C / 16) * (kBwdMaxDim / 16) % kWyWarps == 0, "wy: C x K tiles must split evenly over the warps");

template <typename T>
__global__ void __launch_bounds__(kWyThreads) wy_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const int64_t c = blockIdx.x, hv = blockIdx.y;
  const int64_t HV = p.hv, HK = p.hk, hk = hv / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldk = pitch_of(Kp), ldv = pitch_of(Vp);
  Smem sm{smem_raw};
  T* Ai = sm.take<T>(C * kPitchC);
  T* dvt = sm.take<T>(C * ldv);
  T* h = sm.take<T>(Kp * ldv);
  T* kh = sm.take<T>(C * ldk);
  T* w = sm.take<T>(C * ldk);
  T* dw = sm.take<T>(C * ldk);
  T* vb = sm.take<T>(C * ldv);
  T* dvb = sm.take<T>(C * ldv);
  T* dkb = sm.take<T>(C * ldk);
  T* u = sm.take<T>(C * ldv);
  T* dKK = sm.take<T>(C * kPitchC);
  float* W2 = sm.take<float>(C * (C + 1));
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
  // group 0: phase 1's operands; group 1: k^ and w (phases 2-4)
  async_matrix<T>(Ai, kPitchC, static_cast<const T*>(p.Ainv) + ch * C * C, C, C, C, C);
  async_matrix<T>(dvt, ldv, static_cast<const T*>(p.dv_total) + ch * C * V, C, C, V, Vp);
  async_matrix<T>(h, ldv, static_cast<const T*>(p.h) + ch * static_cast<int64_t>(K) * V, K, Kp, V, Vp);
  async_token_rows<T>(vb, ldv, v, tok, HV, hv, V, Vp);
  mma::cp_async_commit();
  async_token_rows<T>(kh, ldk, static_cast<const T*>(p.k), tok, HK, hk, K, Kp);
  async_matrix<T>(w, ldk, static_cast<const T*>(p.w) + ch * C * K, C, C, K, Kp);
  mma::cp_async_commit();
  mma::cp_async_wait<1>();
  __syncthreads();
  scale_rows<T>(vb, ldv, Vp, beta);  // vb = beta v (in place)
  __syncthreads();

  const int warp = threadIdx.x / 32;
  T* dv_out = static_cast<T*>(p.dv);
  // Phase 1: dw = -dv_total h^T (C x K); dvb = Ainv^T dv_total and u = Ainv vb (C x V).
  for (int t = warp; t < (C / 16) * (Kp / 16); t += kWyWarps) {
    const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, false>(acc, dvt, ldv, h, ldv, r0, c0, Vp / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dw[el_row(r0, e) * ldk + el_col(c0, nt, e)] = mma::Elem<T>::from_float(-acc[0][nt].x[e]);
  }
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
  mma::cp_async_wait<0>();
  __syncthreads();
  scale_rows<T>(kh, ldk, Kp, rks);  // k^ = rk k
  __syncthreads();

  // Phase 2: dkb = Ainv^T dw; dk^ (from (b)) + beta exp(G) dkb, kept in registers.
  float* dk_io = p.dk_hv + ch * C * K;
  const int ktiles = (C / 16) * (Kp / 16);
  float dkr[kWyMaxKTiles][2][4];
#pragma unroll
  for (int it = 0; it < kWyMaxKTiles; ++it) {
    const int t = warp + it * kWyWarps;
    if (t < ktiles) {
      const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = el_row(r0, e), col = el_col(c0, nt, e);
          dkr[it][nt][e] = col < K ? dk_io[j * K + col] : 0.f;
        }
      FragC acc[1][2];
      zero(acc);
      tile_mma<T, false, true>(acc, Ai, kPitchC, dw, ldk, r0, c0, C / 16);
      float s[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = el_row(r0, e), col = el_col(c0, nt, e);
          const float x = acc[0][nt].x[e];
          dkb[j * ldk + col] = mma::Elem<T>::from_float(x);
          s[e >> 1] += x * mma::Elem<T>::to_float(kh[j * ldk + col]);
          dkr[it][nt][e] += beta[j] * expf(G[j]) * x;
        }
      tile_rowdot_store(s[0], s[1], partKB, r0, c0);
    }
  }
  __syncthreads();

  // Phase 3: dA = -(dkb w^T + dvb u^T), KK = k^ k^T, strictly lower: W2 and dKK.
  for (int t = warp; t < (C / 16) * (C / 16); t += kWyWarps) {
    const int r0 = (t / (C / 16)) * 16, c0 = (t % (C / 16)) * 16;
    FragC acc[1][2], kk[1][2];
    zero(acc);
    zero(kk);
    if (r0 + 15 > c0) {
      tile_mma<T, true, false>(acc, dkb, ldk, w, ldk, r0, c0, Kp / 16);
      tile_mma<T, true, false>(acc, dvb, ldv, u, ldv, r0, c0, Vp / 16);
      tile_mma<T, true, false>(kk, kh, ldk, kh, ldk, r0, c0, Kp / 16);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = el_row(r0, e), j = el_col(c0, nt, e);
        const float dae = j < i ? -acc[0][nt].x[e] * expf(G[i] - G[j]) : 0.f;
        W2[i * (C + 1) + j] = dae * kk[0][nt].x[e];
        dKK[i * kPitchC + j] = mma::Elem<T>::from_float(beta[i] * dae);
      }
  }
  __syncthreads();

  // Phase 4: dk^ = (registers) + dKK k^ + dKK^T k^, written once; rowsum / colsum of W2 split
  // over two thread ranges; then dbeta, dG, dg.
#pragma unroll
  for (int it = 0; it < kWyMaxKTiles; ++it) {
    const int t = warp + it * kWyWarps;
    if (t < ktiles) {
      const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
      FragC acc[1][2];
      zero(acc);
      tile_mma<T, true, true>(acc, dKK, kPitchC, kh, ldk, r0, c0, C / 16);
      tile_mma<T, false, true>(acc, dKK, kPitchC, kh, ldk, r0, c0, C / 16);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = el_row(r0, e), col = el_col(c0, nt, e);
          if (col < K) dk_io[j * K + col] = dkr[it][nt][e] + acc[0][nt].x[e];
        }
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

// Split variant (opt-in: TREE_RECURRENCE_GDN_WY_SPLIT=1, only when Kp, Vp >= 32): the (chunk, value
// head) tile's K and V columns split over a cluster of 2 CTAs (rank 0: column tiles [0, n0), rank 1:
// the rest, n0 = ceil(tiles / 2), for K and V alike). Each CTA: Ai and dv_total whole, its rows of
// h, its columns of v, k^, w; dw, dkb (its K columns), dvb, u (its V columns), its dk^ columns. The
// C x C products dA and KK contract over K and V: each CTA forms its half's partial (registers, one
// 16 x 16 tile per warp), the two CTAs swap partials through DSMEM (into the dead dv_total / h
// region), and both form the total = rank 0's partial + rank 1's, the same bits in both, so both
// hold the same W2 / dKK. Rank 1's row-dot parts go to rank 0's slots; rank 0 writes dbeta, dG, dg.
// Shared memory aliases (K = V = 128): dKK on Ai (dead after phase 2), the received partials on
// dv_total + h (dead after phase 1), W2 on vb + dw (dead after phases 1 / 2): 112 KB, 2 CTAs/SM.
static_assert((C / 16) * (C / 16) == kWyWarps, "wy split: one C x C tile per warp");

template <typename T>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kWyThreads, 2) wy_split_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const unsigned rank = cluster_rank(), peer = rank ^ 1u;
  const int64_t c = blockIdx.x / 2, hv = blockIdx.y;
  const int64_t HV = p.hv, HK = p.hk, hk = hv / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldv = pitch_of(Vp);
  const int nK = Kp / 16, n0K = (nK + 1) / 2, nV = Vp / 16, n0V = (nV + 1) / 2;
  const int ktile0 = rank == 0 ? 0 : n0K, nKl = rank == 0 ? n0K : nK - n0K;
  const int vtile0 = rank == 0 ? 0 : n0V, nVl = rank == 0 ? n0V : nV - n0V;
  const int k0 = ktile0 * 16, kwp = nKl * 16, kw = K - k0 < kwp ? K - k0 : kwp;
  const int v0 = vtile0 * 16, vwp = nVl * 16, vw = V - v0 < vwp ? V - v0 : vwp;
  const int ldk = pitch_of(n0K * 16), ldh = pitch_of(n0V * 16);  // half tiles: rank 0's width (the larger)
  Smem sm{smem_raw};
  T* Ai = sm.take<T>(C * kPitchC);
  T* dKK = Ai;  // phase 3 on
  char* regA = sm.take<char>(2 * static_cast<size_t>(C) * ldv * sizeof(T) > 2 * C * C * sizeof(float)
                                 ? 2 * static_cast<size_t>(C) * ldv * sizeof(T)
                                 : 2 * C * C * sizeof(float));
  T* dvt = reinterpret_cast<T*>(regA);                  // C x Vp (phase 1)
  T* h = dvt + C * ldv;                                 // n0K * 16 <= C rows x Vp (phase 1)
  float* recvA = reinterpret_cast<float*>(regA);        // the peer's dA partial (phase 3)
  float* recvK = recvA + C * C;                         // the peer's KK partial
  char* regB = sm.take<char>(static_cast<size_t>(C) * (ldh + ldk) * sizeof(T) > C * (C + 1) * sizeof(float)
                                 ? static_cast<size_t>(C) * (ldh + ldk) * sizeof(T)
                                 : C * (C + 1) * sizeof(float));
  T* vb = reinterpret_cast<T*>(regB);                   // phase 1
  T* dw = vb + C * ldh;                                 // phases 1-2
  float* W2 = reinterpret_cast<float*>(regB);           // phase 3 on
  T* dvb = sm.take<T>(C * ldh);
  T* u = sm.take<T>(C * ldh);
  T* dkb = sm.take<T>(C * ldk);
  T* kh = sm.take<T>(C * ldk);
  T* w = sm.take<T>(C * ldk);
  float* G = sm.take<float>(C);
  float* beta = sm.take<float>(C);
  float* dGs = sm.take<float>(C);
  float* partV = sm.take<float>(C * 8);
  float* partKB = sm.take<float>(C * 8);
  float* rks = sm.take<float>(C);
  float* dGin = sm.take<float>(C);
  float* rowW = sm.take<float>(C);
  float* colW = sm.take<float>(C);
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
  async_matrix<T>(Ai, kPitchC, static_cast<const T*>(p.Ainv) + ch * C * C, C, C, C, C);
  async_matrix<T>(dvt, ldv, static_cast<const T*>(p.dv_total) + ch * C * V, C, C, V, Vp);
  async_matrix<T>(h, ldv, static_cast<const T*>(p.h) + (ch * static_cast<int64_t>(K) + k0) * V, kw, kwp, V, Vp);
  async_token_cols<T>(vb, ldh, v, tok, HV, hv, V, v0, vw, vwp);
  mma::cp_async_commit();
  async_token_cols<T>(kh, ldk, static_cast<const T*>(p.k), tok, HK, hk, K, k0, kw, kwp);
  async_matrix_cols<T>(w, ldk, static_cast<const T*>(p.w) + ch * C * K, C, C, K, k0, kw, kwp);
  mma::cp_async_commit();
  mma::cp_async_wait<1>();
  __syncthreads();
  scale_rows<T>(vb, ldh, vwp, beta);
  __syncthreads();

  const int warp = threadIdx.x / 32;
  T* dv_out = static_cast<T*>(p.dv);
  // Phase 1: dw = -dv_total h^T (C x its K columns); dvb = Ainv^T dv_total, u = Ainv vb (its V columns).
  for (int t = warp; t < (C / 16) * nKl; t += kWyWarps) {
    const int r0 = (t / nKl) * 16, c0 = (t % nKl) * 16;
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, false>(acc, dvt, ldv, h, ldv, r0, c0, Vp / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        dw[el_row(r0, e) * ldk + el_col(c0, nt, e)] = mma::Elem<T>::from_float(-acc[0][nt].x[e]);
  }
  for (int t = warp; t < (C / 16) * nVl; t += kWyWarps) {
    const int r0 = (t / nVl) * 16, c0 = (t % nVl) * 16;
    float vv[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        const int64_t tj = tok[j];
        vv[nt][e] = (tj >= 0 && col < vw) ? mma::Elem<T>::to_float(v[(tj * HV + hv) * V + v0 + col]) : 0.f;
      }
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, false, true>(acc, Ai, kPitchC, dvt + v0, ldv, r0, c0, C / 16);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        const float x = acc[0][nt].x[e];
        dvb[j * ldh + col] = mma::Elem<T>::from_float(x);
        const int64_t tj = tok[j];
        if (tj >= 0 && col < vw) {
          dv_out[(tj * HV + hv) * V + v0 + col] = mma::Elem<T>::from_float(beta[j] * x);
          s[e >> 1] += x * vv[nt][e];
        }
      }
    tile_rowdot_store(s[0], s[1], partV, r0, v0 + c0);
    zero(acc);
    tile_mma<T, true, true>(acc, Ai, kPitchC, vb, ldh, r0, c0, C / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        u[el_row(r0, e) * ldh + el_col(c0, nt, e)] = mma::Elem<T>::from_float(acc[0][nt].x[e]);
  }
  mma::cp_async_wait<0>();
  __syncthreads();
  scale_rows<T>(kh, ldk, kwp, rks);
  __syncthreads();

  // Phase 2: dkb = Ainv^T dw; dk^ (from (b)) + beta exp(G) dkb in registers (at most one tile per warp).
  float* dk_io = p.dk_hv + ch * C * K + k0;
  const bool has_k = warp < (C / 16) * nKl;
  const int kr0 = has_k ? (warp / nKl) * 16 : 0, kc0 = has_k ? (warp % nKl) * 16 : 0;
  float dkr[2][4];
  if (has_k) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(kr0, e), col = el_col(kc0, nt, e);
        dkr[nt][e] = col < kw ? dk_io[j * K + col] : 0.f;
      }
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, false, true>(acc, Ai, kPitchC, dw, ldk, kr0, kc0, C / 16);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(kr0, e), col = el_col(kc0, nt, e);
        const float x = acc[0][nt].x[e];
        dkb[j * ldk + col] = mma::Elem<T>::from_float(x);
        s[e >> 1] += x * mma::Elem<T>::to_float(kh[j * ldk + col]);
        dkr[nt][e] += beta[j] * expf(G[j]) * x;
      }
    tile_rowdot_store(s[0], s[1], partKB, kr0, k0 + kc0);
  }
  __syncthreads();
  cluster_arrive();  // this CTA is done with dv_total / h (the peer may overwrite them) and started

  // Phase 3: this half's partials of dA' = dkb w^T + dvb u^T and KK = k^ k^T (tile `warp`).
  const int r0 = (warp / (C / 16)) * 16, c0 = (warp % (C / 16)) * 16;
  const bool lower = r0 + 15 > c0;
  FragC acc[1][2], kk[1][2];
  zero(acc);
  zero(kk);
  if (lower) {
    tile_mma<T, true, false>(acc, dkb, ldk, w, ldk, r0, c0, nKl);
    tile_mma<T, true, false>(acc, dvb, ldh, u, ldh, r0, c0, nVl);
    tile_mma<T, true, false>(kk, kh, ldk, kh, ldk, r0, c0, nKl);
  }
  cluster_wait();  // the peer is done with its dv_total / h
  if (lower) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = el_row(r0, e), j = el_col(c0, nt, e);
        store_remote(recvA + i * C + j, peer, acc[0][nt].x[e]);
        store_remote(recvK + i * C + j, peer, kk[0][nt].x[e]);
      }
  }
  if (rank == 1) {
    const int n1V = nV - n0V, n1K = nK - n0K;
    for (int idx = threadIdx.x; idx < C * n1V; idx += blockDim.x) {
      const int off = (idx / n1V) * 8 + n0V + idx % n1V;
      store_remote(partV + off, 0, partV[off]);
    }
    for (int idx = threadIdx.x; idx < C * n1K; idx += blockDim.x) {
      const int off = (idx / n1K) * 8 + n0K + idx % n1K;
      store_remote(partKB + off, 0, partKB[off]);
    }
  }
  cluster_arrive();
  cluster_wait();  // the peer's partials (and rank 1's parts) are here
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = el_row(r0, e), j = el_col(c0, nt, e);
      float dae = 0.f, kkt = 0.f;
      if (j < i) {
        const float a0 = rank == 0 ? acc[0][nt].x[e] : recvA[i * C + j];
        const float a1 = rank == 0 ? recvA[i * C + j] : acc[0][nt].x[e];
        const float q0 = rank == 0 ? kk[0][nt].x[e] : recvK[i * C + j];
        const float q1 = rank == 0 ? recvK[i * C + j] : kk[0][nt].x[e];
        dae = -(a0 + a1) * expf(G[i] - G[j]);
        kkt = q0 + q1;
      }
      W2[i * (C + 1) + j] = dae * kkt;
      dKK[i * kPitchC + j] = mma::Elem<T>::from_float(beta[i] * dae);
    }
  __syncthreads();

  // Phase 4: dk^ (its columns) = registers + dKK k^ + dKK^T k^; rank 0: rowsum / colsum of W2, dbeta, dG, dg.
  if (has_k) {
    FragC acc4[1][2];
    zero(acc4);
    tile_mma<T, true, true>(acc4, dKK, kPitchC, kh, ldk, kr0, kc0, C / 16);
    tile_mma<T, false, true>(acc4, dKK, kPitchC, kh, ldk, kr0, kc0, C / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(kr0, e), col = el_col(kc0, nt, e);
        if (col < kw) dk_io[j * K + col] = dkr[nt][e] + acc4[0][nt].x[e];
      }
  }
  if (rank != 0) return;
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
    const float eg = expf(G[i]), kb = row_parts(partKB, i, nK);
    const float db = row_parts(partV, i, nV) + eg * kb + row;
    dGs[i] = dGin[i] + beta[i] * eg * kb + beta[i] * row - colsum;
    p.dG[ch * C + i] = dGs[i];
    if (tok[i] >= 0) p.dbeta[tok[i] * HV + hv] = db;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float s = 0.f;
    for (int m = C - 1; m >= i; --m) s += dGs[m];
    if (tok[i] >= 0) p.dg[tok[i] * HV + hv] = s;
  }
}

size_t wy_split_smem(const GdnBwdParams& p) {
  const int Kp = round16(static_cast<int>(p.k_dim)), Vp = round16(static_cast<int>(p.v_dim)), ldv = pitch_of(Vp);
  const int ldk = pitch_of(((Kp / 16) + 1) / 2 * 16), ldh = pitch_of(((Vp / 16) + 1) / 2 * 16);
  const size_t a = 2 * static_cast<size_t>(C) * ldv * 2, a2 = 2 * C * C * sizeof(float);
  const size_t b = static_cast<size_t>(C) * (ldh + ldk) * 2, b2 = C * (C + 1) * sizeof(float);
  return smem_bytes<uint16_t>(C * kPitchC) + smem_bytes<char>(a > a2 ? a : a2) + smem_bytes<char>(b > b2 ? b : b2) +
         2 * smem_bytes<uint16_t>(C * ldh) + 3 * smem_bytes<uint16_t>(C * ldk) + 3 * smem_bytes<float>(C) +
         2 * smem_bytes<float>(C * 8) + 4 * smem_bytes<float>(C) + smem_bytes<int64_t>(C);
}

bool use_split(const GdnBwdParams& p) {
  static const bool on = [] {
    const char* e = std::getenv("TREE_RECURRENCE_GDN_WY_SPLIT");
    return e != nullptr && e[0] == '1';
  }();
  return on && round16(static_cast<int>(p.k_dim)) >= 32 && round16(static_cast<int>(p.v_dim)) >= 32;
}

size_t wy_smem(const GdnBwdParams& p) {
  const int Kp = round16(static_cast<int>(p.k_dim)), ldk = pitch_of(Kp), ldv = pitch_of(round16(static_cast<int>(p.v_dim)));
  return 2 * smem_bytes<uint16_t>(C * kPitchC) + 4 * smem_bytes<uint16_t>(C * ldv) + smem_bytes<uint16_t>(Kp * ldv) +
         4 * smem_bytes<uint16_t>(C * ldk) + smem_bytes<float>(C * (C + 1)) + 3 * smem_bytes<float>(C) +
         2 * smem_bytes<float>(C * 8) + 4 * smem_bytes<float>(C) + smem_bytes<int64_t>(C);
}

template <typename T>
const char* launch(const GdnBwdParams& p, void* stream) {
  if (p.num_chunks == 0) return "";
  if (use_split(p)) {
    const size_t bytes = wy_split_smem(p);
    cudaError_t e =
        cudaFuncSetAttribute(wy_split_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess) return cudaGetErrorString(e);
    e = cudaFuncSetAttribute(wy_split_kernel<T>, cudaFuncAttributePreferredSharedMemoryCarveout,
                             static_cast<int>(cudaSharedmemCarveoutMaxShared));
    if (e != cudaSuccess) return cudaGetErrorString(e);
    wy_split_kernel<T><<<dim3(static_cast<unsigned>(2 * p.num_chunks), static_cast<unsigned>(p.hv)), kWyThreads, bytes,
                         static_cast<cudaStream_t>(stream)>>>(p);
    return launch_error();
  }
  const size_t bytes = wy_smem(p);
  cudaError_t e = cudaFuncSetAttribute(wy_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
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
