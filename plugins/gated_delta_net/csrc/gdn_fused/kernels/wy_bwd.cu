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

// 16 warps per CTA, 2 CTAs per SM (~104 KB at K = V = 128), a head-fastest 1-D grid (NC * HV blocks).
constexpr int kWyWarps = kTileWarps;  // one C x C tile of dA per warp
constexpr int kWyThreads = kTileThreads;

// Organised for latency:
//  * dA = -(dvb u^T + dkb w^T) = -dvb v_new^T: with dkb = -dvb h^T, dvb u^T + dkb w^T = dvb (u - w h)^T
//    and v_new = u - w h is what the forward saved. So no u = Ainv vb product, no w, no vb buffer.
//  * Every global operand is requested at the start (cp.async: Ainv, dv_total | h, v_new | k), the
//    fp32 dk^ workspace of (b) prefetched into L2; v at the tokens (for <dvb, v>) read into registers
//    while the copies fly.
//  * dvb is written over dv_total: warp w owns V columns 8w..8w+7 for all 64 rows (it alone reads
//    them), with the zero blocks of Ainv^T (upper triangle) skipped.
//  * dkb stays fp32 in registers: it is computed by the warp that adds it into dk^, tile by tile, before
//    the barrier that publishes dKK (the warps idle in the C x C phase start on it at once).
//  * rowsum(W2) and colsum(beta W2) from the accumulators (quad and column butterflies, fixed
//    order) into per-tile partials: no fp32 W2 buffer. The zero blocks of dKK are skipped.
//  * Four CTA-wide barriers; the per-row tail (dbeta, dG, dg) in one warp, the reverse cumsum as a warp
//    suffix scan.
constexpr int kWyPartV = 16;  // V column blocks of 8 (V <= 128)

__device__ __forceinline__ void ldsm_x2_trans(uint32_t (&r)[2], const void* ptr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(mma::smem_addr(ptr)));
}
// One 16x8 B tile with B(k, n) at B[k * ld + n] (rows k 0..7 from lanes 0..7, 8..15 from lanes 8..15).
template <typename T>
__device__ __forceinline__ mma::FragB load_b8_kn(const T* B, int ld) {
  uint32_t r[2];
  ldsm_x2_trans(r, B + (mma::lane_id() & 15) * ld);
  mma::FragB b;
  b.x[0] = r[0];
  b.x[1] = r[1];
  return b;
}
// tile_mma over the k-steps kt0..kt1-1 only.
template <typename T, bool A_ROW, bool B_KN>
__device__ __forceinline__ void tile_mma_range(FragC (&acc)[1][2], const T* A, int lda, const T* B, int ldb, int r0,
                                               int c0, int kt0, int kt1) {
  for (int kt = kt0; kt < kt1; ++kt) {
    const T* a = A_ROW ? A + r0 * lda + kt * 16 : A + kt * 16 * lda + r0;
    const T* b = B_KN ? B + kt * 16 * ldb + c0 : B + c0 * ldb + kt * 16;
    mma::warp_gemm<T, 1, 2, 1, A_ROW, B_KN>(acc, a, lda, b, ldb);
  }
}
__device__ __forceinline__ void prefetch_l2(const void* ptr) { asm volatile("prefetch.L2 [%0];\n" ::"l"(ptr)); }

