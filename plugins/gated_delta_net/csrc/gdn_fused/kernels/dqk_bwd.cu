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
// dq^, dk^ (fp32, chunk-major per value head) and dG go to workspaces; (c) adds the WY terms.
#include <cstdlib>

#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

// 16 warps per CTA, two CTAs per SM (~101 KB of shared memory at K = V = 128): two tile buffers
// are reused across the phases, all loads by cp.async:
//   A (C x V):            dO (dP, dq^)                 -> v_new (dk^)
//   X (max(K, C) x V):    v_new (dP) -> h (dq^)         -> dS (dk^)
// v_new is loaded twice and dS is read once more from global memory for <h, dS> (while h is in X).
constexpr int kDqkWarps = 16;
constexpr int kDqkThreads = kDqkWarps * 32;
static_assert((C / 16) * (C / 16) == kDqkWarps, "dqk: one C x C tile of dP / D per warp");

template <typename T>
__global__ void __launch_bounds__(kDqkThreads, 2) dqk_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const int64_t c = blockIdx.x, hv = blockIdx.y;
  const int64_t HV = p.hv, HK = p.hk, hk = hv / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldk = pitch_of(Kp), ldv = pitch_of(Vp);
  Smem sm{smem_raw};
  T* qh = sm.take<T>(C * ldk);
  T* kh = sm.take<T>(C * ldk);
  T* A = sm.take<T>(C * ldv);
  T* X = sm.take<T>((Kp > C ? Kp : C) * ldv);
  T* dP = sm.take<T>(C * kPitchC);
  float* G = sm.take<float>(C);
  float* partQ = sm.take<float>(C * 8);
  float* partT = sm.take<float>(C * 8);  // row parts of T (by K column tile)
  float* partD = sm.take<float>(C * 8);  // row parts of D (slots 0..3, by column tile), column parts (4..7, by row tile)
  int* lastRow = sm.take<int>(4);
  float* red = sm.take<float>(kDqkWarps + 1);
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
  if (threadIdx.x == 0) {
    int L = C - 1;
    for (int i = C - 1; i >= 0; --i)
      if (tok[i] >= 0) {
        L = i;
        break;
      }
    *lastRow = L;
  }
  const T* vn_g = static_cast<const T*>(p.v_new) + ch * C * V;
  const T* h_g = static_cast<const T*>(p.h) + ch * static_cast<int64_t>(K) * V;
  const T* dS_g = static_cast<const T*>(p.grad_state_out) + ch * static_cast<int64_t>(K) * V;
  async_matrix<T>(A, ldv, static_cast<const T*>(p.do_c) + ch * C * V, C, C, V, Vp);  // A = dO
  async_matrix<T>(X, ldv, vn_g, C, C, V, Vp);                                          // X = v_new
  mma::cp_async_commit();
  async_token_rows<T>(qh, ldk, static_cast<const T*>(p.q), tok, HK, hk, K, Kp);
  async_token_rows<T>(kh, ldk, static_cast<const T*>(p.k), tok, HK, hk, K, Kp);
  mma::cp_async_commit();
  mma::cp_async_wait<1>();
  __syncthreads();

  const int warp = threadIdx.x / 32;
  // dP(i, j) = exp(G_i - G_j) <dO_i, v_new_j> for j <= i: warp's tile (dr0, dc0), kept in fp32 (dpf)
  // for D and stored in-type for the dq^, dk^ products.
  const int dr0 = (warp / (C / 16)) * 16, dc0 = (warp % (C / 16)) * 16;
  float dpf[2][4];
  {
    FragC acc[1][2];
    zero(acc);
    if (dr0 + 15 >= dc0) tile_mma<T, true, false>(acc, A, ldv, X, ldv, dr0, dc0, Vp / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = el_row(dr0, e), j = el_col(dc0, nt, e);
        dpf[nt][e] = j <= i ? acc[0][nt].x[e] * expf(G[i] - G[j]) : 0.f;
        dP[i * kPitchC + j] = mma::Elem<T>::from_float(dpf[nt][e]);
      }
  }
  __syncthreads();  // every warp is done with X = v_new
  async_matrix<T>(X, ldv, h_g, K, Kp, V, Vp);  // X = h
  mma::cp_async_commit();
  mma::cp_async_wait<1>();  // q^, k^ are here (h may still be in flight)
  __syncthreads();
  scale_rows<T>(qh, ldk, Kp, rqs);  // q^ = scale rq q
  scale_rows<T>(kh, ldk, Kp, rks);  // k^ = rk k
  __syncthreads();
  // D = dP * (q^ k^T), strictly lower, on the warp's tile: row parts (quad butterfly) to partD slot
  // dc0 / 16, column parts (over the 8 row groups, then the two row halves) to slot 4 + dr0 / 16.
  {
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
  mma::cp_async_wait<0>();
  __syncthreads();  // X = h
  // <h, dS>: h from X, dS straight from global memory, 8 elements per step (fixed per-thread order,
  // then block_sum).
  float hds = 0.f;
  for (int idx = threadIdx.x; idx < K * (V / 8); idx += blockDim.x) {
    const int r = idx / (V / 8), c8 = (idx % (V / 8)) * 8;
    const uint4 gv = *reinterpret_cast<const uint4*>(dS_g + static_cast<int64_t>(r) * V + c8);
    const uint4 sv = *reinterpret_cast<const uint4*>(X + r * ldv + c8);
    const T* ge = reinterpret_cast<const T*>(&gv);
    const T* se = reinterpret_cast<const T*>(&sv);
#pragma unroll
    for (int m = 0; m < 8; ++m) hds += mma::Elem<T>::to_float(se[m]) * mma::Elem<T>::to_float(ge[m]);
  }

  const float g_last = G[C - 1];
  float* dq_out = p.dq_hv + ch * C * K;
  float* dk_out = p.dk_hv + ch * C * K;
  for (int t = warp; t < (C / 16) * (Kp / 16); t += kDqkWarps) {
    const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
    // dq^ = exp(G) (dO h^T) + dP k^; partQ: <exp(G_i) (dO h^T)_i, q^_i> (the inter-chunk term)
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, false>(acc, A, ldv, X, ldv, r0, c0, Vp / 16);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = el_row(r0, e), col = el_col(c0, nt, e);
        acc[0][nt].x[e] *= expf(G[i]);
        s[e >> 1] += acc[0][nt].x[e] * mma::Elem<T>::to_float(qh[i * ldk + col]);
      }
    tile_rowdot_store(s[0], s[1], partQ, r0, c0);
    tile_mma<T, true, true>(acc, dP, kPitchC, kh, ldk, r0, c0, C / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = el_row(r0, e), col = el_col(c0, nt, e);
        if (col < K) dq_out[i * K + col] = acc[0][nt].x[e];
      }
  }
  __syncthreads();  // every warp is done with A = dO and X = h
  async_matrix<T>(X, ldv, dS_g, K, Kp, V, Vp);  // X = dS
  async_matrix<T>(A, ldv, vn_g, C, C, V, Vp);   // A = v_new
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();
  for (int t = warp; t < (C / 16) * (Kp / 16); t += kDqkWarps) {
    const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
    // dk^ = exp(G_last - G) (v_new dS^T) + dP^T q^; partT: T_j
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, false>(acc, A, ldv, X, ldv, r0, c0, Vp / 16);
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        acc[0][nt].x[e] *= expf(g_last - G[j]);
        s[e >> 1] += acc[0][nt].x[e] * mma::Elem<T>::to_float(kh[j * ldk + col]);
      }
    tile_rowdot_store(s[0], s[1], partT, r0, c0);
    tile_mma<T, false, true>(acc, dP, kPitchC, qh, ldk, r0, c0, C / 16);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = el_row(r0, e), col = el_col(c0, nt, e);
        if (col < K) dk_out[j * K + col] = acc[0][nt].x[e];
      }
  }
  const float hds_all = block_sum<kDqkThreads>(hds, red);  // (contains __syncthreads: parts are complete after it)
  const int L = *lastRow;
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
    p.dG[ch * C + i] = d;
  }
}

