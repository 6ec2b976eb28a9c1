// (b) of the fused GDN backward, per (chunk, value head), after the reverse state pass:
//   dP   = E * (dO v_new^T)                       (E_ij = exp(G_i - G_j), j <= i)
//   dq^  = exp(G) (dO h^T) + dP k^
//   dk^  = exp(G_last - G) (v_new dS^T) + dP^T q^  (dS: gradient of the state leaving the chunk)
//   dG directly from the gate-dependent terms (each exp(G_a - G_b) X term gives +X to dG_a, -X to
//   dG_b; a == b gives nothing), not as FLA's <dq^_i, q^_i> - <dk^_i, k^_i>, whose two O(1) terms
//   cancel to O(1e-5) under extreme decays (log-gates -8..-26 per token) and lose dG in fp32:
//     D    = dP * (q^ k^T) strictly lower (fp32 dP, before its in-type rounding)
//     T_j  = <exp(G_last - G_j) (v_new dS^T)_j, k^_j>     (the state update's kd term)
//     dG_i = <exp(G_i) (dO h^T)_i, q^_i> + rowsum(D)_i - colsum(D)_i - [i != L] T_i
//            + [i == L] (exp(G_last) <h, dS> + sum_{j != L} T_j)
//   L = the chunk's last row holding a token (C - 1 when none; pad rows have g = 0, so G_L = G_last
//   and T_L = exp(0) <..> is the exactly cancelling term left out).
// dq^ (fp32, chunk-major, summed per key head), dk^ (fp32, chunk-major per value head) and dG go to
// workspaces; (c) adds the WY terms.
#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

// 16 warps per CTA, two CTAs per SM (112,480 B of shared memory at K = V = 128); the kernel
// (dqk_kernel) follows its tile helpers.
constexpr int kDqkWarps = kTileWarps;  // one C x C tile of dP / D per warp
constexpr int kDqkThreads = kTileThreads;

// dP(i, j) = exp(G_i - G_j) <dO_i, v_new_j> for j <= i on the warp's tile (dr0, dc0): kept in fp32
// (dpf) for D and stored in-type (dP, pitch kPitchC) for the dq^, dk^ products.
template <typename T>
__device__ __forceinline__ void dp_tile(float (&dpf)[2][4], const T* dO, int ldo, const T* vn, int ldn, T* dP,
                                        const float* G, int dr0, int dc0, int Vp) {
  FragC acc[1][2];
  zero(acc);
  if (dr0 + 15 >= dc0) tile_mma<T, true, false>(acc, dO, ldo, vn, ldn, dr0, dc0, Vp / 16);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = el_row(dr0, e), j = el_col(dc0, nt, e);
      dpf[nt][e] = j <= i ? acc[0][nt].x[e] * expf(G[i] - G[j]) : 0.f;
      dP[i * kPitchC + j] = mma::Elem<T>::from_float(dpf[nt][e]);
    }
}

// D = dP * (q^ k^T), strictly lower, on the warp's tile: row parts (quad butterfly) to partD slot
// dc0 / 16, column parts (over the 8 row groups, then the two row halves) to slot 4 + dr0 / 16.
template <typename T>
__device__ __forceinline__ void d_parts(const float (&dpf)[2][4], const T* qh, const T* kh, int ldk, float* partD, int dr0,
                                        int dc0, int Kp) {
  FragC qk[1][2];
  zero(qk);
  if (dr0 + 15 > dc0) tile_mma<T, true, false>(qk, qh, ldk, kh, ldk, dr0, dc0, Kp / 16);
  float s[2] = {0.f, 0.f}, cs[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    float d[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = el_row(dr0, e), j = el_col(dc0, nt, e);
      d[e] = j < i ? dpf[nt][e] * qk[0][nt].x[e] : 0.f;
      s[e >> 1] += d[e];
    }
    cs[nt][0] = d[0] + d[2];
    cs[nt][1] = d[1] + d[3];
  }
  tile_rowdot_store(s[0], s[1], partD, dr0, dc0);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      float x = cs[nt][b];
      x += __shfl_xor_sync(0xffffffffu, x, 4);
      x += __shfl_xor_sync(0xffffffffu, x, 8);
      x += __shfl_xor_sync(0xffffffffu, x, 16);
      cs[nt][b] = x;
    }
  const int l = mma::lane_id();
  if (l < 4) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int b = 0; b < 2; ++b) partD[(dc0 + nt * 8 + 2 * l + b) * 8 + 4 + dr0 / 16] = cs[nt][b];
  }
}

