// Fused SSD (Mamba2) backward, the post-state-pass kernel on bf16 / fp16 tensor cores (the Half route's).
// Same math and stage outputs as post_tc (ssd_tc_bwd.cu; params_bwd.h has the layouts):
//   block per (chunk, group), 8 warps, the group's heads in order:
//     cb = C B^T (lower) once; per head: CS = C s^T -> q partials, dC += (e^Lam . dy) s,
//     g = M^T dy + wlast . (B dS^T) -> dx, ddt_direct, v partials, dB += (wlast dt . x) dS,
//     dyx = dy x^T -> dCB (summed over heads) and W = cb . dCB -> the d(dt A) scan, ddt, ddt_raw, dA;
//     at the end dC += (sum dCB) B, dB += (sum dCB)^T C.
// Differences from post_tc:
//   * every operand is a bf16 / fp16 (the input type) tile in shared memory, pitch = width + 8 elements
//     (16-byte aligned rows, conflict-free ldmatrix); fragments by ldmatrix; ONE mma per product;
//     fp32 accumulators; the d(dt A) scan, ddt and dA sums in fp32 on CUDA cores (as post_tc);
//   * dy = dout silu(z) (dout without z) formed from dout, z (16-byte cp.async of a thread's rows, all in flight
//     at once), rounded once to the input type for the products and the D dy term of dx; dz = dout y silu'(z)
//     written to dz_out in z's type; dD_part[c, h, p] = sum_i dy_i,p x_i,p (fp32, fixed order) when set;
//   * ds_leave read in the input type (p.ds16), by cp.async overlapped with the wlast dt . x and M tiles;
//   * cb and sum_h dCB are kept in fp32 in "fragment order" (the 10 lower 16x16 blocks of L x L, each
//     warp its own blocks, float4 per lane): 10 KB each instead of L x L tiles;
//   * W (fp32 L x L) lives over the dead M^T and scaled-operand tiles (dyx is computed last per head);
//   * the row tail (head_rows_warp) runs on warp 0 alone under __syncwarp while warps 1..7 write the head's dz and
//     issue the next head's s: 6 block barriers per head, block-wide only (a named barrier over part of the block
//     made racecheck report hazards across the head loop's block barriers);
//   * the k loops of CS, B dS^T, M^T dy and dy x^T unrolled by 2 (the next step's ldmatrix in flight during this
//     step's mma; the same mma order).
// Shared memory at P 64, N 128 (bytes): tokens 512, cb / sum dCB 2 x 10240, small 1792, M^T + scaled
// operand (W over them) 18432, B / C 2 x 17408, dy / x 2 x 9216, s then dS 17408, q / ddt / v partials
// 3072: 114944 B (112.25 KiB) -> 2 CTAs per SM (2 x (112.25 + 1) KiB <= 228 KiB); 8 warps, 128 registers
// (launch bound), 0 spills. P, N 128: ~150 KB, 1 CTA/SM.
// Registers: the group's dC and dB accumulators (2 x 64 x N fp32 over 256 threads = 64 per thread) stay
// live over the 16 heads; everything else fits in the other 64.
// Bytes per (chunk, group) at P 64, N 128, 16 heads: B, C 32 KB once; per head x, dout, z, y 8 KB each,
// s and dS 16 KB each read, dx, dz 8 KB each written (+ dout, z re-read from L2 by the dz pass); ~1.2k mma per head.
// Deterministic: fixed mma order, xor shuffles and fixed-order partial sums, heads in order; no
// atomics. 64-bit global indexing. Requirements: ssd_bwd_post_bf16_supported.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bwd_tiles.cuh"
#include "fwd_tiles.cuh"
#include "params_bwd.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {

namespace mm = tree_recurrence::kernels::mma;

constexpr int kL = 64;
constexpr int kLW = kL + 4;  // fp32 L x L pitch (floats)
constexpr int kLT = kL + 8;  // 16-bit L x L pitch (elements)
constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kMaxDim = 128;
constexpr int kLowBlocks = 10;  // lower 16x16 blocks of an L x L matrix
constexpr int kMaxAcc = 4;      // L x N 16x16 accumulator blocks per warp (N <= 128)

__host__ __device__ constexpr int pad16(int64_t v) { return static_cast<int>((v + 15) / 16 * 16); }

struct Plan {
  int Pp, Np, PT, NT, ncolP;  // padded dims, 16-bit pitches (elements), 16-column tiles of P
  int off_B, off_C, off_cbf, off_sdf, off_dy, off_x, off_mat, off_wr, off_sc, off_small, off_parts, bytes;  // bytes
  __host__ __device__ explicit Plan(int64_t P, int64_t N) {
    Pp = pad16(P);
    Np = pad16(N);
    PT = Pp + 8;
    NT = Np + 8;
    ncolP = Pp / 16;
    // dims-independent arrays first (compile-time offsets in the kernel: no address registers), then the rest
    off_cbf = kL * 8;  // after the int32 tokens (room of int64 ones: 16-byte alignment)
    off_sdf = off_cbf + kLowBlocks * 256 * 4;
    off_small = off_sdf + kLowBlocks * 256 * 4;  // lam, dt, e^Lam, wlast, q, v, red (7 x L floats)
    // W region: M^T (L x kLT) then the scaled operand (L x PT, at least 8 KB): fp32 W (L x kLW) and the dD
    // partials (<= 8 KB, over M^T) and at the end sum dCB in the input type (L x kLT) over them
    off_wr = off_small + 7 * kL * 4;
    off_sc = off_wr + kL * kLT * 2;
    const int sc_bytes = kL * PT * 2 > kL * kLW * 4 - kL * kLT * 2 ? kL * PT * 2 : kL * kLW * 4 - kL * kLT * 2;
    int o = off_sc + sc_bytes;
    off_B = o; o += kL * NT * 2;
    off_C = o; o += kL * NT * 2;
    off_dy = o; o += kL * PT * 2;
    off_x = o; o += kL * PT * 2;
    off_mat = o; o += Pp * NT * 2;
    off_parts = o; o += 3 * ncolP * kL * 4;  // q, ddt_direct, v partials [col tile][row]
    bytes = o;
  }
};

__device__ __forceinline__ float exp_le0(float v) { return expf(fminf(v, 0.f)); }

using bwd_tiles::unpack2;
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const float2 a = unpack2<T>(v.x), b = unpack2<T>(v.y), c = unpack2<T>(v.z), d = unpack2<T>(v.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}
using tiles::pack8;  // fwd_tiles.cuh's: 8 floats -> 8 elements of T (RN), pairs in order
// sigmoid by the fast exp / division (MUFU; relative error ~1e-7, far below the 16-bit rounding of dy / dz);
// z -> -inf: 1 / inf = 0
__device__ __forceinline__ float sigm(float z) { return __fdividef(1.f, 1.f + __expf(-z)); }