size_t dqk_smem(const GdnBwdParams& p) {
  const int Kp = round16(static_cast<int>(p.k_dim)), ldk = pitch_of(Kp), ldv = pitch_of(round16(static_cast<int>(p.v_dim)));
  return 2 * smem_bytes<uint16_t>(C * ldk) + smem_bytes<uint16_t>(C * ldv) + smem_bytes<uint16_t>((Kp > C ? Kp : C) * ldv) +
         smem_bytes<uint16_t>(C * kPitchC) + smem_bytes<float>(C) + 3 * smem_bytes<float>(C * 8) + smem_bytes<int>(4) +
         smem_bytes<float>(kDqkWarps + 1) + 2 * smem_bytes<float>(C) + smem_bytes<int64_t>(C);
}

// ---------------------------------------------------------------------------------------------
// Version 2 (the default; TREE_RECURRENCE_GDN_DQK_V1=1 gives version 1 above): the same math in the
// same order, element for element (bit for bit the same dq_hv, dk_hv, dG), as a persistent kernel
// that loads the next item while it computes the current one. Version 1 waits for its operand tiles
// four times per (chunk, value head) with nothing else to do (latency-bound: 9 % of DRAM, 11 % of
// SM at two CTAs per SM).
//
// One CTA of 16 warps per SM (228,176 B of shared memory at K = V = 128; 109 registers) walks the items
// item = blockIdx.x, blockIdx.x + gridDim.x, ... (item = c * HV + hv: the chunk-major order of every
// buffer, so the two value heads of a key head follow each other and share q, k in L2). Buffers:
//   two operand slots (item parity): q, k, dO, v_new, rq, rk of one item
//   three table slots (item mod 3):  the gather row (tokens) and G of one item
//   Hb: h,  Db: dS,  dP, the row parts, the warp sums of <h, dS>, exp(G_i) and exp(G_last - G_j)
// Copy groups (cp.async, committed in this order, one set per item i):
//   A(i+1) = q, k, dO, v_new, rq, rk of item i+1 (its tokens landed with A(i)) + the tables of
//            item i+2; issued right after item i's first barrier: the whole item i to land
//   H(i+1) = h of item i+1 into Hb, issued when item i's dq^ tiles are done with Hb
//   D(i+1) = dS of item i+1 into Db, issued when item i's dk^ tiles are done with Db
// so h has item i's dk^ phase and the next item's first two phases to land, dS the next item's
// dP, D and dq^ phases. <h, dS> takes h from global memory (L2: Hb is already taking h of the next
// item), loaded into registers before the dk^ tiles and summed after them, in version 1's order.
// Barriers per item: 5 (B1 .. B4 below, B2b), no other wait. At K = 128 a warp's two dq^ (dk^) tiles
// share their column tile and are computed in one pass (tile_mma_pair: the B fragments loaded once).
// exp(G_i), exp(G_last - G_j) are formed once per row (the same expf of the same float as version 1's
// per-element calls).
constexpr int kDqk2Warps = 16;
constexpr int kDqk2Threads = kDqk2Warps * 32;
constexpr int kDqk2HdsPerThread = kBwdMaxDim * (kBwdMaxDim / 8) / kDqk2Threads;  // uint4 of h per thread (4)
static_assert(C == 64, "dqk v2: the last-row ballot reads 64 rows as two warps' ballots");
static_assert(kDqk2Threads >= 2 * C, "dqk v2: the table and rq / rk copies take one thread per row each");
static_assert(kBwdMaxDim * (kBwdMaxDim / 8) % kDqk2Threads == 0, "dqk v2: <h, dS> registers");