// dG of the chunk's rows from the parts (complete and visible to every thread): see the header.
__device__ inline void dg_rows(float* dG, const float* partQ, const float* partT, const float* partD, int L, int Kp,
                               float g_last, float hds_all) {
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    float d = row_parts(partQ, i, Kp / 16);
    float dd = 0.f;
#pragma unroll
    for (int t = 0; t < C / 16; ++t) dd += partD[i * 8 + t];
#pragma unroll
    for (int t = 0; t < C / 16; ++t) dd -= partD[i * 8 + 4 + t];
    d += dd;
    if (i != L) {
      d -= row_parts(partT, i, Kp / 16);
    } else {
      float ts = 0.f;  // sum_{j != L} T_j, in row order
      for (int j = 0; j < C; ++j)
        if (j != L) ts += row_parts(partT, j, Kp / 16);
      d += expf(g_last) * hds_all + ts;
    }
    dG[i] = d;
  }
}

// The 16 x 16 fp32 tile at (r0, c0) of a C x K output, two columns per store.
__device__ __forceinline__ void dqk_store(const FragC (&acc)[1][2], float* out, int K, int r0, int c0) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int eh = 0; eh < 2; ++eh) {
      const int i = el_row(r0, 2 * eh), col = el_col(c0, nt, 2 * eh);
      if (col < K)
        *reinterpret_cast<float2*>(out + static_cast<int64_t>(i) * K + col) =
            make_float2(acc[0][nt].x[2 * eh], acc[0][nt].x[2 * eh + 1]);
    }
}
// dqk_store of 0 + acc (first value head of the key head) or out + acc (the next ones): dq^ summed over the
// value heads of a key head, element by element (each element read and written by this lane only).
__device__ __forceinline__ void dqk_store_sum(const FragC (&acc)[1][2], float* out, int K, int r0, int c0, bool add) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int eh = 0; eh < 2; ++eh) {
      const int i = el_row(r0, 2 * eh), col = el_col(c0, nt, 2 * eh);
      if (col < K) {
        float2* o = reinterpret_cast<float2*>(out + static_cast<int64_t>(i) * K + col);
        const float x = acc[0][nt].x[2 * eh], y = acc[0][nt].x[2 * eh + 1];
        const float2 prev = add ? *o : make_float2(0.f, 0.f);
        *o = make_float2(prev.x + x, prev.y + y);
      }
    }
}
// acc *= rowscale(row); the tile's row dots <acc_i, Y_i> (Y = q^ or k^) to part.
template <typename T, typename Scale>
__device__ __forceinline__ void dqk_scale_rowdot(FragC (&acc)[1][2], Scale rowscale, const T* Y, int ldk, float* part, int r0,
                                                 int c0) {
  float s[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = el_row(r0, e), col = el_col(c0, nt, e);
      acc[0][nt].x[e] *= rowscale(i);
      s[e >> 1] += acc[0][nt].x[e] * mma::Elem<T>::to_float(Y[i * ldk + col]);
    }
  tile_rowdot_store(s[0], s[1], part, r0, c0);
}

// ---- One (chunk, value head) ---------------------------------------------------------------------
// CTA of 16 warps (2 CTA/SM, 112,480 B at K = V = 128), one 16 x 16 tile per warp, with the loads
// issued as soon as a buffer frees so that each one overlaps the MMAs before its first use. The
// K x V states travel in two 64-row halves (K <= 64: one), through two C x V buffers:
//   A:  dO (dP, dq^)                                  -> v_new (dk^)
//   B0: v_new (dP) -> h rows 64.. (dq^, 2nd half)      -> dS rows 64.. (dk^, 2nd half)
//   B1: h rows 0..63 (dq^, 1st half)                   -> dS rows 0..63 (dk^, 1st half)
// Commit groups in issue order: g1 dO, v_new | g2 q, k | g3 h0 | (after dP) g4 h1 | (after the dq^
// MMAs of half 0) g5 dS0 | (after those of the last half) g6 v_new, g7 dS1. <h, dS> from smem: each
// thread keeps its 16 elements of an h half (the second half's last 8 in an 8 KB smem stash, which
// keeps ptxas at 64 registers without spills) until the dS half replaces it. exp(G_i)
// and exp(G_last - G_j) once per row. dq^ / dk^ stored as float2. No second dS read from global
// memory, no load waited on with nothing in flight but the first (dO, v_new) and, partly, v_new's reload.
constexpr int kDqkHalf = 64;  // rows of a state half
static_assert(kDqkHalf == C && (kDqkHalf / 16) * (kDqkHalf / 16) == kDqkWarps, "dqk: one 16 x 16 tile per warp and half");
constexpr int kDqkHdsRegs = kDqkHalf * (kBwdMaxDim / 8) / kDqkThreads;  // uint4 of an h half per thread (2)
static_assert(kDqkHalf * (kBwdMaxDim / 8) % kDqkThreads == 0, "dqk: <h, dS> registers");