// lower block blk (0..9) -> its first row r0 and first column c0
__device__ __forceinline__ void low_block(int blk, int& r0, int& c0) {
  const int rb = blk < 1 ? 0 : (blk < 3 ? 1 : (blk < 6 ? 2 : 3));
  const int cbk = blk - rb * (rb + 1) / 2;
  r0 = rb * 16;
  c0 = cbk * 16;
}
// blk's float4 of this lane in a fragment-order array (acc[nt] of the 16x16 block)
__device__ __forceinline__ float4* frag4(float* base, int blk, int nt, int lane) {
  return reinterpret_cast<float4*>(base + ((blk * 2 + nt) * 32 + lane) * 4);
}
__device__ __forceinline__ void zero2(mm::FragC (&acc)[2]) {
  acc[0].zero();
  acc[1].zero();
}
// step(k0) for k0 = kb, kb + 16, .. < ke (U2: unrolled by 2): the k loop of mma_abt / mma_atb
template <bool U2, class Step>
__device__ __forceinline__ void k_loop(int kb, int ke, Step step) {
  if constexpr (U2) {
#pragma unroll 2
    for (int k0 = kb; k0 < ke; k0 += 16) step(k0);
  } else {
#pragma unroll 1
    for (int k0 = kb; k0 < ke; k0 += 16) step(k0);
  }
}
// acc (16 x 16) += A B^T, k in [kb, ke): A this block's 16 rows (pitch lda), B its 16 columns as rows (pitch ldb),
// both k-contiguous
// (U2: the k loop unrolled by 2, the next step's fragments loaded while this step's mma run; same mma order)
template <typename T, bool U2 = false>
__device__ __forceinline__ void mma_abt(mm::FragC (&acc)[2], const T* A, int lda, const T* B, int ldb, int kb, int ke) {
  k_loop<U2>(kb, ke, [&](int k0) {
    const mm::FragA a = mm::load_a_row(A + k0, lda);
    mm::FragB b0, b1;
    mm::load_b_nk(b0, b1, B + k0, ldb);
    mm::mma<T>(acc[0], a, b0);
    mm::mma<T>(acc[1], a, b1);
  });
}
// acc (16 x 16) += A^T B, k in [kb, ke): A's 16 columns from A (pitch lda), B's 16 columns from B (pitch ldb),
// both row k at k * ld
template <typename T, bool U2 = false>
__device__ __forceinline__ void mma_atb(mm::FragC (&acc)[2], const T* A, int lda, const T* B, int ldb, int kb, int ke) {
  k_loop<U2>(kb, ke, [&](int k0) {
    const mm::FragA a = mm::load_a_col(A + k0 * lda, lda);
    mm::FragB b0, b1;
    mm::load_b_kn(b0, b1, B + k0 * ldb, ldb);
    mm::mma<T>(acc[0], a, b0);
    mm::mma<T>(acc[1], a, b1);
  });
}
// f(blk, r0, c0) for this warp's lower blocks blk = warp + 8 i (origin (r0, c0)), one at a time
template <class F>
__device__ __forceinline__ void for_low_blocks(int warp, F f) {
  #pragma unroll 1
  for (int blk = warp; blk < kLowBlocks; blk += kWarps) {
    int r0, c0;
    low_block(blk, r0, c0);
    f(blk, r0, c0);
  }
}
// for this warp's lower blocks blk of A B^T (A, B: L rows, pitch ld, K columns; blocks blk = warp + 8 i):
// f(blk, r0, c0, acc) with the block's origin and acc = the product there
template <typename T, bool U2 = false, class F>
__device__ __forceinline__ void low_block_products(int warp, const T* A, const T* B, int ld, int K, F f) {
  for_low_blocks(warp, [&](int blk, int r0, int c0) {
    mm::FragC acc[2];
    zero2(acc);
    mma_abt<T, U2>(acc, A + r0 * ld, ld, B + c0 * ld, ld, 0, K);
    f(blk, r0, c0, acc);
  });
}
// the 16-bit pair (a, b) at row i0, (c, d) at row i0 + 8, columns j0, j0 + 1 of dst (pitch ld)
template <typename T>
__device__ __forceinline__ void store_pairs(T* dst, int ld, int i0, int j0, float a, float b, float c, float d) {
  *reinterpret_cast<uint32_t*>(dst + i0 * ld + j0) = mm::Elem<T>::pack(a, b);
  *reinterpret_cast<uint32_t*>(dst + (i0 + 8) * ld + j0) = mm::Elem<T>::pack(c, d);
}
// acc[u] += A (rows r0s.. of this warp's strip) Bm (column blocks half * nbh + u < ncolN), k in [kb, ke);
// A_COL: A(r, k) at A[k * lda + r] (else A[r * lda + k]); Bm(k, n) at Bm[k * ldb + n]
template <typename T, bool A_COL>
__device__ __forceinline__ void acc_gemm(mm::FragC (&acc)[kMaxAcc][2], const T* A, int lda, const T* Bm, int ldb, int kb,
                                         int ke, int r0s, int half, int nbh, int ncolN) {
  #pragma unroll 1
  for (int k0 = kb; k0 < ke; k0 += 16) {
    const mm::FragA a = A_COL ? mm::load_a_col(A + k0 * lda + r0s, lda) : mm::load_a_row(A + r0s * lda + k0, lda);
#pragma unroll
    for (int u = 0; u < kMaxAcc; ++u) {
      const int cb = half * nbh + u;
      if (u < nbh && cb < ncolN) {
        mm::FragB b0, b1;
        mm::load_b_kn(b0, b1, Bm + k0 * ldb + cb * 16, ldb);
        mm::mma<T>(acc[u][0], a, b0);
        mm::mma<T>(acc[u][1], a, b1);
      }
    }
  }
}

