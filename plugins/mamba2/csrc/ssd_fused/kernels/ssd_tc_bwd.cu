// Fused SSD (Mamba2) backward on tensor cores, the TensorCore route (chunk-64 inputs the 16-bit kernels refuse:
// mixed dtypes, unaligned views, fp32): the chunk-local products of ssd_bwd.cu (same math, same stage outputs;
// params_bwd.h has the layouts) on mma.sync m16n8k16 (sdk/include/tree_recurrence/kernels/mma.cuh), for chunk 64
// and P, N <= 128 within the device's shared memory:
//   local_tc  block per (chunk, head):  ds_local = (e^Lam . dy)^T C                      (P x N)
//   post_tc   block per (chunk, group), the group's heads in order:
//               cb = C B^T (lower) once; per head dyx = dy x^T, CS = C s^T, g = M^T dy + wlast B dS^T,
//               dx / ddt_direct / q / v, the d(dt A) scan (d_dtA, ddt, ddt_raw, dA partial), the head's
//               dC / dB terms (e^Lam dy) s and (wlast dt x) dS accumulated in registers and
//               sum_h dCB in shared memory; at the end dC += (sum dCB) B, dB += (sum dCB)^T C.
//             This replaces the cb, dyx, rows, dbdc and dtA kernels and their (NC, H, L, L) workspace.
// Operands are kept in fp32 in shared memory and split on fragment build into bf16 hi + lo
// (v = hi + lo + O(2^-17 v)); each tile product is hi*hi + hi*lo + lo*hi with fp32 accumulation, so
// the products keep ~2^-16 relative accuracy whatever the input type (fp32 stage tests included).
// Every sum has a fixed order (fixed mma order, xor-shuffle and fixed-order partial sums, heads in
// order): two runs give identical bits; no atomics. 64-bit global indexing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bwd_tiles.cuh"
#include "params_bwd.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {

namespace mm = tree_recurrence::kernels::mma;

constexpr int kL = kTcBwdChunk;       // the chunk of the tensor-core path (params_bwd.h)
constexpr int kLP = kL + 4;            // pitch of L x L tiles (floats)
constexpr int kPostWarps = 8, kPostThreads = kPostWarps * 32;
constexpr int kLocalWarps = 4, kLocalThreads = kLocalWarps * 32;
constexpr int kMaxDim = 128;           // P and N (padded to 16) at most
constexpr int kMaxColTiles = kMaxDim / 16;

using bwd_tiles::exp_le0;
using bwd_tiles::ld;
__device__ __forceinline__ void stt(void* p, BwdType t, int64_t i, float v) {
  switch (t) {
    case BwdType::BFloat16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); break;
    case BwdType::Float16: static_cast<__half*>(p)[i] = __float2half_rn(v); break;
    default: static_cast<float*>(p)[i] = v;
  }
}