// Rows kb.. of a K x V state (h or dS) into a half buffer: min(64, K - kb) rows, zero rows up to
// min(64, Kp - kb).
template <typename T>
__device__ __forceinline__ void dqk_state_half(T* dst, int ldv, const T* src, int hf, int K, int Kp, int V, int Vp) {
  const int kb = hf * kDqkHalf;
  async_matrix<T>(dst, ldv, src + static_cast<int64_t>(kb) * V, min(kDqkHalf, K - kb), min(kDqkHalf, Kp - kb), V, Vp);
}
// This thread's uint4 of a half buffer in <h, dS>'s order (idx = tid, tid + 512).
template <typename T>
__device__ __forceinline__ void dqk_grab(uint4 (&r)[kDqkHdsRegs], const T* buf, int ldv, int rows_p, int Vp) {
  const int per_row = Vp / 8;
#pragma unroll
  for (int m = 0; m < kDqkHdsRegs; ++m) {
    const int idx = threadIdx.x + m * kDqkThreads;
    r[m] = make_uint4(0, 0, 0, 0);
    if (idx < rows_p * per_row) r[m] = *reinterpret_cast<const uint4*>(buf + (idx / per_row) * ldv + (idx % per_row) * 8);
  }
}
template <typename T>
__device__ __forceinline__ float dqk_dot(const uint4 (&a)[kDqkHdsRegs], const uint4 (&b)[kDqkHdsRegs], float s) {
#pragma unroll
  for (int m = 0; m < kDqkHdsRegs; ++m) {
    const T* x = reinterpret_cast<const T*>(&a[m]);
    const T* y = reinterpret_cast<const T*>(&b[m]);
#pragma unroll
    for (int e = 0; e < 8; ++e) s += mma::Elem<T>::to_float(x[e]) * mma::Elem<T>::to_float(y[e]);
  }
  return s;
}
// One (chunk c, value head: ch = c * HV + hv, of key head hk). dq_out: the C x K dq^ tile of the key head
// (dq_add false: 0 + dq^; true: the value there + dq^, read and written by the same thread).
template <typename T>
__device__ __forceinline__ void dqk_head(const GdnBwdParams& p, char* smem_raw, int64_t ch, int64_t c, int64_t hk,
                                         float* dq_out, bool dq_add) {
  const int64_t HK = p.hk;
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldk = pitch_of(Kp), ldv = pitch_of(Vp);
  const bool two = Kp > kDqkHalf;  // two state halves
  Smem sm{smem_raw};
  T* qh = sm.take<T>(C * ldk);
  T* kh = sm.take<T>(C * ldk);
  T* A = sm.take<T>(C * ldv);
  T* B0 = sm.take<T>(kDqkHalf * ldv);
  T* B1 = sm.take<T>(kDqkHalf * ldv);
  T* dP = sm.take<T>(C * kPitchC);
  float* G = sm.take<float>(C);
  float* eG = sm.take<float>(C);  // exp(G_i): dq^'s inter-chunk scale
  float* eL = sm.take<float>(C);  // exp(G_last - G_j): dk^'s
  float* partQ = sm.take<float>(C * 8);
  float* partT = sm.take<float>(C * 8);
  float* partD = sm.take<float>(C * 8);
  int* lastRow = sm.take<int>(4);
  float* red = sm.take<float>(kDqkWarps + 1);
  float* rqs = sm.take<float>(C);
  float* rks = sm.take<float>(C);
  int64_t* tok = sm.take<int64_t>(C);
  uint4* hstash = sm.take<uint4>(kDqkThreads);  // the last uint4 of each thread's h half 1 (registers spared)

  row_tables(p, c, ch, hk, G, tok, rqs, rks);  // (contains __syncthreads: tok is complete after it)
  last_token_row(tok, lastRow);
  const T* vn_g = static_cast<const T*>(p.v_new) + ch * C * V;
  const T* h_g = static_cast<const T*>(p.h) + ch * static_cast<int64_t>(K) * V;
  const T* dS_g = static_cast<const T*>(p.grad_state_out) + ch * static_cast<int64_t>(K) * V;
  // g1: A = dO (at the tokens, pads zero)
  async_token_rows<T>(A, ldv, static_cast<const T*>(p.grad_o), tok, p.hv, ch - c * p.hv, V, Vp);
  async_matrix<T>(B0, ldv, vn_g, C, C, V, Vp);                                         //     B0 = v_new
  mma::cp_async_commit();
  async_token_rows<T>(qh, ldk, static_cast<const T*>(p.q), tok, HK, hk, K, Kp);  // g2
  async_token_rows<T>(kh, ldk, static_cast<const T*>(p.k), tok, HK, hk, K, Kp);
  mma::cp_async_commit();
  dqk_state_half<T>(B1, ldv, h_g, 0, K, Kp, V, Vp);  // g3: B1 = h rows 0..63
  mma::cp_async_commit();
  const float g_last = G[C - 1];
  if (threadIdx.x < C)
    eG[threadIdx.x] = expf(G[threadIdx.x]);
  else if (threadIdx.x < 2 * C)
    eL[threadIdx.x - C] = expf(g_last - G[threadIdx.x - C]);
  mma::cp_async_wait<2>();
  __syncthreads();  // dO, v_new

  const int warp = threadIdx.x / 32;
  const int dr0 = (warp / (C / 16)) * 16, dc0 = (warp % (C / 16)) * 16;
  float dpf[2][4];
  dp_tile<T>(dpf, A, ldv, B0, ldv, dP, G, dr0, dc0, Vp);
  __syncthreads();  // every warp is done with B0 = v_new
  if (two) {
    dqk_state_half<T>(B0, ldv, h_g, 1, K, Kp, V, Vp);  // g4: B0 = h rows 64..
    mma::cp_async_commit();
    mma::cp_async_wait<2>();
  } else {
    mma::cp_async_wait<1>();
  }
  __syncthreads();  // q, k
  scale_rows<T>(qh, ldk, Kp, rqs);  // q^ = scale rq q
  scale_rows<T>(kh, ldk, Kp, rks);  // k^ = rk k
  __syncthreads();
  d_parts<T>(dpf, qh, kh, ldk, partD, dr0, dc0, Kp);

  // dq^ = exp(G) (dO h^T) + dP k^ by state half; partQ: <exp(G_i) (dO h^T)_i, q^_i>. Warp's tile:
  // rows r0.., columns kb + cl..
  const int r0 = (warp / (kDqkHalf / 16)) * 16, cl = (warp % (kDqkHalf / 16)) * 16;
  float* dk_out = p.dk_hv + ch * C * K;
  uint4 hr0[kDqkHdsRegs], hr1[kDqkHdsRegs];
  const int rows_p1 = two ? Kp - kDqkHalf : 0;
  // the rest of a dq^ tile once its dO h^T part is in acc (dO and h no longer read)
  auto dq_finish = [&](FragC(&acc)[1][2], int c0) {
    dqk_scale_rowdot<T>(acc, [&](int i) { return eG[i]; }, qh, ldk, partQ, r0, c0);
    tile_mma<T, true, true>(acc, dP, kPitchC, kh, ldk, r0, c0, C / 16);
    dqk_store_sum(acc, dq_out, K, r0, c0, dq_add);
  };
  {
    if (two)
      mma::cp_async_wait<1>();
    else
      mma::cp_async_wait<0>();
    __syncthreads();  // B1 = h rows 0..63
    const bool act = cl < Kp;
    FragC acc[1][2];
    zero(acc);
    if (act) tile_mma<T, true, false>(acc, A, ldv, B1, ldv, r0, cl, Vp / 16);
    dqk_grab<T>(hr0, B1, ldv, min(kDqkHalf, Kp), Vp);
    __syncthreads();  // every warp is done with B1 (and, with one half, with A)
    dqk_state_half<T>(B1, ldv, dS_g, 0, K, Kp, V, Vp);  // g5: B1 = dS rows 0..63
    mma::cp_async_commit();
    if (!two) {
      async_matrix<T>(A, ldv, vn_g, C, C, V, Vp);  // g6: A = v_new
      mma::cp_async_commit();
    }
    if (act) dq_finish(acc, cl);
  }
  if (two) {
    mma::cp_async_wait<1>();
    __syncthreads();  // B0 = h rows 64..
    const int c0 = kDqkHalf + cl;
    const bool act = c0 < Kp;
    FragC acc[1][2];
    zero(acc);
    dqk_grab<T>(hr1, B0, ldv, rows_p1, Vp);
    hstash[threadIdx.x] = hr1[kDqkHdsRegs - 1];
    if (act) tile_mma<T, true, false>(acc, A, ldv, B0, ldv, r0, cl, Vp / 16);
    __syncthreads();  // every warp is done with A and B0
    async_matrix<T>(A, ldv, vn_g, C, C, V, Vp);  // g6: A = v_new
    mma::cp_async_commit();
    dqk_state_half<T>(B0, ldv, dS_g, 1, K, Kp, V, Vp);  // g7: B0 = dS rows 64..
    mma::cp_async_commit();
    if (act) dq_finish(acc, c0);
  }

  // dk^ = exp(G_last - G) (v_new dS^T) + dP^T q^ by state half; partT: T_j
  float hds = 0.f;
  auto dk_half = [&](int hf, const uint4(&hr)[kDqkHdsRegs]) {
    __syncthreads();  // v_new, the dS half
    const T* Sb = hf == 0 ? B1 : B0;
    uint4 sr[kDqkHdsRegs];
    dqk_grab<T>(sr, Sb, ldv, hf == 0 ? min(kDqkHalf, Kp) : rows_p1, Vp);
    hds = dqk_dot<T>(hr, sr, hds);
    const int c0 = hf * kDqkHalf + cl;
    if (c0 < Kp) {
      FragC acc[1][2];
      zero(acc);
      tile_mma<T, true, false>(acc, A, ldv, Sb, ldv, r0, cl, Vp / 16);
      dqk_scale_rowdot<T>(acc, [&](int j) { return eL[j]; }, kh, ldk, partT, r0, c0);
      tile_mma<T, false, true>(acc, dP, kPitchC, qh, ldk, r0, c0, C / 16);
      dqk_store(acc, dk_out, K, r0, c0);
    }
  };
  if (two) {
    mma::cp_async_wait<1>();
    dk_half(0, hr0);
    mma::cp_async_wait<0>();
    hr1[kDqkHdsRegs - 1] = hstash[threadIdx.x];
    dk_half(1, hr1);
  } else {
    mma::cp_async_wait<0>();
    dk_half(0, hr0);
  }
  const float hds_all = block_sum<kDqkThreads>(hds, red);  // (contains __syncthreads: parts are complete after it)
  dg_rows(p.dG + ch * C, partQ, partT, partD, *lastRow, Kp, g_last, hds_all);
}