__device__ __forceinline__ void cp_async_8(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(mma::smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(mma::smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}

__host__ __device__ inline size_t dqk2_round(size_t bytes) { return (bytes + 15) / 16 * 16; }

// Byte offsets of version 2's shared memory (all multiples of 16), the same on host and device.
struct Dqk2Layout {
  int Kp, Vp, ldk, ldv;
  size_t qk_bytes, cv_bytes, row_bytes, slot_bytes, table_bytes, tables_off, hb_off, db_off, dp_off, part_off,
      red_off, eg_off, total;
  __host__ __device__ Dqk2Layout(int K, int V) {
    Kp = round16(K);
    Vp = round16(V);
    ldk = pitch_of(Kp);
    ldv = pitch_of(Vp);
    qk_bytes = dqk2_round(sizeof(uint16_t) * C * ldk);
    cv_bytes = dqk2_round(sizeof(uint16_t) * C * ldv);
    row_bytes = dqk2_round(sizeof(float) * C);
    slot_bytes = 2 * qk_bytes + 2 * cv_bytes + 2 * row_bytes;  // q, k, dO, v_new, rq, rk
    table_bytes = dqk2_round(sizeof(int64_t) * C) + row_bytes;  // tokens, G
    tables_off = 2 * slot_bytes;
    hb_off = tables_off + 3 * table_bytes;
    db_off = hb_off + dqk2_round(sizeof(uint16_t) * Kp * ldv);
    dp_off = db_off + dqk2_round(sizeof(uint16_t) * Kp * ldv);
    part_off = dp_off + dqk2_round(sizeof(uint16_t) * C * kPitchC);
    red_off = part_off + 3 * dqk2_round(sizeof(float) * C * 8);
    eg_off = red_off + dqk2_round(sizeof(float) * (kDqk2Warps + 1));
    total = eg_off + 2 * row_bytes;  // exp(G_i), exp(G_last - G_j) of the current item
  }
};

template <typename T>
struct Dqk2Slot {
  T *q, *k, *dO, *vn;
  float *rq, *rk;  // rq, rk of the rows' tokens (0 for padding rows), unscaled
  __device__ Dqk2Slot(char* smem, const Dqk2Layout& l, int s) {
    char* b = smem + static_cast<size_t>(s) * l.slot_bytes;
    q = reinterpret_cast<T*>(b);
    k = reinterpret_cast<T*>(b + l.qk_bytes);
    dO = reinterpret_cast<T*>(b + 2 * l.qk_bytes);
    vn = reinterpret_cast<T*>(b + 2 * l.qk_bytes + l.cv_bytes);
    rq = reinterpret_cast<float*>(b + 2 * l.qk_bytes + 2 * l.cv_bytes);
    rk = reinterpret_cast<float*>(b + 2 * l.qk_bytes + 2 * l.cv_bytes + l.row_bytes);
  }
};
struct Dqk2Tables {
  int64_t* tok;
  float* G;
  __device__ Dqk2Tables(char* smem, const Dqk2Layout& l, int s) {
    char* b = smem + l.tables_off + static_cast<size_t>(s) * l.table_bytes;
    tok = reinterpret_cast<int64_t*>(b);
    G = reinterpret_cast<float*>(b + dqk2_round(sizeof(int64_t) * C));
  }
};

// The tables of `item` (gather row, G): one 8-byte / 4-byte copy per row and thread.
__device__ inline void dqk2_issue_tables(const GdnBwdParams& p, int64_t item, const Dqk2Tables& tb) {
  const int i = threadIdx.x;
  if (i < C)
    cp_async_8(tb.tok + i, p.gather + (item / p.hv) * C + i, 8);
  else if (i < 2 * C)
    cp_async_4(tb.G + (i - C), p.G + item * C + (i - C), 4);
}
// The operand tiles of `item` into slot `sl`; its tokens (tb.tok) are visible to every thread.
template <typename T>
__device__ inline void dqk2_issue_operands(const GdnBwdParams& p, int64_t item, const Dqk2Layout& l, const Dqk2Tables& tb,
                                           const Dqk2Slot<T>& sl) {
  const int64_t HV = p.hv, HK = p.hk, hk = (item % HV) / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  async_token_rows<T>(sl.q, l.ldk, static_cast<const T*>(p.q), tb.tok, HK, hk, K, l.Kp);
  async_token_rows<T>(sl.k, l.ldk, static_cast<const T*>(p.k), tb.tok, HK, hk, K, l.Kp);
  async_matrix<T>(sl.dO, l.ldv, static_cast<const T*>(p.do_c) + item * C * V, C, C, V, l.Vp);
  async_matrix<T>(sl.vn, l.ldv, static_cast<const T*>(p.v_new) + item * C * V, C, C, V, l.Vp);
  const int i = threadIdx.x;
  if (i < 2 * C) {
    const int r = i % C;
    const int64_t t = tb.tok[r];
    const float* src = i < C ? p.rq : p.rk;
    float* dst = i < C ? sl.rq : sl.rk;
    cp_async_4(dst + r, t >= 0 ? src + t * HK + hk : src, t >= 0 ? 4 : 0);
  }
}
// A K x V matrix of `item` (h or dS) into Hb / Db.
template <typename T>
__device__ inline void dqk2_issue_state(const void* base, int64_t item, int K, int V, const Dqk2Layout& l, T* dst) {
  async_matrix<T>(dst, l.ldv, static_cast<const T*>(base) + item * static_cast<int64_t>(K) * V, K, l.Kp, V, l.Vp);
}
// Row r of a C x Dp tile times raw[r] * extra, rounded like scale_rows (raw[r] * extra is the row
// scale version 1 keeps: rq * scale, rk * 1).
template <typename T>
__device__ inline void dqk2_scale_rows(T* dst, int ld, int Dp, const float* raw, float extra) {
  const int per_row = Dp / 8;
  for (int idx = threadIdx.x; idx < C * per_row; idx += blockDim.x) {
    const int r = idx / per_row, c8 = (idx % per_row) * 8;
    uint4 val = *reinterpret_cast<const uint4*>(dst + r * ld + c8);
    const float s = raw[r] * extra;
    T* e = reinterpret_cast<T*>(&val);
#pragma unroll
    for (int m = 0; m < 8; ++m) e[m] = mma::Elem<T>::from_float(mma::Elem<T>::to_float(e[m]) * s);
    *reinterpret_cast<uint4*>(dst + r * ld + c8) = val;
  }
}

// Two 16 x 16 output tiles of one column tile c0 (rows ra.., rb..) in one pass: the B fragments are
// loaded once for both. Each accumulator sees the same operations in the same order as tile_mma.
template <typename T, bool A_ROW, bool B_KN>
__device__ __forceinline__ void tile_mma_pair(FragC (&acc0)[1][2], FragC (&acc1)[1][2], const T* A, int lda, const T* B,
                                              int ldb, int ra, int rb, int c0, int ksteps) {
  for (int kt = 0; kt < ksteps; ++kt) {
    const mma::FragA a0 = A_ROW ? mma::load_a_row(A + ra * lda + kt * 16, lda) : mma::load_a_col(A + kt * 16 * lda + ra, lda);
    const mma::FragA a1 = A_ROW ? mma::load_a_row(A + rb * lda + kt * 16, lda) : mma::load_a_col(A + kt * 16 * lda + rb, lda);
    mma::FragB b0, b1;
    if (B_KN)
      mma::load_b_kn(b0, b1, B + kt * 16 * ldb + c0, ldb);
    else
      mma::load_b_nk(b0, b1, B + c0 * ldb + kt * 16, ldb);
    mma::mma<T>(acc0[0][0], a0, b0);
    mma::mma<T>(acc0[0][1], a0, b1);
    mma::mma<T>(acc1[0][0], a1, b0);
    mma::mma<T>(acc1[0][1], a1, b1);
  }
}

template <typename T>
__global__ void __launch_bounds__(kDqk2Threads, 1) dqk_kernel_v2(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  const int64_t HV = p.hv, total = p.num_chunks * HV, stride = gridDim.x;
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const Dqk2Layout lay(K, V);
  const int Kp = lay.Kp, Vp = lay.Vp, ldk = lay.ldk, ldv = lay.ldv;
  T* Hb = reinterpret_cast<T*>(smem_raw + lay.hb_off);
  T* Db = reinterpret_cast<T*>(smem_raw + lay.db_off);
  T* dP = reinterpret_cast<T*>(smem_raw + lay.dp_off);
  float* partQ = reinterpret_cast<float*>(smem_raw + lay.part_off);
  float* partT = partQ + C * 8;  // row parts of T (by K column tile)
  float* partD = partT + C * 8;  // row parts of D (slots 0..3, by column tile), column parts (4..7, by row tile)
  float* red = reinterpret_cast<float*>(smem_raw + lay.red_off);
  float* eG = reinterpret_cast<float*>(smem_raw + lay.eg_off);  // exp(G_i): dq^'s inter-chunk scale
  float* eL = eG + C;                                           // exp(G_last - G_j): dk^'s
  const int warp = threadIdx.x / 32;

  int64_t item = blockIdx.x;
  if (item >= total) return;
  // prologue: tables of the first item; then A (its operands, the second item's tables), H, D
  dqk2_issue_tables(p, item, Dqk2Tables(smem_raw, lay, 0));
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();
  dqk2_issue_operands<T>(p, item, lay, Dqk2Tables(smem_raw, lay, 0), Dqk2Slot<T>(smem_raw, lay, 0));
  if (item + stride < total) dqk2_issue_tables(p, item + stride, Dqk2Tables(smem_raw, lay, 1));
  mma::cp_async_commit();
  dqk2_issue_state<T>(p.h, item, K, V, lay, Hb);
  mma::cp_async_commit();
  dqk2_issue_state<T>(p.grad_state_out, item, K, V, lay, Db);
  mma::cp_async_commit();

  for (int n = 0; item < total; ++n, item += stride) {
    const int b = n & 1, ts = n % 3;
    const Dqk2Slot<T> sl(smem_raw, lay, b);
    const Dqk2Tables tb(smem_raw, lay, ts);
    const float* G = tb.G;
    const int64_t next = item + stride, next2 = item + 2 * stride;
    const int64_t ch = item;

    // W0: A(item) has landed (pending: H(item), D(item))
    mma::cp_async_wait<2>();
    __syncthreads();  // B1: item - stride is done with every buffer but Hb / Db (refilled for this item)
    if (next < total)
      dqk2_issue_operands<T>(p, next, lay, Dqk2Tables(smem_raw, lay, (n + 1) % 3), Dqk2Slot<T>(smem_raw, lay, b ^ 1));
    if (next2 < total) dqk2_issue_tables(p, next2, Dqk2Tables(smem_raw, lay, (n + 2) % 3));
    mma::cp_async_commit();  // A(next)
    const float g_last = G[C - 1];
    if (threadIdx.x < C)
      eG[threadIdx.x] = expf(G[threadIdx.x]);  // the same expf of the same value as version 1's per element
    else if (threadIdx.x < 2 * C)
      eL[threadIdx.x - C] = expf(g_last - G[threadIdx.x - C]);

    // dP(i, j) = exp(G_i - G_j) <dO_i, v_new_j> for j <= i: warp's tile (dr0, dc0), kept in fp32 (dpf)
    // for D and stored in-type for the dq^, dk^ products.
    const int dr0 = (warp / (C / 16)) * 16, dc0 = (warp % (C / 16)) * 16;
    float dpf[2][4];
    {
      FragC acc[1][2];
      zero(acc);
      if (dr0 + 15 >= dc0) tile_mma<T, true, false>(acc, sl.dO, ldv, sl.vn, ldv, dr0, dc0, Vp / 16);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = el_row(dr0, e), j = el_col(dc0, nt, e);
          dpf[nt][e] = j <= i ? acc[0][nt].x[e] * expf(G[i] - G[j]) : 0.f;
          dP[i * kPitchC + j] = mma::Elem<T>::from_float(dpf[nt][e]);
        }
    }
    dqk2_scale_rows<T>(sl.q, ldk, Kp, sl.rq, p.scale);  // q^ = scale rq q
    dqk2_scale_rows<T>(sl.k, ldk, Kp, sl.rk, 1.f);      // k^ = rk k
    __syncthreads();  // B2: dP, q^, k^, eG, eL
    // D = dP * (q^ k^T), strictly lower, on the warp's tile: row parts (quad butterfly) to partD slot
    // dc0 / 16, column parts (over the 8 row groups, then the two row halves) to slot 4 + dr0 / 16.
    {
      FragC qk[1][2];
      zero(qk);
      if (dr0 + 15 > dc0) tile_mma<T, true, false>(qk, sl.q, ldk, sl.k, ldk, dr0, dc0, Kp / 16);
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
        for (int bb = 0; bb < 2; ++bb) {
          float x = cs[nt][bb];
          x += __shfl_xor_sync(0xffffffffu, x, 4);
          x += __shfl_xor_sync(0xffffffffu, x, 8);
          x += __shfl_xor_sync(0xffffffffu, x, 16);
          cs[nt][bb] = x;
        }
      const int l = mma::lane_id();
      if (l < 4) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int bb = 0; bb < 2; ++bb) partD[(dc0 + nt * 8 + 2 * l + bb) * 8 + 4 + dr0 / 16] = cs[nt][bb];
      }
    }
    // W1: H(item) has landed (pending: D(item), A(next))
    mma::cp_async_wait<2>();
    __syncthreads();  // B2b: Hb = h

    float* dq_out = p.dq_hv + ch * C * K;
    float* dk_out = p.dk_hv + ch * C * K;
    // dq^ = exp(G) (dO h^T) + dP k^; partQ: <exp(G_i) (dO h^T)_i, q^_i> (the inter-chunk term)
    auto dq_scale = [&](FragC(&acc)[1][2], int r0, int c0) {
      float s[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = el_row(r0, e), col = el_col(c0, nt, e);
          acc[0][nt].x[e] *= eG[i];
          s[e >> 1] += acc[0][nt].x[e] * mma::Elem<T>::to_float(sl.q[i * ldk + col]);
        }
      tile_rowdot_store(s[0], s[1], partQ, r0, c0);
    };
    // dk^ = exp(G_last - G) (v_new dS^T) + dP^T q^; partT: T_j
    auto dk_scale = [&](FragC(&acc)[1][2], int r0, int c0) {
      float s[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = el_row(r0, e), col = el_col(c0, nt, e);
          acc[0][nt].x[e] *= eL[j];
          s[e >> 1] += acc[0][nt].x[e] * mma::Elem<T>::to_float(sl.k[j * ldk + col]);
        }
      tile_rowdot_store(s[0], s[1], partT, r0, c0);
    };
    auto store = [&](const FragC(&acc)[1][2], float* out, int r0, int c0) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int eh = 0; eh < 2; ++eh) {  // elements (2 eh, 2 eh + 1): columns col, col + 1 of one row
          const int i = el_row(r0, 2 * eh), col = el_col(c0, nt, 2 * eh);
          if (col < K) *reinterpret_cast<float2*>(out + i * K + col) = make_float2(acc[0][nt].x[2 * eh], acc[0][nt].x[2 * eh + 1]);
        }
    };
    // K = 128 (8 column tiles, 32 tiles): warp w takes tiles (w / 8, w % 8) and (w / 8 + 2, w % 8),
    // version 1's two tiles of the warp, in one pass sharing the B fragments.
    const bool paired = Kp / 16 == 8 && (C / 16) * (Kp / 16) == 2 * kDqk2Warps;
    const int pc0 = (warp % 8) * 16, pra = (warp / 8) * 16, prb = pra + 2 * 16;
    if (paired) {
      FragC a0[1][2], a1[1][2];
      zero(a0);
      zero(a1);
      tile_mma_pair<T, true, false>(a0, a1, sl.dO, ldv, Hb, ldv, pra, prb, pc0, Vp / 16);
      dq_scale(a0, pra, pc0);
      dq_scale(a1, prb, pc0);
      tile_mma_pair<T, true, true>(a0, a1, dP, kPitchC, sl.k, ldk, pra, prb, pc0, C / 16);
      store(a0, dq_out, pra, pc0);
      store(a1, dq_out, prb, pc0);
    } else {
      for (int t = warp; t < (C / 16) * (Kp / 16); t += kDqk2Warps) {
        const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
        FragC acc[1][2];
        zero(acc);
        tile_mma<T, true, false>(acc, sl.dO, ldv, Hb, ldv, r0, c0, Vp / 16);
        dq_scale(acc, r0, c0);
        tile_mma<T, true, true>(acc, dP, kPitchC, sl.k, ldk, r0, c0, C / 16);
        store(acc, dq_out, r0, c0);
      }
    }
    // W2: D(item) has landed (pending: A(next))
    mma::cp_async_wait<1>();
    __syncthreads();  // B3: Db = dS; every warp is done with Hb
    if (next < total) dqk2_issue_state<T>(p.h, next, K, V, lay, Hb);
    mma::cp_async_commit();  // H(next)

    // <h, dS>: h of this item from global memory into registers now, summed after the dk^ tiles
    // (version 1's per-thread order: idx = tid, tid + 512, ..., 8 elements each).
    const T* h_g = static_cast<const T*>(p.h) + ch * static_cast<int64_t>(K) * V;
    const int nh = K * (V / 8);
    uint4 hreg[kDqk2HdsPerThread];
