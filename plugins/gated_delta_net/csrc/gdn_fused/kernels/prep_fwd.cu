// Stage 1 of the fused GDN forward (../gdn_fused.h, params.h): per (chunk, value head) one block of
// 128 threads (4 warps, warp w owns rows 16w..16w+15), grid value head fastest (tile_grid), 54 KB of
// shared memory (4 blocks per SM).
//   1. rows through gather: k, then v in two cp.async groups (zero-filled pad rows and columns; each
//      thread reads its rows' tokens from gather itself, ChunkRows); then k^ = l2norm(k) in place, rk
//      (q is not read: the out stage, which loads q anyway, writes rq);
//   2. G = cumsum(g) (one thread, sequential from registers: G is non-increasing exactly),
//      decay = exp(G_63); the per-row factors beta exp(G), exp(G_63 - G);
//   3. A_ij = beta_i exp(G_i - G_j) <k^_i, k^_j>, j < i (K K^T on tensor cores, fp32 acc), written
//      transposed (strict upper triangle), and kd_j = exp(G_63 - G_j) k^_j;
//   4. block_inverse: the 16 x 16 diagonal blocks are inverted by substitution, the off-diagonal blocks
//      by fp32 block products (3 levels, all 128 threads), in place; Ainv and the operands leave with
//      16-byte stores;
//   5. w = (Ainv diag(beta exp G)) k^, u = (Ainv diag(beta)) v on tensor cores (operands rounded to
//      the input type, fp32 acc) by column blocks per warp (balanced; lower_times_cols), staged in
//      shared memory and stored with 16-byte writes.
// Shared memory is reused across phases: A (3-4) and the two scaled Ainv operands (5) share one
// buffer. Every exponent is min(., 0) (G is non-increasing, so this only guards against g > 0 input).

#include "fwd_common.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kLdX = kMaxDim + 8;  // pitch of the k / v rows (elements)
constexpr int kLdA = kChunk + 4;   // fp32 A pitch (floats; 16-byte rows)
constexpr int kLdI = kChunk + 8;   // pitch of the Ainv operands (elements)

template <typename T>
struct PrepSmem {
  T k[kChunk * kLdX];
  T v[kChunk * kLdX];
  union {
    float A[kChunk * kLdA];  // phases 3-4
    struct {
      T ab[kChunk * kLdI];
      T abg[kChunk * kLdI];
    } op;  // phase 5
  } u;
  float graw[kChunk];
  float G[kChunk];
  float beta[kChunk];
  float bg[kChunk];     // beta_i exp(G_i)
  float dlast[kChunk];  // exp(G_63 - G_i)
  int64_t tok[kChunk];
};
static_assert(sizeof(PrepSmem<__nv_bfloat16>) == sizeof(PrepSmem<__half>), "prep: one shared-memory size");

// Phase 5: acc = op X with op (64 x 64, pitch kLdI) lower block triangular and X (64 x 16 nblocks16, pitch
// kLdX). The warp owns 16-column blocks warp and warp + 4 of X (all 64 rows), so the lower-triangular
// work is the same for every warp (10 row-block x k-block steps each). acc[rb * 4 + 2 n + h] = rows
// 16 rb.., columns 16 (warp + 4 n) + 8 h..; each output's sum over k blocks 0..rb runs in order.
// The warp reads only its own columns of X, so it may stash over them without a block barrier.
template <typename T>
__device__ __forceinline__ void lower_times_cols(mm::FragC (&acc)[16], const T* op, const T* X, int warp, int nblocks16) {
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i].zero();
#pragma unroll
  for (int rb = 0; rb < 4; ++rb) {
#pragma unroll
    for (int kt = 0; kt <= rb; ++kt) {
      const mm::FragA a = mm::load_a_row(op + rb * 16 * kLdI + kt * 16, kLdI);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int np = warp + 4 * n;
        if (np < nblocks16) {
          mm::FragB b0, b1;
          mm::load_b_kn(b0, b1, X + kt * 16 * kLdX + np * 16, kLdX);
          mm::mma<T>(acc[rb * 4 + 2 * n], a, b0);
          mm::mma<T>(acc[rb * 4 + 2 * n + 1], a, b1);
        }
      }
    }
  }
}
template <typename T>
__device__ __forceinline__ void stash_cols(T* dst, const mm::FragC (&acc)[16], int warp, int nblocks16) {
  const int l = mm::lane_id();
#pragma unroll
  for (int rb = 0; rb < 4; ++rb)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int np = warp + 4 * n;
      if (np < nblocks16) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const mm::FragC& f = acc[rb * 4 + 2 * n + h];
          const int col = np * 16 + h * 8 + mm::c_col(l, 0);
          const int r0 = rb * 16 + mm::c_row(l, 0), r1 = rb * 16 + mm::c_row(l, 2);
          *reinterpret_cast<uint32_t*>(dst + r0 * kLdX + col) = mm::Elem<T>::pack(f.x[0], f.x[1]);
          *reinterpret_cast<uint32_t*>(dst + r1 * kLdX + col) = mm::Elem<T>::pack(f.x[2], f.x[3]);
        }
      }
    }
}