// The (NC, HK) grid, block b = c * HK + hk (b from the dispatch order, x fastest), which runs the value
// heads hk * G .. hk * G + G - 1 of its key head one after the other and sums their dq^ into the
// (NC, HK, C, K) tile b in increasing head order, starting from 0 (no atomics). The value heads of a key
// head share its q, k rows, rq, rk and the gather row; the chunk-major h, dS, v_new are read in address
// order.
template <typename T>
__global__ void __launch_bounds__(kDqkThreads, 2) dqk_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const int64_t b = static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  const int groups = static_cast<int>(p.hv / p.hk);
  for (int gi = 0; gi < groups; ++gi) {
    if (gi > 0) __syncthreads();  // the previous head's last reads of shared memory are done
    const int64_t c = b / p.hk, hk = b - c * p.hk;
    dqk_head<T>(p, smem_raw, c * p.hv + hk * groups + gi, c, hk, p.dq_hv + b * C * p.k_dim, gi > 0);
  }
}

}  // namespace
}  // namespace bwd

const char* gdn_bwd_dqk(const GdnBwdParams& p, void* stream) {
  using namespace bwd;
  // the kernel's shared memory: q^, k^, A, the two state halves (B0, B1), dP, then the per-row tables
  const int Kp = round16(static_cast<int>(p.k_dim)), ldk = pitch_of(Kp), ldv = pitch_of(round16(static_cast<int>(p.v_dim)));
  const size_t bytes = 2 * smem_bytes<uint16_t>(C * ldk) + smem_bytes<uint16_t>(C * ldv) +
                       2 * smem_bytes<uint16_t>(kDqkHalf * ldv) + smem_bytes<uint16_t>(C * kPitchC) + 3 * smem_bytes<float>(C) +
                       3 * smem_bytes<float>(C * 8) + smem_bytes<int>(4) + smem_bytes<float>(kDqkWarps + 1) +
                       2 * smem_bytes<float>(C) + smem_bytes<int64_t>(C) + smem_bytes<uint4>(kDqkThreads);
  return launch_chunks(dqk_kernel<__nv_bfloat16>, dqk_kernel<__half>, kDqkThreads, bytes, p, stream,
                       dim3(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.hk)));
}

}  // namespace tree_recurrence::gdn::fused::kernels