#pragma unroll
    for (int m = 0; m < kDqk2HdsPerThread; ++m) {
      const int idx = threadIdx.x + m * kDqk2Threads;
      hreg[m] = make_uint4(0, 0, 0, 0);
      if (idx < nh) {
        const int r = idx / (V / 8), c8 = (idx % (V / 8)) * 8;
        hreg[m] = *reinterpret_cast<const uint4*>(h_g + static_cast<int64_t>(r) * V + c8);
      }
    }
    if (paired) {
      FragC a0[1][2], a1[1][2];
      zero(a0);
      zero(a1);
      tile_mma_pair<T, true, false>(a0, a1, sl.vn, ldv, Db, ldv, pra, prb, pc0, Vp / 16);
      dk_scale(a0, pra, pc0);
      dk_scale(a1, prb, pc0);
      tile_mma_pair<T, false, true>(a0, a1, dP, kPitchC, sl.q, ldk, pra, prb, pc0, C / 16);
      store(a0, dk_out, pra, pc0);
      store(a1, dk_out, prb, pc0);
    } else {
      for (int t = warp; t < (C / 16) * (Kp / 16); t += kDqk2Warps) {
        const int r0 = (t / (Kp / 16)) * 16, c0 = (t % (Kp / 16)) * 16;
        FragC acc[1][2];
        zero(acc);
        tile_mma<T, true, false>(acc, sl.vn, ldv, Db, ldv, r0, c0, Vp / 16);
        dk_scale(acc, r0, c0);
        tile_mma<T, false, true>(acc, dP, kPitchC, sl.q, ldk, r0, c0, C / 16);
        store(acc, dk_out, r0, c0);
      }
    }
    float hds = 0.f;