// 2 elements of a dy row piece in fp32 from the packed pairs of dout (dw) and z (zw): dout z sigmoid(z) (dout
// without kZ)
template <typename T, bool kZ>
__device__ __forceinline__ float2 dy_pair(uint32_t dw, uint32_t zw) {
  float2 dy2 = unpack2<T>(dw);
  if constexpr (kZ) {
    const float2 z2 = unpack2<T>(zw);
    dy2.x = dy2.x * z2.x * sigm(z2.x);
    dy2.y = dy2.y * z2.y * sigm(z2.y);
  }
  return dy2;
}
// dz of an element pair from packed pairs of dout (dw), z (zw), y (yw): dout y silu'(z) = dout y s (1 + z (1 - s)),
// s = sigmoid(z), rounded to T and packed.
// dz_pair_y: the same from y in fp32 (y0, y1; the recomputed y of kRecY).
template <typename T>
__device__ __forceinline__ uint32_t dz_pair_y(uint32_t dw, uint32_t zw, float y0, float y1) {
  const float2 g2 = unpack2<T>(dw), z2 = unpack2<T>(zw);
  const float s0 = sigm(z2.x), s1 = sigm(z2.y);
  return mm::Elem<T>::pack(g2.x * y0 * s0 * (1.f + z2.x * (1.f - s0)), g2.y * y1 * s1 * (1.f + z2.y * (1.f - s1)));
}
template <typename T>
__device__ __forceinline__ uint32_t dz_pair(uint32_t dw, uint32_t zw, uint32_t yw) {
  const float2 y2 = unpack2<T>(yw);
  return dz_pair_y<T>(dw, zw, y2.x, y2.y);
}

// one row piece's inputs (16-byte words of x, dout, z) and Lam of the row
struct RowIn {
  uint4 x, d, z;
  float lam;
};
// row i's dy, e^Lam . dy, x into shared memory (16-byte words), the dD partial sums (wdD)
template <typename T, bool kZ>
__device__ __forceinline__ void store_row(const RowIn& r, int i, int lrow0, int lcc, int PT, bool wdD, T* dys, T* sc,
                                             T* xs, float (&dDa)[8]) {
  const float ei = expf(r.lam);
  const uint32_t xw4[4] = {r.x.x, r.x.y, r.x.z, r.x.w}, dw4[4] = {r.d.x, r.d.y, r.d.z, r.d.w};
  const uint32_t zw4[4] = {r.z.x, r.z.y, r.z.z, r.z.w};
  uint32_t dyw[4], scw[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float2 dy2 = dy_pair<T, kZ>(dw4[w], zw4[w]);
    dyw[w] = mm::Elem<T>::pack(dy2.x, dy2.y);
    scw[w] = mm::Elem<T>::pack(ei * dy2.x, ei * dy2.y);
    if (wdD) {
      const float2 x2 = unpack2<T>(xw4[w]);
      const float a0 = dy2.x * x2.x, a1 = dy2.y * x2.y;
      dDa[2 * w] = i == lrow0 ? a0 : dDa[2 * w] + a0;
      dDa[2 * w + 1] = i == lrow0 ? a1 : dDa[2 * w + 1] + a1;
    }
  }
  *reinterpret_cast<uint4*>(dys + i * PT + lcc * 8) = make_uint4(dyw[0], dyw[1], dyw[2], dyw[3]);
  *reinterpret_cast<uint4*>(sc + i * PT + lcc * 8) = make_uint4(scw[0], scw[1], scw[2], scw[3]);
  *reinterpret_cast<uint4*>(xs + i * PT + lcc * 8) = r.x;
}
// this CTA's y scratch (kRecY: L x P in T; formed where used, not held in registers over the head loop)
template <typename T>
__device__ __forceinline__ T* y_scratch_of(const BwdParams& p, int P) {
  return static_cast<T*>(p.y_scratch) + static_cast<int64_t>(blockIdx.x) * kL * P;
}
// dz = dout y silu'(z) in z's type for the head's rows, 8-byte pieces e = first, first + step, .. of the L x (Pp / 4)
// pieces (8 bytes: fewer live registers next to the dC / dB accumulators), on warps 1..7 during the row tail.
// kYScratch: y from the CTA's scratch (y_scratch_of: row i at i * P, written by this CTA's CS step before the head's
// barriers: an L2 load, ld.global.cg, which sees them; not the read-only path), else the stored y.
template <typename T, bool kYScratch = false>
__device__ __forceinline__ void dz_rows(const BwdParams& p, const int* tok, int h, int H, int P, int Pp, int first,
                                           int step) {
  const T* gdo = static_cast<const T*>(p.dout);
  const T* gz = static_cast<const T*>(p.z);
  const T* gy = static_cast<const T*>(p.y);
  T* gdz = static_cast<T*>(p.dz_out);
  const int cpr4 = Pp / 4;
#pragma unroll 1
  for (int e = first; e < kL * cpr4; e += step) {
    const int i = e / cpr4, cc = e % cpr4;
    const int t = tok[i];
    if (t < 0 || cc * 4 >= P) continue;
    const int64_t off = (static_cast<int64_t>(t) * H + h) * P + cc * 4;
    const uint2 dr = __ldg(reinterpret_cast<const uint2*>(gdo + off)), zr = __ldg(reinterpret_cast<const uint2*>(gz + off)),
                yr = kYScratch ? __ldcg(reinterpret_cast<const uint2*>(y_scratch_of<T>(p, P) + i * P + cc * 4))
                               : __ldcg(reinterpret_cast<const uint2*>(gy + off));  // (dz_out may be y: not the read-only path)
    const uint32_t dw4[2] = {dr.x, dr.y}, zw4[2] = {zr.x, zr.y}, yw4[2] = {yr.x, yr.y};
    uint32_t dzw[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      dzw[w] = dz_pair<T>(dw4[w], zw4[w], yw4[w]);
    }
    *reinterpret_cast<uint2*>(gdz + off) = make_uint2(dzw[0], dzw[1]);
  }
}
// the load phase of one head, in two steps: issue_rows copies this thread's rows' x, dout, z pieces by cp.async into
// xs, dys, sc (zero-filled for pad rows / columns >= P); after the caller's cp.async wait (a thread reads back only
// its own pieces: no barrier) finish_rows forms dy, e^Lam . dy in place and the dD partials (store_row). All rows'
// loads in flight at once.
template <typename T, bool kZ>
__device__ __forceinline__ void issue_rows(const BwdParams& p, const int* tok, int h, int H, int P, int PT,
                                              int lrow0, int lcc, int rpp, T* dys, T* sc, T* xs) {
  const T* gx = static_cast<const T*>(p.x);
  const T* gdo = static_cast<const T*>(p.dout);
  const T* gz = static_cast<const T*>(p.z);
#pragma unroll 1
  for (int i = lrow0; i < kL; i += rpp) {
    const int t = tok[i];
    const bool ok = t >= 0 && lcc * 8 < P;
    const int64_t off = ok ? (static_cast<int64_t>(t) * H + h) * P + lcc * 8 : 0;
    const int nb = ok ? 16 : 0;
    const int so = i * PT + lcc * 8;
    mm::cp_async_16(xs + so, gx + off, nb);
    mm::cp_async_16(dys + so, gdo + off, nb);
    if constexpr (kZ) mm::cp_async_16(sc + so, gz + off, nb);
  }
}
template <typename T, bool kZ>
__device__ __forceinline__ void finish_rows(const BwdParams& p, int Pp, int PT, int64_t chl, int lrow0, int lcc,
                                               int rpp, float lam0, T* dys, T* sc, T* xs, float* dDred) {
  const bool wdD = p.dD_part != nullptr;
  float dDa[8];  // this thread's slot: its rows in order
#pragma unroll
  for (int k = 0; k < 8; ++k) dDa[k] = 0.f;
  float lnext = lam0;  // Lam of row lrow0 (loaded by the caller before its wait), then one row ahead
#pragma unroll 1
  for (int i = lrow0; i < kL; i += rpp) {
    RowIn r;
    const int so = i * PT + lcc * 8;
    r.x = *reinterpret_cast<const uint4*>(xs + so);
    r.d = *reinterpret_cast<const uint4*>(dys + so);
    r.z = kZ ? *reinterpret_cast<const uint4*>(sc + so) : make_uint4(0u, 0u, 0u, 0u);
    r.lam = lnext;
    if (i + rpp < kL) lnext = __ldg(p.Lam + chl + i + rpp);
    store_row<T, kZ>(r, i, lrow0, lcc, PT, wdD, dys, sc, xs, dDa);
  }
  if (wdD) {
    float4* d4 = reinterpret_cast<float4*>(dDred + lrow0 * Pp + lcc * 8);
    d4[0] = make_float4(dDa[0], dDa[1], dDa[2], dDa[3]);
    d4[1] = make_float4(dDa[4], dDa[5], dDa[6], dDa[7]);
  }
}