// body(r, c8) for every 16-byte word (row r < 64, word c8 < per_row) of a 64-row tile, word i =
// r per_row + c8 by thread i % kThreads. The full-width case (per_row 16, K or V = 128) runs with
// constant shifts, unrolled; the others with a division per word (the same words and threads).
template <typename F>
__device__ __forceinline__ void for_row_words(int per_row, F&& body) {
  if (per_row == kMaxDim / 8) {
#pragma unroll
    for (int i = threadIdx.x; i < kChunk * (kMaxDim / 8); i += kThreads) body(i >> 4, i & 15);
    return;
  }
  for (int i = threadIdx.x; i < kChunk * per_row; i += kThreads) {
    const int r = i / per_row, c8 = i - r * per_row;
    body(r, c8);
  }
}

// 64 rows x ncols (multiple of 8) from shared (pitch kLdX) to global rows of pitch ncols, 16 bytes
// per thread and step.
template <typename T>
__device__ __forceinline__ void store_rows(T* __restrict__ dst, const T* src, int ncols) {
  for_row_words(ncols >> 3, [&](int r, int c8) {
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(r) * ncols + c8 * 8) =
        *reinterpret_cast<const uint4*>(src + r * kLdX + c8 * 8);
  });
}

// kd_j = exp(G_63 - G_j) k^_j (dlast[j] = exp(G_63 - G_j); k^ rows pitch kLdX) to global rows of
// pitch K, 16-byte stores, all threads.
template <typename T>
__device__ __forceinline__ void store_kd(T* __restrict__ kd, const T* kh, const float* dlast, int K) {
  for_row_words(K >> 3, [&](int r, int c8) {
    float f[8];
    load8<T>(kh + r * kLdX + c8 * 8, f);
    const float d = dlast[r];
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] *= d;
    *reinterpret_cast<uint4*>(kd + static_cast<int64_t>(r) * K + c8 * 8) = pack8<T>(f);
  });
}

// 3a's gating of acc = k^ k^T (rows of this warp's block, lower_nt): A_ij = beta_i exp(G_i - G_j)
// acc_ij for j < i, into A[j][i] (strict upper triangle, nothing else written: block_inverse's
// layout). The lane's rows
// r0 = 16 warp + lane / 4 (elements 0, 1) and r0 + 8 (2, 3), columns nt * 8 + 2 (lane % 4) + (e & 1);
// G and beta read once per row and column pair; column blocks right of the diagonal one skipped.
__device__ __forceinline__ void store_gated_A(float* A, const mm::FragC (&acc)[8], const float* G, const float* beta,
                                              int warp) {
  const int lane = mm::lane_id();
  const int r0 = warp * 16 + mm::c_row(lane, 0), r1 = warp * 16 + mm::c_row(lane, 2);
  const float g0 = G[r0], g1 = G[r1], b0 = beta[r0], b1 = beta[r1];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const bool below = (nt >> 1) <= warp;  // column block at or left of the diagonal one (warp-uniform)
    const int c0 = nt * 8 + mm::c_col(lane, 0);
    const float2 gc = below ? *reinterpret_cast<const float2*>(G + c0) : make_float2(0.f, 0.f);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e < 2 ? r0 : r1, col = c0 + (e & 1);
      const float gr = e < 2 ? g0 : g1, br = e < 2 ? b0 : b1, gcol = (e & 1) ? gc.y : gc.x;
      if (below && col < r) A[col * kLdA + r] = br * exp_nonpos(gr - gcol) * acc[nt].x[e];
    }
  }
}