#pragma unroll
    for (int m = 0; m < kDqk2HdsPerThread; ++m) {
      const int idx = threadIdx.x + m * kDqk2Threads;
      if (idx < nh) {
        const int r = idx / (V / 8), c8 = (idx % (V / 8)) * 8;
        const uint4 sv = *reinterpret_cast<const uint4*>(Db + r * ldv + c8);
        const T* he = reinterpret_cast<const T*>(&hreg[m]);
        const T* se = reinterpret_cast<const T*>(&sv);
#pragma unroll
        for (int e = 0; e < 8; ++e) hds += mma::Elem<T>::to_float(he[e]) * mma::Elem<T>::to_float(se[e]);
      }
    }
    // block_sum's order: a butterfly in each warp, then the warps' sums in order (by each dG thread)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) hds += __shfl_xor_sync(0xffffffffu, hds, o);
    if ((threadIdx.x & 31) == 0) red[warp] = hds;
    __syncthreads();  // B4: parts and warp sums complete; every warp is done with Db and the slot
    if (next < total) dqk2_issue_state<T>(p.grad_state_out, next, K, V, lay, Db);
    mma::cp_async_commit();  // D(next)

    if (threadIdx.x < C) {  // warps 0 and 1: one row each
      const int i = threadIdx.x, lane = threadIdx.x & 31;
      const unsigned lo = __ballot_sync(0xffffffffu, tb.tok[lane] >= 0);
      const unsigned hi = __ballot_sync(0xffffffffu, tb.tok[lane + 32] >= 0);
      const int L = hi ? 63 - __clz(hi) : (lo ? 31 - __clz(lo) : C - 1);  // the last row holding a token
      float hds_all = 0.f;
      for (int w = 0; w < kDqk2Warps; ++w) hds_all += red[w];
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
        float tsum = 0.f;  // sum_{j != L} T_j, in row order
        for (int j = 0; j < C; ++j)
          if (j != L) tsum += row_parts(partT, j, Kp / 16);
        d += expf(g_last) * hds_all + tsum;
      }
      p.dG[ch * C + i] = d;
    }
  }
  mma::cp_async_wait<0>();  // (only empty groups are left)
}