template <typename T>
__global__ void __launch_bounds__(kWyThreads, 2) wy_kernel(GdnBwdParams p) {
  extern __shared__ __align__(16) char smem_raw[];
  // head-fastest 1-D grid: the value heads of a chunk (and so of a key head) run side by side, so k
  // rows come from L2 the second time and the token-major rows (v, dv, beta, dbeta, dg) are read and
  // written across heads together
  const int64_t HV = p.hv, HK = p.hk;
  const unsigned hv32 = static_cast<unsigned>(HV);
  const int64_t c = blockIdx.x / hv32, hv = blockIdx.x % hv32, hk = hv / (HV / HK);
  const int K = static_cast<int>(p.k_dim), V = static_cast<int>(p.v_dim);
  const int Kp = round16(K), Vp = round16(V), ldk = pitch_of(Kp), ldv = pitch_of(Vp);
  Smem sm{smem_raw};
  T* dvb = sm.take<T>(C * ldv);  // dv_total, then dvb in place (phase 1)
  T* h = sm.take<T>(static_cast<size_t>(Kp) * ldv);
  T* vn = sm.take<T>(C * ldv);
  T* kh = sm.take<T>(C * ldk);
  T* Ai = sm.take<T>(C * kPitchC);  // Ainv (phase 1), then dKK (phases 2-3)
  T* dKK = Ai;
  float* G = sm.take<float>(C);
  float* beta = sm.take<float>(C);
  float* dGin = sm.take<float>(C);
  float* rks = sm.take<float>(C);
  float* partV = sm.take<float>(C * kWyPartV);  // <dvb, v> per row and 8-column block
  float* partKB = sm.take<float>(C * 8);         // <dkb, k^> per row and 16-column block
  float* rowP = sm.take<float>(C * 4);           // rowsum(W2) per row and 16-column block
  float* colP = sm.take<float>(C * 4);           // colsum(beta W2) per column and 16-row block
  int64_t* tok = sm.take<int64_t>(C);

  const int64_t ch = c * HV + hv;
  const int64_t* gat = p.gather + c * C;
  const T* v = static_cast<const T*>(p.v);
  float* dk_io = p.dk_hv + ch * C * K;
  {
    const int lines = C * K * 4 / 128;  // (b)'s dk^ of this (chunk, head), read in phase 3
    for (int l = threadIdx.x; l < lines; l += blockDim.x) prefetch_l2(dk_io + l * 32);
  }
  // group 0: phase 1's operands; group 1: h, v_new; group 2: k (rows through gather, read from global)
  async_matrix<T>(Ai, kPitchC, static_cast<const T*>(p.Ainv) + ch * C * C, C, C, C, C);
  async_matrix<T>(dvb, ldv, static_cast<const T*>(p.dv_total) + ch * C * V, C, C, V, Vp);
  mma::cp_async_commit();
  async_matrix<T>(h, ldv, static_cast<const T*>(p.h) + ch * static_cast<int64_t>(K) * V, K, Kp, V, Vp);
  async_matrix<T>(vn, ldv, static_cast<const T*>(p.v_new) + ch * C * V, C, C, V, Vp);
  mma::cp_async_commit();
  async_token_rows<T>(kh, ldk, static_cast<const T*>(p.k), gat, HK, hk, K, Kp);
  mma::cp_async_commit();
  for (int i = threadIdx.x; i < C; i += blockDim.x) {
    G[i] = p.G[ch * C + i];
    dGin[i] = p.dG[ch * C + i];
    const int64_t t = gat[i];
    tok[i] = t;
    beta[i] = t >= 0 ? p.beta[t * HV + hv] : 0.f;
    rks[i] = t >= 0 ? p.rk[t * HK + hk] : 0.f;
  }

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  // Phase 1 operands of this warp: V columns n0 + 2 tq, +1 of rows mt * 16 + g (+ 8).
  const int n0 = warp * 8;
  const bool p1 = n0 < Vp;
  const int col1 = n0 + 2 * tq;
  uint32_t vv[4][2];  // v at the tokens (two in-type values each), requested before the wait
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int64_t t = p1 && col1 < V ? gat[mt * 16 + g + 8 * hf] : -1;
      vv[mt][hf] = t >= 0 ? *reinterpret_cast<const uint32_t*>(v + (t * HV + hv) * V + col1) : 0u;
    }
  mma::cp_async_wait<2>();
  __syncthreads();  // (1) Ainv, dv_total, the per-row scalars

  // Phase 1: dvb = Ainv^T dv_total (Ainv^T(i, j) = Ainv(j, i) is 0 for j < i: k-blocks kt >= mt only);
  // dv = beta dvb at the tokens; partV = <dvb, v> over the warp's 8 columns.
  if (p1) {
    FragC acc[4];
#pragma unroll
    for (int mt = 0; mt < 4; ++mt) acc[mt].zero();
#pragma unroll
    for (int kt = 0; kt < C / 16; ++kt) {
      const mma::FragB b = load_b8_kn<T>(dvb + kt * 16 * ldv + n0, ldv);
#pragma unroll
      for (int mt = 0; mt <= kt; ++mt) {
        const mma::FragA a = mma::load_a_col<T>(Ai + kt * 16 * kPitchC + mt * 16, kPitchC);
        mma::mma<T>(acc[mt], a, b);
      }
    }
    __syncwarp();  // every lane's reads of the warp's dv_total columns are done: dvb overwrites them
    T* dv_out = static_cast<T*>(p.dv);
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int j = mt * 16 + g + 8 * hf;
        const float x0 = acc[mt].x[2 * hf], x1 = acc[mt].x[2 * hf + 1];
        *reinterpret_cast<uint32_t*>(dvb + j * ldv + col1) = mma::Elem<T>::pack(x0, x1);
        const int64_t tj = tok[j];
        float s = 0.f;
        if (tj >= 0 && col1 < V) {
          *reinterpret_cast<uint32_t*>(dv_out + (tj * HV + hv) * V + col1) = mma::Elem<T>::pack(beta[j] * x0, beta[j] * x1);
          const T* ve = reinterpret_cast<const T*>(&vv[mt][hf]);
          s = x0 * mma::Elem<T>::to_float(ve[0]);
          s += x1 * mma::Elem<T>::to_float(ve[1]);
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if (tq == 0) partV[j * kWyPartV + warp] = s;
      }
  }
  mma::cp_async_wait<0>();
  scale_rows<T>(kh, ldk, Kp, rks);  // k^ = rk k: the same chunks this thread copied (same index loop)
  __syncthreads();                  // (2) dvb, h, v_new, k^; Ainv is dead: it takes dKK

  // Phase 2: the warp's C x C tile (lower tiles only): dA = -dvb v_new^T, KK = k^ k^T; dAE, W2, dKK;
  // partials of rowsum(W2), colsum(beta W2).
  {
    const int ar0 = (warp / (C / 16)) * 16, ac0 = (warp % (C / 16)) * 16;
    const bool lower = ar0 >= ac0;
    FragC accA[1][2], kk[1][2];
    zero(accA);
    zero(kk);
    if (lower) {
      tile_mma<T, true, false>(accA, dvb, ldv, vn, ldv, ar0, ac0, Vp / 16);
      tile_mma<T, true, false>(kk, kh, ldk, kh, ldk, ar0, ac0, Kp / 16);
    }
    float rs[2] = {0.f, 0.f}, cs[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int i = ar0 + g + 8 * hf, j = ac0 + nt * 8 + 2 * tq;
        float d[2];
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          const int e = 2 * hf + b;
          const float dae = j + b < i ? -accA[0][nt].x[e] * expf(G[i] - G[j + b]) : 0.f;
          const float w2 = dae * kk[0][nt].x[e];
          rs[hf] += w2;
          cs[nt][b] += beta[i] * w2;
          d[b] = beta[i] * dae;
        }
        if (lower) *reinterpret_cast<uint32_t*>(dKK + i * kPitchC + j) = mma::Elem<T>::pack(d[0], d[1]);
      }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      rs[hf] += __shfl_xor_sync(0xffffffffu, rs[hf], 1);
      rs[hf] += __shfl_xor_sync(0xffffffffu, rs[hf], 2);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        cs[nt][b] += __shfl_xor_sync(0xffffffffu, cs[nt][b], 4);
        cs[nt][b] += __shfl_xor_sync(0xffffffffu, cs[nt][b], 8);
        cs[nt][b] += __shfl_xor_sync(0xffffffffu, cs[nt][b], 16);
      }
    if (tq == 0) {
      rowP[(ar0 + g) * 4 + ac0 / 16] = rs[0];
      rowP[(ar0 + g + 8) * 4 + ac0 / 16] = rs[1];
    }
    if (g == 0) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int b = 0; b < 2; ++b) colP[(ac0 + nt * 8 + 2 * tq + b) * 4 + ar0 / 16] = cs[nt][b];
    }
  }
  // Phase 3a (needs dvb, h only: before barrier (3), so the warps without a C x C tile in phase 2 start it
  // at once), per 16 x 16 tile of dk^ (at most two per warp): dkb = -dvb h^T (fp32), partKB = <dkb, k^>,
  // pre = (b)'s dk^ + beta exp(G) dkb (held in registers across the barrier).
  constexpr int kWyTiles = (C / 16) * (kBwdMaxDim / 16) / kWyWarps;  // tiles per warp at most
  const int ntiles = (C / 16) * (Kp / 16);
  float2 pre[kWyTiles][2][2];
  for_warp_tiles<kWyTiles, kWyWarps>(warp, ntiles, Kp / 16, [&](int q, int r0, int c0) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int j = r0 + g + 8 * hf, col = c0 + nt * 8 + 2 * tq;
        pre[q][nt][hf] = col < K ? *reinterpret_cast<const float2*>(dk_io + j * K + col) : make_float2(0.f, 0.f);
      }
    FragC acc[1][2];
    zero(acc);
    tile_mma<T, true, false>(acc, dvb, ldv, h, ldv, r0, c0, Vp / 16);  // -dkb
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int j = r0 + g + 8 * hf, col = c0 + nt * 8 + 2 * tq;
        const uint32_t kp = *reinterpret_cast<const uint32_t*>(kh + j * ldk + col);
        const T* ke = reinterpret_cast<const T*>(&kp);
        const float x0 = -acc[0][nt].x[2 * hf], x1 = -acc[0][nt].x[2 * hf + 1];
        s[hf] += x0 * mma::Elem<T>::to_float(ke[0]);
        s[hf] += x1 * mma::Elem<T>::to_float(ke[1]);
        const float be = beta[j] * expf(G[j]);
        pre[q][nt][hf].x += be * x0;
        pre[q][nt][hf].y += be * x1;
      }
    tile_rowdot_store(s[0], s[1], partKB, r0, c0);
  });
  __syncthreads();  // (3) dKK

  // Phase 3b: dk^ = pre + dKK k^ + dKK^T k^ (dKK strictly lower: k-blocks <= rb, >= rb), written once.