// the row-exclusive prefixes of W's row i (its columns 0..i; i < kL) in place, by float4: the same running sum as
// bwd_tiles::row_exclusive_prefix (left to right); the last float4 may run past column i into the row's upper part
// (within the pitch), which nothing reads
__device__ __forceinline__ void row_exclusive_prefix4(float* w, int i) {
  float run = 0.f;
  float4* w4 = reinterpret_cast<float4*>(w);
  for (int j4 = 0; j4 * 4 <= i; ++j4) {
    const float4 v = w4[j4];
    float4 o;
    o.x = run; run += v.x;
    o.y = run; run += v.y;
    o.z = run; run += v.z;
    o.w = run; run += v.w;
    w4[j4] = o;
  }
}

// the per-head row tail: bwd_tiles::head_rows's arithmetic in its order per row, on warp 0 alone (lane: rows lane and
// lane + 32; the caller's other warps skip it), its two cross-row steps (after the caller's W prefixes and between the
// row sums and the scan) ordered by __syncwarp, without the dA partial (red[] holds dts . d_dtA; the caller sums it
// after the head's last barrier: dA_sum). A warp-local tail leaves block-wide barriers only, every warp the same count
// per head.
template <int LDW>
__device__ __forceinline__ void head_rows_warp(const BwdParams& p, int lane, float* small, const float* qpart,
                                             const float* dpart, const float* vpart, int ncolP, const float* Wm,
                                             const int* tok, int64_t ch, int64_t H, int64_t h) {
  constexpr int L = kL;
  static_assert(L == 64, "the tail's row mapping (lane, lane + 32)");
  const auto [dts, el, wl, qs, vs, red] = bwd_tiles::row_small(small);
  const int64_t chl = ch * L;
  const float ddec = p.ddecay[ch], Ah = p.A[h];
  const float bias = p.dt_bias != nullptr ? p.dt_bias[h] : 0.f;
  // (few registers live next to the dC / dB accumulators: the second loop sums ddt_direct again, the same sum in the
  // same order, and reads dt_raw itself)
#pragma unroll 1
  for (int r = 0; r < 2; ++r) {
    const int k = lane + 32 * r;
    float q = 0.f, v = 0.f, d = 0.f;
    for (int ct = 0; ct < ncolP; ++ct) {
      q += qpart[ct * L + k];
      d += dpart[ct * L + k];
      v += vpart[ct * L + k];
    }
    bwd_tiles::store_row_qvd(p, k, small, chl, q, v, d);
  }
  __syncwarp();  // qs, vs (all rows) -> the sums below
#pragma unroll 1
  for (int r = 0; r < 2; ++r) {
    const int k = lane + 32 * r;
    const int t = tok[k];
    const int64_t th = static_cast<int64_t>(t) * H + h;
    const float raw = t >= 0 ? p.dt_raw[th] : 0.f;
    float dd = 0.f, dpairs = 0.f, qsum = 0.f, vsum = 0.f;
    for (int ct = 0; ct < ncolP; ++ct) dd += dpart[ct * L + k];
    for (int i = k; i < L; ++i) dpairs += Wm[i * LDW + k];
    for (int m = L - 1; m >= k; --m) qsum += qs[m];
    for (int j = 0; j < k; ++j) vsum += vs[j];
    const float d = dpairs + qsum + vsum + el[L - 1] * ddec;
    if (p.d_dtA != nullptr) p.d_dtA[chl + k] = d;  // a stage output (null outside the stage op)
    red[k] = dts[k] * d;
    if (t >= 0) {
      const float ddt = dd + Ah * d;
      p.ddt[th] = ddt;
      p.ddt_raw[th] = bwd_tiles::ddt_raw_of(p, ddt, raw + bias);
    }
  }
}
// the dA partial of chunk-head ch from red[] (head_rows's order), after the barrier that published red
__device__ __forceinline__ void dA_sum(const BwdParams& p, const float* red, int64_t ch) {
  float s = 0.f;
  const float4* r4 = reinterpret_cast<const float4*>(red);
#pragma unroll 4
  for (int k4 = 0; k4 < kL / 4; ++k4) {
    const float4 v = r4[k4];
    s += v.x;
    s += v.y;
    s += v.z;
    s += v.w;
  }
  p.dA_part[ch] = s;
}