// (a, b) -> bf16 pairs hi, lo with a = hi.x + lo.x (to ~2^-17 a), b likewise; the first element in the
// low half (the lower column / k index, as the fragments want).
__device__ __forceinline__ void split2(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(a - hf.x, b - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// acc[nt] (16 x 8 each: rows r0..r0+15, columns n0 + 8 nt ..) += sum_{k in [k_begin, k_end)} A(r, k) B(k, n),
// k_begin and k_end multiples of 16; fa(r, k) / fb(k, n) return fp32 values (zero outside the data).
// Fragment layouts as documented in mma.cuh.
// AX / BX: the A / B values are exact in bf16 (bf16 inputs), so their lo halves are zero and the
// products with them are skipped (adding those exact zeros would not change a bit).
__device__ __forceinline__ uint32_t pack_hi(float a, float b) { return mm::Elem<__nv_bfloat16>::pack(a, b); }

template <bool AX, bool BX, class FA, class FB>
__device__ __forceinline__ void mma_block_t(mm::FragC (&acc)[2], int r0, int n0, int k_begin, int k_end, FA fa, FB fb) {
  const int lane = static_cast<int>(threadIdx.x & 31), gq = lane >> 2, tq = lane & 3;
  for (int k0 = k_begin; k0 < k_end; k0 += 16) {
    mm::FragA ah, al;
    const int ka = k0 + 2 * tq;
    if constexpr (AX) {
      ah.x[0] = pack_hi(fa(r0 + gq, ka), fa(r0 + gq, ka + 1));
      ah.x[1] = pack_hi(fa(r0 + gq + 8, ka), fa(r0 + gq + 8, ka + 1));
      ah.x[2] = pack_hi(fa(r0 + gq, ka + 8), fa(r0 + gq, ka + 9));
      ah.x[3] = pack_hi(fa(r0 + gq + 8, ka + 8), fa(r0 + gq + 8, ka + 9));
    } else {
      split2(fa(r0 + gq, ka), fa(r0 + gq, ka + 1), ah.x[0], al.x[0]);
      split2(fa(r0 + gq + 8, ka), fa(r0 + gq + 8, ka + 1), ah.x[1], al.x[1]);
      split2(fa(r0 + gq, ka + 8), fa(r0 + gq, ka + 9), ah.x[2], al.x[2]);
      split2(fa(r0 + gq + 8, ka + 8), fa(r0 + gq + 8, ka + 9), ah.x[3], al.x[3]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int n = n0 + nt * 8 + gq;
      mm::FragB bh, bl;
      if constexpr (BX) {
        bh.x[0] = pack_hi(fb(ka, n), fb(ka + 1, n));
        bh.x[1] = pack_hi(fb(ka + 8, n), fb(ka + 9, n));
      } else {
        split2(fb(ka, n), fb(ka + 1, n), bh.x[0], bl.x[0]);
        split2(fb(ka + 8, n), fb(ka + 9, n), bh.x[1], bl.x[1]);
      }
      mm::mma<__nv_bfloat16>(acc[nt], ah, bh);
      if constexpr (!BX) mm::mma<__nv_bfloat16>(acc[nt], ah, bl);
      if constexpr (!AX) mm::mma<__nv_bfloat16>(acc[nt], al, bh);
    }
  }
}
// ax / bx at run time (block-uniform)
template <class FA, class FB>
__device__ __forceinline__ void mma_block(mm::FragC (&acc)[2], int r0, int n0, int k_begin, int k_end, FA fa, FB fb,
                                          bool ax = false, bool bx = false) {
  if (ax && bx)
    mma_block_t<true, true>(acc, r0, n0, k_begin, k_end, fa, fb);
  else if (ax)
    mma_block_t<true, false>(acc, r0, n0, k_begin, k_end, fa, fb);
  else if (bx)
    mma_block_t<false, true>(acc, r0, n0, k_begin, k_end, fa, fb);
  else
    mma_block_t<false, false>(acc, r0, n0, k_begin, k_end, fa, fb);
}
__device__ __forceinline__ void zero2(mm::FragC (&acc)[2]) {
  acc[0].zero();
  acc[1].zero();
}
// coordinates of accumulator element e of acc[nt] in a block at (r0, n0)
__device__ __forceinline__ int acc_row(int r0, int e) { return r0 + static_cast<int>((threadIdx.x & 31) >> 2) + ((e >> 1) << 3); }
__device__ __forceinline__ int acc_col(int n0, int nt, int e) {
  return n0 + nt * 8 + static_cast<int>((threadIdx.x & 3) << 1) + (e & 1);
}

// acc (block at (r0, n0)) += A B^T over k in [0, K): A(r, k) = A[r * ld + k], B(k, n) = B[n * ld + k]
__device__ __forceinline__ void mma_abt(mm::FragC (&acc)[2], int r0, int n0, int K, const float* A, const float* B,
                                        int ld, bool ax, bool bx) {
  mma_block(acc, r0, n0, 0, K, [&](int r, int k) { return A[r * ld + k]; }, [&](int k, int n) { return B[n * ld + k]; },
            ax, bx);
}
// block b of the 4 x 4 16x16 blocks of an L x L matrix: its origin (r0, n0) and acc = A B^T there (as mma_abt)
// on and below the diagonal blocks, 0 above
__device__ __forceinline__ void lower_abt(mm::FragC (&acc)[2], int b, int& r0, int& n0, int K, const float* A,
                                          const float* B, int ld, bool ax, bool bx) {
  r0 = (b / 4) * 16;
  n0 = (b % 4) * 16;
  zero2(acc);
  if (n0 <= r0) mma_abt(acc, r0, n0, K, A, B, ld, ax, bx);
}

// f(nt, e, r, n) for the 8 accumulator elements of acc[0..1] of a block at (r0, n0): element e of acc[nt]
// at row r, column n
template <class F>
__device__ __forceinline__ void for_acc_elems(int r0, int n0, F f) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) f(nt, e, acc_row(r0, e), acc_col(n0, nt, e));
}

__host__ __device__ constexpr int pad16(int64_t v) { return static_cast<int>((v + 15) / 16 * 16); }

// shared-memory plan of post_tc (floats; the int64 token table first)
struct PostPlan {
  int Pp, Np, PP, NP;  // padded dims and pitches
  int64_t off_B, off_C, off_cb, off_sdcb, off_W, off_dy, off_x, off_mat, off_small, floats;
  __host__ __device__ explicit PostPlan(int64_t P, int64_t N) {
    Pp = pad16(P);
    Np = pad16(N);
    PP = Pp + 4;
    NP = Np + 4;
    int64_t o = 2 * kL;  // 64 int64 tokens = 128 floats
    off_B = o; o += kL * NP;
    off_C = o; o += kL * NP;
    off_cb = o; o += kL * kLP;
    off_sdcb = o; o += kL * kLP;
    off_W = o; o += kL * kLP;
    off_dy = o; o += kL * PP;
    off_x = o; o += kL * PP;
    off_mat = o; o += static_cast<int64_t>(Pp) * NP;
    off_small = o; o += 8 * kL + 3 * kMaxColTiles * kL;
    floats = o;
  }
  __host__ __device__ int64_t bytes() const { return floats * 4; }
};

struct LocalPlan {
  int Pp, Np, PP, NP;
  int64_t off_dy, off_C, floats;
  __host__ __device__ explicit LocalPlan(int64_t P, int64_t N) {
    Pp = pad16(P);
    Np = pad16(N);
    PP = Pp + 4;
    NP = Np + 4;
    int64_t o = 2 * kL;
    off_dy = o; o += kL * PP;
    off_C = o; o += kL * NP;
    floats = o;
  }
  __host__ __device__ int64_t bytes() const { return floats * 4; }
};

// ---- local entering-state gradient: ds[c, h] = sum_i e^{Lam_i} dy_i^T C_i ----------------------
__global__ void __launch_bounds__(kLocalThreads) local_tc_kernel(BwdParams p) {
  extern __shared__ __align__(16) float sm[];
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const int64_t ch = blockIdx.x, c = ch / H, h = ch % H, g = h / (H / G);
  const LocalPlan pl(P, N);
  int64_t* tok = reinterpret_cast<int64_t*>(sm);
  float* dys = sm + pl.off_dy;
  float* Cs = sm + pl.off_C;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5;
  const bool bcx = p.bc_type == BwdType::BFloat16;  // C exact in bf16
  if (tid < kL) tok[tid] = p.gather[c * kL + tid];
  __syncthreads();
  const float* lam = p.Lam + ch * kL;
  const int lane = tid & 31;
  // rows over warps, columns over lanes (coalesced, no divisions)
  for (int i = warp; i < kL; i += kLocalWarps) {
    const int64_t t = tok[i];
    const float e = expf(lam[i]);
    for (int pp = lane; pp < pl.Pp; pp += 32)
      dys[i * pl.PP + pp] = (t >= 0 && pp < P) ? e * p.dy[(t * H + h) * P + pp] : 0.f;
    for (int n = lane; n < pl.Np; n += 32)
      Cs[i * pl.NP + n] = (t >= 0 && n < N) ? ld(p.C, p.bc_type, (t * G + g) * N + n) : 0.f;
  }
  __syncthreads();
  const int ncol = pl.Np / 16, nblk = (pl.Pp / 16) * ncol;
  const int PP = pl.PP, NP = pl.NP;
  float* out = p.ds + ch * P * N;
  for (int b = warp; b < nblk; b += kLocalWarps) {
    const int r0 = (b / ncol) * 16, n0 = (b % ncol) * 16;
    mm::FragC acc[2];
    zero2(acc);
    mma_block(acc, r0, n0, 0, kL, [&](int r, int k) { return dys[k * PP + r]; },
              [&](int k, int n) { return Cs[k * NP + n]; }, false, bcx);
    for_acc_elems(r0, n0, [&](int nt, int e, int r, int n) {
      if (r < P && n < N) out[static_cast<int64_t>(r) * N + n] = acc[nt].x[e];
    });
  }
}

// ---- everything after the state pass, block per (chunk, group) ------------------------------------
constexpr int kAccBlocks = (kL / 16) * (kMaxDim / 16) / kPostWarps;  // L x N 16x16 blocks per warp (4)

// f(u, r0, n0) for this warp's L x N blocks b = warp + 8 u < nblkN (origin (r0, n0); ncolN column blocks)
template <class F>
__device__ __forceinline__ void for_acc_blocks(int warp, int nblkN, int ncolN, F f) {
#pragma unroll
  for (int u = 0; u < kAccBlocks; ++u) {
    const int b = warp + kPostWarps * u;
    if (b < nblkN) f(u, (b / ncolN) * 16, (b % ncolN) * 16);
  }
}

__global__ void __launch_bounds__(kPostThreads, 1) post_tc_kernel(BwdParams p) {
  extern __shared__ __align__(16) float sm[];
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups, hpg = H / G;
  const int64_t c = blockIdx.x / G, g = blockIdx.x % G;
  const PostPlan pl(P, N);
  const int PP = pl.PP, NP = pl.NP, Pp = pl.Pp, Np = pl.Np;
  int64_t* tok = reinterpret_cast<int64_t*>(sm);
  float* Bs = sm + pl.off_B;
  float* Cs = sm + pl.off_C;
  float* cbs = sm + pl.off_cb;
  float* sdcb = sm + pl.off_sdcb;
  float* Wm = sm + pl.off_W;  // dyx, then W, then W's row-exclusive prefixes
  float* dys = sm + pl.off_dy;
  float* xs = sm + pl.off_x;
  float* mat = sm + pl.off_mat;  // s (P x N), then dS
  float* lam = sm + pl.off_small;
  float* dts = lam + kL;
  float* el = dts + kL;    // e^{Lam}
  float* wl = el + kL;     // e^{Lam_last - Lam}
  float* qs = wl + kL;
  float* vs = qs + kL;
  float* red = vs + kL;
  float* qpart = red + 2 * kL;  // [col tile][row]
  float* dpart = qpart + kMaxColTiles * kL;
  float* vpart = dpart + kMaxColTiles * kL;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5;
  const int lane = tid & 31, tq = lane & 3;
  // operands exact in bf16 (their lo products skipped)
  const bool bcx = p.bc_type == BwdType::BFloat16, xx = p.x_type == BwdType::BFloat16,
             sx = p.states_type == BwdType::BFloat16;

  if (tid < kL) tok[tid] = p.gather[c * kL + tid];
  __syncthreads();
  // loads: rows over warps, columns over lanes (coalesced, no divisions)
  for (int i = warp; i < kL; i += kPostWarps) {
    const int64_t t = tok[i];
    for (int n = lane; n < Np; n += 32) {
      const bool ok = t >= 0 && n < N;
      Bs[i * NP + n] = ok ? ld(p.B, p.bc_type, (t * G + g) * N + n) : 0.f;
      Cs[i * NP + n] = ok ? ld(p.C, p.bc_type, (t * G + g) * N + n) : 0.f;
    }
  }
  for (int e = tid; e < kL * kLP; e += kPostThreads) sdcb[e] = 0.f;
  __syncthreads();

  // cb = C B^T, lower triangle, to shared memory and to the stage output
  for (int b = warp; b < 16; b += kPostWarps) {
    int r0, n0;
    mm::FragC acc[2];
    lower_abt(acc, b, r0, n0, Np, Cs, Bs, NP, bcx, bcx);
    float* cbo = p.cb + (c * G + g) * kL * kL;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = acc_row(r0, e), j = acc_col(n0, nt, e);
        const float v = j <= r ? acc[nt].x[e] : 0.f;
        cbs[r * kLP + j] = v;
        cbo[r * kL + j] = v;
      }
  }

  // the group's dC / dB: this warp's L x N blocks b = warp + 8 u
  const int ncolN = Np / 16, nblkN = (kL / 16) * ncolN;
  const int ncolP = Pp / 16, nblkP = (kL / 16) * ncolP;
  mm::FragC accC[kAccBlocks][2], accB[kAccBlocks][2];
#pragma unroll
  for (int u = 0; u < kAccBlocks; ++u) {
    zero2(accC[u]);
    zero2(accB[u]);
  }
  __syncthreads();

  for (int64_t hh = 0; hh < hpg; ++hh) {
    const int64_t h = g * hpg + hh, ch = c * H + h;
    if (tid < kL) {
      const float lv = p.Lam[ch * kL + tid];
      lam[tid] = lv;
      dts[tid] = p.dt[ch * kL + tid];
      el[tid] = expf(lv);
      wl[tid] = exp_le0(p.Lam[ch * kL + kL - 1] - lv);
    }
    for (int i = warp; i < kL; i += kPostWarps) {
      const int64_t t = tok[i];
      for (int pp = lane; pp < Pp; pp += 32) {
        const bool ok = t >= 0 && pp < P;
        dys[i * PP + pp] = ok ? p.dy[(t * H + h) * P + pp] : 0.f;
        xs[i * PP + pp] = ok ? ld(p.x, p.x_type, (t * H + h) * P + pp) : 0.f;
      }
    }
    const int64_t sbase = ch * P * N;
    for (int pp = warp; pp < Pp; pp += kPostWarps)
      for (int n = lane; n < Np; n += 32)
        mat[pp * NP + n] = (pp < P && n < N) ? ld(p.states, p.states_type, sbase + pp * N + n) : 0.f;
    __syncthreads();

    // dyx = dy x^T (lower blocks)
    for (int b = warp; b < 16; b += kPostWarps) {
      int r0, n0;
      mm::FragC acc[2];
      lower_abt(acc, b, r0, n0, Pp, dys, xs, PP, false, xx);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) Wm[acc_row(r0, e) * kLP + acc_col(n0, nt, e)] = acc[nt].x[e];
    }
    // CS = C s^T (L x P): q partials <dy_r, CS_r> per column tile
    for (int b = warp; b < nblkP; b += kPostWarps) {
      const int r0 = (b / ncolP) * 16, ct = b % ncolP, n0 = ct * 16;
      mm::FragC acc[2];
      zero2(acc);
      mma_abt(acc, r0, n0, Np, Cs, mat, NP, bcx, sx);
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float v = acc[nt].x[e] * dys[acc_row(r0, e) * PP + acc_col(n0, nt, e)];
          if (e < 2) s0 += v; else s1 += v;
        }
      bwd_tiles::quad_sum(s0);
      bwd_tiles::quad_sum(s1);
      if (tq == 0) {
        qpart[ct * kL + acc_row(r0, 0)] = s0;
        qpart[ct * kL + acc_row(r0, 2)] = s1;
      }
    }
    // dC head term: (e^Lam . dy) s
    for_acc_blocks(warp, nblkN, ncolN, [&](int u, int r0, int n0) {
      mma_block(accC[u], r0, n0, 0, Pp, [&](int r, int k) { return el[r] * dys[r * PP + k]; },
                [&](int k, int n) { return mat[k * NP + n]; }, false, sx);
    });
    __syncthreads();

    // dS into mat; dCB summed over the heads, W = cb . dCB
    for (int pp = warp; pp < Pp; pp += kPostWarps)
      for (int n = lane; n < Np; n += 32) mat[pp * NP + n] = (pp < P && n < N) ? p.ds[sbase + pp * N + n] : 0.f;
    for (int e = tid; e < kL * kL; e += kPostThreads) {
      const int i = e / kL, j = e % kL;
      const float d = j <= i ? exp_le0(lam[i] - lam[j]) * dts[j] * Wm[i * kLP + j] : 0.f;
      sdcb[i * kLP + j] += d;
      Wm[i * kLP + j] = cbs[i * kLP + j] * d;
    }
    __syncthreads();

    // g = M^T dy + wlast . (B dS^T); dx, ddt_direct and v partials
    const float* Dh = p.D != nullptr ? p.D + h * P : nullptr;
    for (int b = warp; b < nblkP; b += kPostWarps) {
      const int r0 = (b / ncolP) * 16, ct = b % ncolP, n0 = ct * 16;
      mm::FragC aS[2], aG[2];
      zero2(aS);
      zero2(aG);
      mma_abt(aS, r0, n0, Np, Bs, mat, NP, bcx, false);
      mma_block(aG, r0, n0, r0, kL,
                [&](int r, int k) { return k >= r ? cbs[k * kLP + r] * exp_le0(lam[k] - lam[r]) : 0.f; },
                [&](int k, int n) { return dys[k * PP + n]; });
      float d0 = 0.f, d1 = 0.f, v0 = 0.f, v1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = acc_row(r0, e), pc = acc_col(n0, nt, e);
          const float gv = aG[nt].x[e] + wl[j] * aS[nt].x[e];
          const float xv = xs[j * PP + pc];
          const int64_t t = tok[j];
          if (t >= 0 && pc < P)
            stt(p.dx_out, p.dx_type, (t * H + h) * P + pc,
                dts[j] * gv + (Dh != nullptr ? Dh[pc] * dys[j * PP + pc] : 0.f));
          if (e < 2) {
            d0 += xv * gv;
            v0 += xv * aS[nt].x[e];
          } else {
            d1 += xv * gv;
            v1 += xv * aS[nt].x[e];
          }
        }
      bwd_tiles::store_dv_partials(d0, d1, v0, v1, dpart + ct * kL, vpart + ct * kL, acc_row(r0, 0), acc_row(r0, 2), tq);
    }
    // dB head term: (wlast dt . x) dS
    for_acc_blocks(warp, nblkN, ncolN, [&](int u, int r0, int n0) {
      mma_block(accB[u], r0, n0, 0, Pp, [&](int r, int k) { return wl[r] * dts[r] * xs[r * PP + k]; },
                [&](int k, int n) { return mat[k * NP + n]; });
    });
    // row-exclusive prefixes of W in place (W is read by nobody else until the next barrier)
    if (tid < kL) bwd_tiles::row_exclusive_prefix(Wm + tid * kLP, kL);
    __syncthreads();

    // rows: q, v, ddt_direct, then the d(dt A) scan (ddt from the register copy of ddt_direct)
    bwd_tiles::head_rows<kLP>(p, tid, lam, qpart, dpart, vpart, ncolP, Wm, tok, ch, H, h);
    // the next head overwrites lam, dts, dys, xs, mat, Wm, the partials
    __syncthreads();
  }

  // dC += (sum dCB) B, dB += (sum dCB)^T C; store
  for_acc_blocks(warp, nblkN, ncolN, [&](int u, int r0, int n0) {
    mma_block(accC[u], r0, n0, 0, r0 + 16, [&](int r, int k) { return sdcb[r * kLP + k]; },
              [&](int k, int n) { return Bs[k * NP + n]; }, false, bcx);
    mma_block(accB[u], r0, n0, r0, kL, [&](int r, int k) { return sdcb[k * kLP + r]; },
              [&](int k, int n) { return Cs[k * NP + n]; }, false, bcx);
    for_acc_elems(r0, n0, [&](int nt, int e, int r, int n) {
      const int64_t t = tok[r];
      if (t >= 0 && n < N) {
        p.dC[(t * G + g) * N + n] = accC[u][nt].x[e];
        p.dB[(t * G + g) * N + n] = accB[u][nt].x[e];
      }
    });
  });
}