// TREE_RECURRENCE_GDN_DQK_V1=1 (read once): version 1.
bool dqk_use_v1() {
  static const bool on = [] {
    const char* e = std::getenv("TREE_RECURRENCE_GDN_DQK_V1");
    return e != nullptr && e[0] == '1';
  }();
  return on;
}

// nullptr when version 2 does not fit this device's shared memory (the caller runs version 1).
template <typename T>
const char* launch_v2(const GdnBwdParams& p, void* stream) {
  const Dqk2Layout lay(static_cast<int>(p.k_dim), static_cast<int>(p.v_dim));
  const int bytes = static_cast<int>(lay.total);
  int dev = 0, sms = 0, optin = 0, per_sm = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if ((e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) != cudaSuccess)
    return cudaGetErrorString(e);
  if (bytes > optin) return nullptr;
  if ((e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) return cudaGetErrorString(e);
  e = cudaFuncSetAttribute(dqk_kernel_v2<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  e = cudaFuncSetAttribute(dqk_kernel_v2<T>, cudaFuncAttributePreferredSharedMemoryCarveout,
                           static_cast<int>(cudaSharedmemCarveoutMaxShared));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if ((e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, dqk_kernel_v2<T>, kDqk2Threads, bytes)) != cudaSuccess)
    return cudaGetErrorString(e);
  if (per_sm < 1) return nullptr;
  const int64_t items = p.num_chunks * p.hv;
  const int64_t blocks = items < static_cast<int64_t>(sms) * per_sm ? items : static_cast<int64_t>(sms) * per_sm;
  dqk_kernel_v2<T><<<static_cast<unsigned>(blocks), kDqk2Threads, bytes, static_cast<cudaStream_t>(stream)>>>(p);
  return launch_error();
}

template <typename T>
const char* launch(const GdnBwdParams& p, void* stream) {
  if (p.num_chunks == 0) return "";
  if (!dqk_use_v1()) {
    const char* r = launch_v2<T>(p, stream);
    if (r != nullptr) return r;  // else: version 2 does not fit, version 1 runs
  }
  const size_t bytes = dqk_smem(p);
  cudaError_t e = cudaFuncSetAttribute(dqk_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return cudaGetErrorString(e);
  e = cudaFuncSetAttribute(dqk_kernel<T>, cudaFuncAttributePreferredSharedMemoryCarveout,
                           static_cast<int>(cudaSharedmemCarveoutMaxShared));
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