// kRecY's step for the 16 x 16 block (rows r0.., columns p0..) whose C s^T is cs: y = e^Lam . cs + (M . dt) x + D x
// in fp32, rounded to T into the CTA's y scratch (ysc: L x P, row i at i * P; pad rows skipped), which dz_rows
// reads in the row tail (after the head's block barriers, by ld.global.cg, not the read-only path). (M . dt)[i][j] =
// cb[i][j] exp(Lam_i - Lam_j) dt_j (j <= i) is formed per lower 16 x 16 block from cb's fp32 fragments (fragment
// order, the accumulator layout) and rounded to T as the A operand (c_to_a); x is the B operand (ldmatrix).
template <typename T>
__device__ __forceinline__ void recompute_y_block(const BwdParams& p, const mm::FragC (&cs)[2], float* cbf,
                                                  const float* lam, const float* dts, const float* el, const T* xs,
                                                  const int* tok, int r0, int p0, int PT, int lane, int h, int P,
                                                  T* ysc) {
  mm::FragC ay[2];
  zero2(ay);
  const int rb = r0 >> 4;
#pragma unroll 1
  for (int cbk = 0; cbk <= rb; ++cbk) {
    const int blk = rb * (rb + 1) / 2 + cbk, c0 = cbk * 16;
    mm::FragC m2[2];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float4 cv = *frag4(cbf, blk, nt, lane);
      const float cvs[4] = {cv.x, cv.y, cv.z, cv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = r0 + mm::c_row(lane, e), j = c0 + nt * 8 + mm::c_col(lane, e);
        // (the fast exp: its ~1e-7 relative error is far below the operand's 16-bit rounding)
        m2[nt].x[e] = j <= i ? cvs[e] * __expf(fminf(lam[i] - lam[j], 0.f)) * dts[j] : 0.f;
      }
    }
    const mm::FragA a = mm::c_to_a<T>(m2[0], m2[1]);
    mm::FragB b0, b1;
    mm::load_b_kn(b0, b1, xs + c0 * PT + p0, PT);
    mm::mma<T>(ay[0], a, b0);
    mm::mma<T>(ay[1], a, b1);
  }
  const float* Dh = p.D != nullptr ? p.D + static_cast<int64_t>(h) * P : nullptr;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int j = r0 + mm::c_row(lane, 2 * hr), pc = p0 + nt * 8 + mm::c_col(lane, 0);
      if (tok[j] < 0 || pc >= P) continue;
      const float ej = el[j];
      float y0 = ej * cs[nt].x[2 * hr] + ay[nt].x[2 * hr];
      float y1 = ej * cs[nt].x[2 * hr + 1] + ay[nt].x[2 * hr + 1];
      if (Dh != nullptr) {
        const float2 x2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(xs + j * PT + pc));
        y0 += Dh[pc] * x2.x;
        y1 += Dh[pc + 1] * x2.y;
      }
      *reinterpret_cast<uint32_t*>(ysc + j * P + pc) = mm::Elem<T>::pack(y0, y1);
    }
}

// kRecY (z given, p.recompute_y): y is not read; the CS step recomputes it per 16 x 16 block, y = e^Lam . C s^T +
// (M . dt) x + D x (the forward's formula, fp32 from the same 16-bit operands: the A operand of (M . dt) x formed in
// registers from cb's fragments, x by ldmatrix), rounded to T into a per-CTA scratch (p.y_scratch, L x P per CTA,
// L2-resident, reused by each head) that dz_rows reads in the row tail, where it otherwise reads the stored y. The
// forward then stores no y (the memory mode, settings::ssd_recompute_y(): about a quarter more time in this kernel).
// (dz stays in the row tail, on the warps that idle there: written in the CS step, with dout / z loaded there, it
// cost more.)
template <typename T, bool kZ, bool kRecY = false>
__global__ void __launch_bounds__(kThreads, 2) post_bf16_kernel(BwdParams p) {
  static_assert(!kRecY || kZ, "y is recomputed for the z gate only");
  extern __shared__ __align__(16) unsigned char smem[];
  const int H = static_cast<int>(p.heads), P = static_cast<int>(p.head_dim), N = static_cast<int>(p.state_dim),
            G = static_cast<int>(p.groups), hpg = H / G;
  const int64_t c = blockIdx.x / G;
  const int g = static_cast<int>(blockIdx.x % G);
  const Plan pl(P, N);
  const int PT = pl.PT, NT = pl.NT, Pp = pl.Pp, Np = pl.Np, ncolP = pl.ncolP, ncolN = Np / 16;
  int* tok = reinterpret_cast<int*>(smem);  // token of each row, -1 = pad (T < 2^31: supported() checks)
  T* Bs = reinterpret_cast<T*>(smem + pl.off_B);
  T* Cs = reinterpret_cast<T*>(smem + pl.off_C);
  // the compile-time offsets of Plan
  constexpr int kOffCbf = kL * 8, kOffSdf = kOffCbf + kLowBlocks * 1024, kOffSmall = kOffSdf + kLowBlocks * 1024,
                kOffWr = kOffSmall + 7 * kL * 4, kOffSc = kOffWr + kL * kLT * 2;
  float* cbf = reinterpret_cast<float*>(smem + kOffCbf);
  float* sdf = reinterpret_cast<float*>(smem + kOffSdf);
  T* dys = reinterpret_cast<T*>(smem + pl.off_dy);
  T* xs = reinterpret_cast<T*>(smem + pl.off_x);
  T* mat = reinterpret_cast<T*>(smem + pl.off_mat);  // s (P x N), then dS
  T* Mt = reinterpret_cast<T*>(smem + kOffWr);     // M[i][j] (lower), then sum dCB at the end
  float* Wm = reinterpret_cast<float*>(smem + kOffWr);
  float* dDred = reinterpret_cast<float*>(smem + kOffWr);
  T* sc = reinterpret_cast<T*>(smem + kOffSc);  // e^Lam . dy, then wlast dt . x
  float* lam = reinterpret_cast<float*>(smem + kOffSmall);
  float* dts = lam + kL;
  float* el = dts + kL;
  float* wl = el + kL;
  float* qs = wl + kL;
  float* vs = qs + kL;
  float* red = vs + kL;
  float* qpart = reinterpret_cast<float*>(smem + pl.off_parts);  // [col tile][row]
  float* dpart = qpart + ncolP * kL;
  float* vpart = dpart + ncolP * kL;
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31, tq = lane & 3;
  const T* gB = static_cast<const T*>(p.B);
  const T* gC = static_cast<const T*>(p.C);
  const T* gst = static_cast<const T*>(p.states);

  if (tid < kL) tok[tid] = static_cast<int>(p.gather[c * kL + tid]);
  __syncthreads();
  const int cprN = Np / 8;  // 16-byte chunks per N row
  for (int e = tid; e < kL * cprN; e += kThreads) {
    const int i = e / cprN, cc = e % cprN;
    const int t = tok[i];
    const bool ok = t >= 0 && cc * 8 < N;
    const int64_t off = ok ? (static_cast<int64_t>(t) * G + g) * N + cc * 8 : 0;
    mm::cp_async_16(Bs + i * NT + cc * 8, gB + off, ok ? 16 : 0);
    mm::cp_async_16(Cs + i * NT + cc * 8, gC + off, ok ? 16 : 0);
  }
  mm::cp_async_commit();
  for (int e = tid; e < kLowBlocks * 256; e += kThreads) sdf[e] = 0.f;
  mm::cp_async_wait<0>();
  __syncthreads();

  // cb = C B^T, lower blocks, fp32 in fragment order (and the stage output when asked)
  low_block_products<T>(warp, Cs, Bs, NT, Np, [&](int blk, int r0, int c0, mm::FragC(&acc)[2]) {
    float* cbo = p.cb != nullptr ? p.cb + (c * G + g) * kL * kL : nullptr;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r0 + mm::c_row(lane, e), j = c0 + nt * 8 + mm::c_col(lane, e);
        acc[nt].x[e] = j <= r ? acc[nt].x[e] : 0.f;
        if (cbo != nullptr) cbo[r * kL + j] = acc[nt].x[e];
      }
      *frag4(cbf, blk, nt, lane) = make_float4(acc[nt].x[0], acc[nt].x[1], acc[nt].x[2], acc[nt].x[3]);
    }
  });
  if (p.cb != nullptr) {
    float* cbo = p.cb + (c * G + g) * kL * kL;
    for (int e = tid; e < kL * kL; e += kThreads)
      if ((e % kL) / 16 > (e / kL) / 16) cbo[e] = 0.f;
  }

  // the group's dC / dB accumulators: row strip r0s, column blocks half * nbh + u
  const int r0s = (warp >> 1) * 16, half = warp & 1, nbh = (ncolN + 1) / 2;
  mm::FragC accC[kMaxAcc][2], accB[kMaxAcc][2];