#pragma unroll
  for (int q = 0; q < kWyTiles; ++q) {
    const int t = warp + q * kWyWarps;
    if (t < ntiles) {
      const int rb = t / (Kp / 16), r0 = rb * 16, c0 = (t % (Kp / 16)) * 16;
      FragC acc2[1][2];
      zero(acc2);
      tile_mma_range<T, true, true>(acc2, dKK, kPitchC, kh, ldk, r0, c0, 0, rb + 1);
      tile_mma_range<T, false, true>(acc2, dKK, kPitchC, kh, ldk, r0, c0, rb, C / 16);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int hf = 0; hf < 2; ++hf) {
          const int j = r0 + g + 8 * hf, col = c0 + nt * 8 + 2 * tq;
          float2 o;
          o.x = pre[q][nt][hf].x + acc2[0][nt].x[2 * hf];
          o.y = pre[q][nt][hf].y + acc2[0][nt].x[2 * hf + 1];
          if (col < K) *reinterpret_cast<float2*>(dk_io + j * K + col) = o;
        }
    }
  }
  __syncthreads();  // (4) partKB

  // The per-row tail in warp 0: lane l has rows 2l, 2l+1. dbeta, dG (the total, written back), and
  // dg = reverse cumsum of dG as a fixed-order warp suffix scan.
  if (warp == 0) {
    float d[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int i = 2 * lane + q;
      const float eg = expf(G[i]);
      const float kb = row_parts(partKB, i, Kp / 16);
      float pv = 0.f;
      for (int b = 0; b < Vp / 8; ++b) pv += partV[i * kWyPartV + b];
      float row = 0.f, colsum = 0.f;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        row += rowP[i * 4 + b];
        colsum += colP[i * 4 + b];
      }
      const float db = pv + eg * kb + row;
      d[q] = dGin[i] + beta[i] * eg * kb + beta[i] * row - colsum;
      p.dG[ch * C + i] = d[q];
      if (tok[i] >= 0) p.dbeta[tok[i] * HV + hv] = db;
    }
    const float s1 = d[1], s0 = d[0] + s1;
    float x = s0;  // becomes the sum of s0 over lanes >= lane
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_down_sync(0xffffffffu, x, o);
      if (lane + o < 32) x += y;
    }
    float after = __shfl_down_sync(0xffffffffu, x, 1);
    if (lane == 31) after = 0.f;
    const int64_t t0 = tok[2 * lane], t1 = tok[2 * lane + 1];
    if (t0 >= 0) p.dg[t0 * HV + hv] = s0 + after;
    if (t1 >= 0) p.dg[t1 * HV + hv] = s1 + after;
  }
}