// After block_inverse: xr[e][m] = Ainv(rr + 16 e, c0 + m) (0 above the diagonal), from M (pitch kLdA).
__device__ __forceinline__ void load_inverse(float (&xr)[4][8], const float* M, int c0, int rr) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int r = rr + 16 * e;
    const float4 lo = *reinterpret_cast<const float4*>(M + r * kLdA + c0);
    const float4 hi = *reinterpret_cast<const float4*>(M + r * kLdA + c0 + 4);
    const float v8[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int m = 0; m < 8; ++m) xr[e][m] = c0 + m <= r ? v8[m] : 0.f;
  }
}

// block_inverse's level d: y[n] to the 1 x 4 strip s = tid + 128 n (when s < (4 - d) 64) of block
// (i, j) = (j + d, s / 64) of M, row s / 4 % 16, columns 4 (s % 4)..
__device__ __forceinline__ void store_strips(float* M, const float4 (&y)[2], int tid, int d) {
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const int s = tid + n * kThreads;
    if (s < (4 - d) * 64) {
      const int j = s >> 6, i = j + d, r = (s >> 2) & 15, q4 = (s & 3) * 4;
      *reinterpret_cast<float4*>(M + (i * 16 + r) * kLdA + j * 16 + q4) = y[n];
    }
  }
}

// Phase 4: Ainv = (I + A)^-1 by 16 x 16 blocks, fp32 on CUDA cores, all 128 threads.
// On entry the buffer M (pitch kLdA) holds A transposed in its strict upper triangle (M[c][r] =
// A(r, c), c < r); on exit its lower triangle with the diagonal holds X = Ainv (M[r][c] = X(r, c),
// c <= r; the diagonal blocks' upper triangles hold 0, the other upper blocks still A^T). Blocks
// (16 x 16; D_b = X_bb):
//   4a. D_b = (I + A_bb)^-1 by forward substitution (thread per (b, column), 16 rows), stored with
//       its zeros above the diagonal (so the products below need no masks: a stored 0 or 1 gives
//       the same fmaf results as the masked constants did);
//   4b. level d = 1..3, blocks (i, j = i - d) independent: Y = sum_{k=j}^{i-1} A_ik X_kj (written
//       to block (i, j)), then X_ij = -D_i Y (in registers, a barrier, then over Y).
// Every sum runs in a fixed order (deterministic); each thread owns 1 x 4 strips (row r, columns
// 4q..4q+3) of a block.
__device__ __forceinline__ void block_inverse(float* M, int tid) {
  {  // 4a
    const int b = (tid >> 4) & 3, cc = tid & 15, o = b * 16;
    float x[16];
    if (tid < kChunk) {
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        float acc = r == cc ? 1.f : 0.f;
#pragma unroll
        for (int m = 0; m < r; ++m) acc = fmaf(-M[(o + m) * kLdA + o + r], x[m], acc);  // A(o + r, o + m)
        x[r] = r >= cc ? acc : 0.f;
      }
    }
    // Every read of the diagonal blocks done before D_b goes over them: the compiler reads the
    // A(o + r, o + m) above 16 bytes at a time (M[o + 4t][o + 4t..o + 4t + 3], the diagonal entry
    // included, which thread cc = 4t writes below): a read-after-write race without this barrier.
    __syncthreads();
    if (tid < kChunk) {  // the whole column: zeros above the diagonal (A_bb^T there is dead now)
#pragma unroll
      for (int r = 0; r < 16; ++r) M[(o + r) * kLdA + o + cc] = x[r];
    }
  }
  __syncthreads();