#pragma unroll
  for (int u = 0; u < kMaxAcc; ++u)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      accC[u][nt].zero();
      accB[u][nt].zero();
    }
  T* gdz = static_cast<T*>(p.dz_out);
  T* gdx = static_cast<T*>(p.dx_out);
  const int cpr = Pp / 8, rpp = kThreads / cpr;  // 16-byte chunks per P row, rows per pass
  const int lcc = tid % cpr, lrow0 = tid / cpr;
  const int ncolPblk = 4 * ncolP;
  __syncthreads();

  #pragma unroll 1
  for (int hh = 0; hh < hpg; ++hh) {
    const int h = g * hpg + hh;
    const int64_t ch = c * H + h, chl = ch * kL;
    if (tid < kL) {
      const float lv = p.Lam[chl + tid];
      lam[tid] = lv;
      dts[tid] = p.dt[chl + tid];
      el[tid] = expf(lv);
      wl[tid] = exp_le0(p.Lam[chl + kL - 1] - lv);
    }
    // s -> mat (cp.async, the input type); heads after the first were issued by warps 1..7 in the previous head's tail
    const int64_t sbase = ch * P * static_cast<int64_t>(N);
    // this thread's x / dout / z pieces by cp.async first (a group of their own: at the first head s follows, and the
    // wait leaves s in flight), then dy and e^Lam . dy from them
    const bool rows = lrow0 < rpp && lrow0 < kL;
    if (rows) issue_rows<T, kZ>(p, tok, h, H, P, PT, lrow0, lcc, rpp, dys, sc, xs);
    mm::cp_async_commit();
    const float lam0 = rows ? __ldg(p.Lam + chl + lrow0) : 0.f;
    if (hh == 0) {
      for (int e = tid; e < Pp * cprN; e += kThreads) {
        const int pp = e / cprN, cc = e % cprN;
        const bool ok = pp < P && cc * 8 < N;
        mm::cp_async_16(mat + pp * NT + cc * 8, gst + (ok ? sbase + pp * N + cc * 8 : 0), ok ? 16 : 0);
      }
      mm::cp_async_commit();
    }
    // groups in order: [the previous tail's s (heads > 0)], this head's rows, [s (head 0)]: at head 0 the rows are the
    // second newest group (wait 1 leaves s in flight); later heads wait for all (s landed during the tail)
    if (hh == 0) mm::cp_async_wait<1>(); else mm::cp_async_wait<0>();
    if (rows) finish_rows<T, kZ>(p, Pp, PT, chl, lrow0, lcc, rpp, lam0, dys, sc, xs, dDred);
    mm::cp_async_wait<0>();
    __syncthreads();

    // dD partial (fixed order over the row slots)
    if (p.dD_part != nullptr && tid < P) {
      float s = 0.f;
      for (int r = 0; r < rpp && r < kL; ++r) s += dDred[r * Pp + tid];  // the slots that saw rows
      p.dD_part[ch * P + tid] = s;
    }
    // CS = C s^T (L x P): q partials <dy_r, CS_r> per column tile
    #pragma unroll 1
    for (int b = warp; b < ncolPblk; b += kWarps) {
      // the row strips paired as in the dx step (0 + 3, 1 + 2: kRecY's (M . dt) x is triangular); any order gives
      // the same q partials
      const int kb = b / ncolP, r0 = (kb == 2 ? 3 : (kb == 3 ? 2 : kb)) * 16, ct = b % ncolP, p0 = ct * 16;
      mm::FragC acc[2];
      zero2(acc);
      mma_abt<T, true>(acc, Cs + r0 * NT, NT, mat + p0 * NT, NT, 0, Np);
      float s0 = 0.f, s1 = 0.f;
      // dy by element pairs (columns c_col, c_col + 1)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = r0 + mm::c_row(lane, 2 * hr), col = p0 + nt * 8 + mm::c_col(lane, 0);
          const float2 d2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(dys + r * PT + col));
          const float v0 = acc[nt].x[2 * hr] * d2.x;
          const float v1 = acc[nt].x[2 * hr + 1] * d2.y;
          if (hr == 0) {
            s0 += v0;
            s0 += v1;
          } else {
            s1 += v0;
            s1 += v1;
          }
        }
      bwd_tiles::quad_sum(s0);
      bwd_tiles::quad_sum(s1);
      if (tq == 0) {
        qpart[ct * kL + r0 + mm::c_row(lane, 0)] = s0;
        qpart[ct * kL + r0 + mm::c_row(lane, 2)] = s1;
      }
      if constexpr (kRecY) recompute_y_block<T>(p, acc, cbf, lam, dts, el, xs, tok, r0, p0, PT, lane, h, P, y_scratch_of<T>(p, P));
    }
    // dC head term: (e^Lam . dy) s
    acc_gemm<T, false>(accC, sc, PT, mat, NT, 0, Pp, r0s, half, nbh, ncolN);
    __syncthreads();

    // dS -> mat (ds_leave in T, already rounded: its bits; cp.async, waited before the barrier); wlast dt . x -> sc;
    // M (lower) -> Mt
    {
      const T* dsh = static_cast<const T*>(p.ds16) + sbase;
      for (int e = tid; e < Pp * cprN; e += kThreads) {
        const int pp = e / cprN, cc = e % cprN;
        const bool ok = pp < P && cc * 8 < N;
        mm::cp_async_16(mat + pp * NT + cc * 8, ok ? dsh + pp * N + cc * 8 : dsh, ok ? 16 : 0);
      }
      mm::cp_async_commit();
      for (int e = tid; e < kL * cpr; e += kThreads) {
        const int i = e / cpr, cc = e % cpr;
        const float w = wl[i] * dts[i];
        float f[8];
        unpack8<T>(*reinterpret_cast<const uint4*>(xs + i * PT + cc * 8), f);
#pragma unroll
        for (int k = 0; k < 8; ++k) f[k] *= w;
        *reinterpret_cast<uint4*>(sc + i * PT + cc * 8) = pack8<T>(f);
      }
      for_low_blocks(warp, [&](int blk, int r0, int c0) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const float4 cv = *frag4(cbf, blk, nt, lane);
          const float cvs[4] = {cv.x, cv.y, cv.z, cv.w};
          float m[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = r0 + mm::c_row(lane, e), j = c0 + nt * 8 + mm::c_col(lane, e);
            m[e] = j <= i ? cvs[e] * exp_le0(lam[i] - lam[j]) : 0.f;
          }
          const int i0 = r0 + mm::c_row(lane, 0), j0 = c0 + nt * 8 + mm::c_col(lane, 0);
          store_pairs<T>(Mt, kLT, i0, j0, m[0], m[1], m[2], m[3]);
        }
      });
      mm::cp_async_wait<0>();
    }
    __syncthreads();

    // g = M^T dy + wlast . (B dS^T); dx, ddt_direct and v partials
    const float* Dh = p.D != nullptr ? p.D + h * P : nullptr;
    #pragma unroll 1
    for (int b = warp; b < ncolPblk; b += kWarps) {
      const int k = b / ncolP, ct = b % ncolP, p0 = ct * 16;
      const int strip = k == 2 ? 3 : (k == 3 ? 2 : k);  // warps pair strips 0 + 3, 1 + 2 (balanced M^T work)
      const int r0 = strip * 16;
      mm::FragC aS[2], aG[2];
      zero2(aS);
      zero2(aG);
      mma_abt<T, true>(aS, Bs + r0 * NT, NT, mat + p0 * NT, NT, 0, Np);
      mma_atb<T, true>(aG, Mt + r0, kLT, dys + p0, PT, r0, kL);
      float d0 = 0.f, d1 = 0.f, v0 = 0.f, v1 = 0.f;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {  // accumulator rows g and g + 8
          const int j = r0 + mm::c_row(lane, 2 * hr), pc = p0 + nt * 8 + mm::c_col(lane, 0);
          float dxv[2];
          // x and dy by element pairs
          const float2 x2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(xs + j * PT + pc));
          const float2 y2 = unpack2<T>(*reinterpret_cast<const uint32_t*>(dys + j * PT + pc));
#pragma unroll
          for (int q = 0; q < 2; ++q) {
            const int e = 2 * hr + q;
            const float gv = aG[nt].x[e] + wl[j] * aS[nt].x[e];
            const float xv = q == 0 ? x2.x : x2.y;
            const float dyv = q == 0 ? y2.x : y2.y;
            dxv[q] = dts[j] * gv + (Dh != nullptr && pc + q < P ? Dh[pc + q] * dyv : 0.f);
            if (hr == 0) {
              d0 += xv * gv;
              v0 += xv * aS[nt].x[e];
            } else {
              d1 += xv * gv;
              v1 += xv * aS[nt].x[e];
            }
          }
          const int t = tok[j];
          if (t >= 0 && pc < P)
            *reinterpret_cast<uint32_t*>(gdx + (static_cast<int64_t>(t) * H + h) * P + pc) = mm::Elem<T>::pack(dxv[0], dxv[1]);
        }
      }
      bwd_tiles::store_dv_partials(d0, d1, v0, v1, dpart + ct * kL, vpart + ct * kL, r0 + mm::c_row(lane, 0),
                                   r0 + mm::c_row(lane, 2), tq);
    }
    // dB head term: (wlast dt . x) dS
    acc_gemm<T, false>(accB, sc, PT, mat, NT, 0, Pp, r0s, half, nbh, ncolN);
    __syncthreads();

    // dyx = dy x^T (lower blocks) -> dCB (summed over heads in sdf) and W = cb . dCB (fp32, over Mt / sc)
    low_block_products<T, true>(warp, dys, xs, PT, Pp, [&](int blk, int r0, int c0, mm::FragC(&acc)[2]) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        float4* sp4 = frag4(sdf, blk, nt, lane);
        const float4 cv = *frag4(cbf, blk, nt, lane);
        float4 sv = *sp4;
        const float cvs[4] = {cv.x, cv.y, cv.z, cv.w};
        float d[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = r0 + mm::c_row(lane, e), j = c0 + nt * 8 + mm::c_col(lane, e);
          d[e] = j <= i ? exp_le0(lam[i] - lam[j]) * dts[j] * acc[nt].x[e] : 0.f;
        }
        sv.x += d[0];
        sv.y += d[1];
        sv.z += d[2];
        sv.w += d[3];
        *sp4 = sv;
        const int i0 = r0 + mm::c_row(lane, 0), j0 = c0 + nt * 8 + mm::c_col(lane, 0);
        *reinterpret_cast<float2*>(Wm + i0 * kLW + j0) = make_float2(cvs[0] * d[0], cvs[1] * d[1]);
        *reinterpret_cast<float2*>(Wm + (i0 + 8) * kLW + j0) = make_float2(cvs[2] * d[2], cvs[3] * d[3]);
      }
    });
    __syncthreads();
    if (warp == 0) {  // warp 0: W's row prefixes (rows lane, lane + 32), then the row tail
      row_exclusive_prefix4(Wm + lane * kLW, lane);
      row_exclusive_prefix4(Wm + (lane + 32) * kLW, lane + 32);
      __syncwarp();  // W prefixes (all rows) -> the column sums of head_rows_warp
      head_rows_warp<kLW>(p, lane, lam, qpart, dpart, vpart, ncolP, Wm, tok, ch, H, h);
    } else if (hh + 1 < hpg) {  // warps 1..7: the next head's s -> mat (dS's last readers were before the dyx barrier)
      const int64_t nbase = (ch + 1) * P * static_cast<int64_t>(N);
      for (int e = tid - 32; e < Pp * cprN; e += kThreads - 32) {
        const int pp = e / cprN, cc = e % cprN;
        const bool ok = pp < P && cc * 8 < N;
        mm::cp_async_16(mat + pp * NT + cc * 8, gst + (ok ? nbase + pp * N + cc * 8 : 0), ok ? 16 : 0);
      }
      mm::cp_async_commit();
    }
    if constexpr (kZ) {  // warps 1..7: this head's dz (global only: no shared memory)
      if (warp != 0 && gdz != nullptr) dz_rows<T, kRecY>(p, tok, h, H, P, Pp, tid - 32, kThreads - 32);
    }
    // the next head overwrites lam, dts, dys, xs, the W region, the partials
    __syncthreads();
    if (tid == kThreads - 1) dA_sum(p, red, ch);  // red[] is next written in the next head's row tail
  }

  // sum dCB (lower) in the input type over the W region, then dC += (sum dCB) B, dB += (sum dCB)^T C
  for_low_blocks(warp, [&](int blk, int r0, int c0) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float4 sv = *frag4(sdf, blk, nt, lane);
      store_pairs<T>(Mt, kLT, r0 + mm::c_row(lane, 0), c0 + nt * 8 + mm::c_col(lane, 0), sv.x, sv.y, sv.z, sv.w);
    }
  });
  __syncthreads();
  acc_gemm<T, false>(accC, Mt, kLT, Bs, NT, 0, r0s + 16, r0s, half, nbh, ncolN);
  acc_gemm<T, true>(accB, Mt, kLT, Cs, NT, r0s, kL, r0s, half, nbh, ncolN);