size_t wy_smem(const GdnBwdParams& p) {
  const int Kp = round16(static_cast<int>(p.k_dim)), ldk = pitch_of(Kp), ldv = pitch_of(round16(static_cast<int>(p.v_dim)));
  return 2 * smem_bytes<uint16_t>(C * ldv) + smem_bytes<uint16_t>(static_cast<size_t>(Kp) * ldv) +
         smem_bytes<uint16_t>(C * ldk) + smem_bytes<uint16_t>(C * kPitchC) + 4 * smem_bytes<float>(C) +
         smem_bytes<float>(C * kWyPartV) + smem_bytes<float>(C * 8) + 2 * smem_bytes<float>(C * 4) +
         smem_bytes<int64_t>(C);
}

}  // namespace
}  // namespace bwd

const char* gdn_bwd_wy(const GdnBwdParams& p, void* stream) {
  const int64_t blocks = p.num_chunks * p.hv;  // the head-fastest 1-D grid
  if (blocks > 2147483647) return "wy: num_chunks * hv exceeds the grid";
  using namespace bwd;
  return launch_chunks(wy_kernel<__nv_bfloat16>, wy_kernel<__half>, kWyThreads, wy_smem(p), p, stream,
                       dim3(static_cast<unsigned>(blocks)));
}

}  // namespace tree_recurrence::gdn::fused::kernels