#pragma unroll
  for (int d = 1; d < 4; ++d) {
    const int strips = (4 - d) * 64;
    float4 y[2];
    // Y = sum_k A_ik X_kj (k = j: X_jj = D_j, its zeros above the diagonal stored by 4a)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int s = tid + n * kThreads;
      if (s < strips) {
        const int j = s >> 6, i = j + d, r = (s >> 2) & 15, q4 = (s & 3) * 4;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        for (int k = j; k < i; ++k) {
#pragma unroll
          for (int m = 0; m < 16; ++m) {
            const float* row = M + (k * 16 + m) * kLdA;
            const float a = row[i * 16 + r];  // A(16i + r, 16k + m)
            const float4 x4 = *reinterpret_cast<const float4*>(row + j * 16 + q4);
            a0 = fmaf(a, x4.x, a0);
            a1 = fmaf(a, x4.y, a1);
            a2 = fmaf(a, x4.z, a2);
            a3 = fmaf(a, x4.w, a3);
          }
        }
        y[n] = make_float4(a0, a1, a2, a3);
      }
    }
    // block (i, j) is read by no other strip of this level: Y goes there at once
    store_strips(M, y, tid, d);
    __syncthreads();
    // X_ij = -D_i Y (D_i(r, m) at M[16i + r][16i + m]: 1 on the diagonal, 0 above it, from 4a)
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const int s = tid + n * kThreads;
      if (s < strips) {
        const int j = s >> 6, i = j + d, r = (s >> 2) & 15, q4 = (s & 3) * 4;
        const float* Drow = M + (i * 16 + r) * kLdA + i * 16;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll
        for (int m = 0; m < 16; ++m) {
          const float dm = Drow[m];
          const float4 y4 = *reinterpret_cast<const float4*>(M + (i * 16 + m) * kLdA + j * 16 + q4);
          a0 = fmaf(dm, y4.x, a0);
          a1 = fmaf(dm, y4.y, a1);
          a2 = fmaf(dm, y4.z, a2);
          a3 = fmaf(dm, y4.w, a3);
        }
        y[n] = make_float4(-a0, -a1, -a2, -a3);
      }
    }
    __syncthreads();
    store_strips(M, y, tid, d);
    __syncthreads();
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 4) prep_fwd_kernel(const PrepParams p) {
  PrepSmem<T>& s = *reinterpret_cast<PrepSmem<T>*>(smem_raw);
  if (tile_chunk() >= p.num_chunks) return;
  const auto [c, hv, HV, HK, groups, hk, K, V] = tile_ids(p);
  const int64_t tile = c * HV + hv;  // (chunk, value head)
  const int kb16 = (K + 15) >> 4, vb16 = (V + 15) >> 4;
  const int tid = threadIdx.x, warp = tid >> 5;

  // 1. rows: the copies start at once (each thread reads its rows' tokens from gather itself); the
  // norms in place once they landed
  const bool writer = hv % groups == 0;
  ChunkRows<kThreads> rows;
  rows.load(p.gather + c * kChunk);
  // k in the first group, v in a second one, waited for only before phase 5
  rows.copy<T>(s.k, kLdX, static_cast<const T*>(p.k), HK, hk, K);
  mm::cp_async_commit();
  rows.copy<T>(s.v, kLdX, static_cast<const T*>(p.v), HV, hv, V);
  mm::cp_async_commit();
  if (tid < kChunk) {
    const int64_t t = p.gather[c * kChunk + tid];
    s.tok[tid] = t;
    s.graw[tid] = t >= 0 ? row_scalar(p.g, p.g_type, t * HV + hv) : 0.f;
    s.beta[tid] = t >= 0 ? row_scalar(p.beta, p.beta_type, t * HV + hv) : 0.f;
  }
  __syncthreads();  // graw, beta, tok
  // 2. the chunk-local cumsum (sequential: exactly non-increasing for g <= 0), while the copies fly
  if (tid == 0) p.decay[tile] = chunk_cumsum(s.graw, s.G);
  mm::cp_async_wait<1>();  // k landed; v may still fly
  __syncthreads();
  if (tid < kChunk) {  // the per-row factors of phases 3b and 4 (64 exps instead of one per element)
    const float Gi = s.G[tid];
    s.bg[tid] = s.beta[tid] * exp_nonpos(Gi);
    s.dlast[tid] = exp_nonpos(s.G[kChunk - 1] - Gi);
  }
  scale_rows_smem<T, kThreads / 32>(s.k, kLdX, s.tok, HK, hk, p.l2norm, 1.f, writer ? p.rk : nullptr, true);
  __syncthreads();  // k^, bg, dlast complete
  if (tid < kChunk) p.G[tile * kChunk + tid] = s.G[tid];

  // 3a. A = beta_i exp(G_i - G_j) (K K^T)_ij, strictly lower (rows of this warp; columns of blocks <= warp)
  {
    mm::FragC acc[8];
    lower_nt<T>(acc, s.k, s.k, kLdX, warp, kb16);
    store_gated_A(s.u.A, acc, s.G, s.beta, warp);
  }
  // 3b. kd_j = exp(G_63 - G_j) k^_j (16-byte stores)
  store_kd<T>(static_cast<T*>(p.kd) + tile * kChunk * K, s.k, s.dlast, K);
  __syncthreads();

  {
    // 4. Ainv by 16 x 16 blocks in place; then each thread takes 8 columns
    // (c0 = 8 (tid % 8)..) of 4 rows (tid / 8 + 16 e) into registers, stores them to global (a warp
    // writes 4 whole 128-byte rows per store) and, after a barrier (the operands overlay A), the
    // two scaled operands.
    block_inverse(s.u.A, tid);
    const int c0 = (tid & 7) * 8, rr = tid >> 3;
    float xr[4][8];
    load_inverse(xr, s.u.A, c0, rr);
    T* dst = static_cast<T*>(p.Ainv) + tile * kChunk * kChunk + c0;
#pragma unroll
    for (int e = 0; e < 4; ++e) *reinterpret_cast<uint4*>(dst + (rr + 16 * e) * kChunk) = pack8<T>(xr[e]);
    __syncthreads();  // every thread is done reading A (the operands take its place)
    float b8[8], bg8[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      b8[m] = s.beta[c0 + m];
      bg8[m] = s.bg[c0 + m];
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = rr + 16 * e;
      float fb[8], fg[8];
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        fb[m] = xr[e][m] * b8[m];
        fg[m] = xr[e][m] * bg8[m];
      }
      *reinterpret_cast<uint4*>(s.u.op.ab + r * kLdI + c0) = pack8<T>(fb);
      *reinterpret_cast<uint4*>(s.u.op.abg + r * kLdI + c0) = pack8<T>(fg);
    }
    __syncthreads();
  }

  mm::cp_async_wait<0>();  // v's rows
  __syncthreads();
  // 5. w, u: column blocks per warp, no barrier until the stores
  mm::FragC acc[16];
  lower_times_cols<T>(acc, s.u.op.abg, s.k, warp, kb16);
  __syncwarp();
  stash_cols<T>(s.k, acc, warp, kb16);
  lower_times_cols<T>(acc, s.u.op.ab, s.v, warp, vb16);
  __syncwarp();
  stash_cols<T>(s.v, acc, warp, vb16);
  __syncthreads();
  store_rows<T>(static_cast<T*>(p.w) + tile * kChunk * K, s.k, K);
  store_rows<T>(static_cast<T*>(p.u) + tile * kChunk * V, s.v, V);
}

}  // namespace

const char* launch_prep_fwd(const PrepParams& p, void* cuda_stream) {
  return launch_checked(prep_fwd_kernel<__nv_bfloat16>, prep_fwd_kernel<__half>, kThreads,
                        static_cast<int>(sizeof(PrepSmem<__half>)), p, cuda_stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