#pragma unroll
  for (int u = 0; u < kMaxAcc; ++u) {
    const int cb = half * nbh + u;
    if (u < nbh && cb < ncolN) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = r0s + mm::c_row(lane, 2 * hr), n = cb * 16 + nt * 8 + mm::c_col(lane, 0);
          const int t = tok[r];
          if (t >= 0 && n < N) {
            const int64_t o = (static_cast<int64_t>(t) * G + g) * N + n;
            // B's 16-bit type, rounded once (RN: the bits of the fp32 values' cast)
            *reinterpret_cast<uint32_t*>(static_cast<T*>(p.dC_out) + o) =
                mm::Elem<T>::pack(accC[u][nt].x[2 * hr], accC[u][nt].x[2 * hr + 1]);
            *reinterpret_cast<uint32_t*>(static_cast<T*>(p.dB_out) + o) =
                mm::Elem<T>::pack(accB[u][nt].x[2 * hr], accB[u][nt].x[2 * hr + 1]);
          }
        }
    }
  }
}

int max_smem_optin() {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
  return v;
}

bool half_type(BwdType t) { return t == BwdType::BFloat16 || t == BwdType::Float16; }
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T, bool kZ, bool kRecY = false>
int launch_kernel(const BwdParams& p, cudaStream_t st) {
  const int bytes = Plan(p.head_dim, p.state_dim).bytes;
  auto* kern = post_bf16_kernel<T, kZ, kRecY>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return static_cast<int>(e);
  e = cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  if (e != cudaSuccess) return static_cast<int>(e);
  kern<<<static_cast<unsigned>(p.num_chunks * p.groups), kThreads, bytes, st>>>(p);
  return static_cast<int>(cudaGetLastError());
}
template <typename T>
int launch(const BwdParams& p, cudaStream_t st) {
  if (p.z == nullptr) return launch_kernel<T, false>(p, st);
  return p.recompute_y ? launch_kernel<T, true, true>(p, st) : launch_kernel<T, true>(p, st);
}

}  // namespace