int max_smem_optin() {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
  return v;
}

// blocks x threads of kern with bytes of dynamic shared memory on stream (nothing when blocks is 0)
int launch(void (*kern)(BwdParams), int64_t blocks, int threads, int64_t bytes, const BwdParams& p, void* stream) {
  if (blocks == 0) return 0;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  kern<<<static_cast<unsigned>(blocks), threads, static_cast<int>(bytes), static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool ssd_bwd_tc_supported(const BwdParams& p) {
  if (p.chunk != kL || p.head_dim < 1 || p.head_dim > kMaxDim || p.state_dim < 1 || p.state_dim > kMaxDim) return false;
  if (p.groups < 1 || p.heads % p.groups != 0) return false;
  const int64_t need = PostPlan(p.head_dim, p.state_dim).bytes();
  return need <= max_smem_optin();
}

int ssd_bwd_local_tc(const BwdParams& p, void* stream) {
  if (p.ds16 != nullptr) return static_cast<int>(cudaErrorInvalidValue);  // writes the fp32 ds
  return launch(local_tc_kernel, p.num_chunks * p.heads, kLocalThreads, LocalPlan(p.head_dim, p.state_dim).bytes(), p,
                stream);
}

int ssd_bwd_post_tc(const BwdParams& p, void* stream) {
  if (p.ds16 != nullptr) return static_cast<int>(cudaErrorInvalidValue);  // reads the fp32 ds
  return launch(post_tc_kernel, p.num_chunks * p.groups, kPostThreads, PostPlan(p.head_dim, p.state_dim).bytes(), p,
                stream);
}

}  // namespace tree_recurrence::ssd::fused::kernels