bool ssd_bwd_post_bf16_supported(const BwdParams& p) {
  if (p.chunk != kL || p.head_dim < 8 || p.head_dim > kMaxDim || p.state_dim < 8 || p.state_dim > kMaxDim) return false;
  if (p.head_dim % 8 != 0 || p.state_dim % 8 != 0) return false;
  if (p.groups < 1 || p.heads % p.groups != 0) return false;
  const BwdType t = p.x_type;
  if (!half_type(t) || p.bc_type != t || p.dout_type != t || p.states_type != t || p.dx_type != t) return false;
  if (p.recompute_y && (p.z == nullptr || !aligned16(p.y_scratch))) return false;
  if (p.z != nullptr && (p.z_type != t || (!p.recompute_y && (p.y_type != t || p.y == nullptr)))) return false;
  if (p.num_chunks * p.groups > 0x7fffffffLL || p.tokens > 0x7fffffffLL) return false;
  if (p.ds16 == nullptr || p.ds16_type != t) return false;  // ds_leave in the input type
  if (!aligned16(p.x) || !aligned16(p.B) || !aligned16(p.C) || !aligned16(p.dout) || !aligned16(p.states) ||
      !aligned16(p.ds16) || !aligned16(p.dx_out))
    return false;
  if (p.z != nullptr && (!aligned16(p.z) || !aligned16(p.y) || !aligned16(p.dz_out))) return false;
  if ((reinterpret_cast<uintptr_t>(p.dB_out) & 3u) != 0 || (reinterpret_cast<uintptr_t>(p.dC_out) & 3u) != 0) return false;
  return Plan(p.head_dim, p.state_dim).bytes <= max_smem_optin();
}

int ssd_bwd_post_bf16(const BwdParams& p, void* stream) {
  if (p.num_chunks * p.groups == 0) return 0;
  if (!p.post_bf16_checked && !ssd_bwd_post_bf16_supported(p)) return static_cast<int>(cudaErrorInvalidValue);
  // the outputs the support check let be null (allocated after it) must be there now
  if (p.dx_out == nullptr || (p.z != nullptr && p.dz_out == nullptr) || (p.recompute_y && p.y_scratch == nullptr) ||
      p.dB_out == nullptr || p.dC_out == nullptr)
    return static_cast<int>(cudaErrorInvalidValue);
  const auto st = static_cast<cudaStream_t>(stream);
  return p.x_type == BwdType::BFloat16 ? launch<__nv_bfloat16>(p, st) : launch<__half>(p, st);
}

}  // namespace tree_recurrence::ssd::fused::kernels
