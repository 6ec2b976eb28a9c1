// Device pieces shared by the fused SSD forward's kernels, one definition so the arithmetic is the same
// expression in each (their outputs are bitwise equal): for the chunk scans (ssd_chunk_scan_fwd.cu,
// ssd_chunk_scan_group_fwd.cu) the cp.async tile loaders, the masked / decayed score, the row scale by
// exp(Lam), 8-wide pack / unpack (mma.cuh's) and the 16-byte epilogue (D x, y saved pre-gate, the z gate,
// out), and the grouped scan's base layout, block numbers, token rows, C / B copies, head prefetch and host
// entry; for the chunk-state kernels dt's preparation, the block cumsum of dt A, the weights w and the
// (P x 64-column) accumulator walk. CUDA only; include from .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels::tiles {
namespace mma = tree_recurrence::kernels::mma;

__host__ __device__ constexpr int64_t round64(int64_t n) { return (n + 63) / 64 * 64; }

__device__ __forceinline__ float silu(float v) {
  // v * sigmoid(v), exponentiating only non-positive numbers
  const float e = expf(-fabsf(v));
  return v >= 0.f ? v / (1.f + e) : v * e / (1.f + e);
}

// rows x (vecs * 8) elements into dst (pitch ld): row r from src + tok[r] * stride (tok[r] < 0: a
// pad row, zero-filled), columns >= width zero-filled. NT threads share the copies; one commit
// group is the caller's.
template <int NT, typename T>
__device__ __forceinline__ void rows_async(T* dst, int ld, const T* src, int64_t stride, const int64_t* tok, int rows,
                                           int vecs, int64_t width, int tid) {
  for (int v = tid; v < rows * vecs; v += NT) {
    const int r = v / vecs, col = (v % vecs) * 8;
    const int64_t t = tok[r];
    const bool ok = t >= 0 && col < width;
    mma::cp_async_16(dst + r * ld + col, ok ? src + t * stride + col : src, ok ? 16 : 0);
  }
}

// rows x (vecs * 8) elements of a dense row-major matrix (pitch src_ld) into dst (pitch ld); rows >=
// valid_rows and columns >= width zero-filled.
template <int NT, typename T>
__device__ __forceinline__ void dense_async(T* dst, int ld, const T* src, int64_t src_ld, int rows, int64_t valid_rows,
                                            int vecs, int64_t width, int tid) {
  for (int v = tid; v < rows * vecs; v += NT) {
    const int r = v / vecs, col = (v % vecs) * 8;
    const bool ok = r < valid_rows && col < width;
    mma::cp_async_16(dst + r * ld + col, ok ? src + int64_t(r) * src_ld + col : src, ok ? 16 : 0);
  }
}

// <C_i, B_j> masked to j <= i and times exp(min(Lam_i - Lam_j, 0)) dt_j
__device__ __forceinline__ float masked_score(float s, int i, int j, const float* lam, const float* dt) {
  return j <= i ? s * expf(fminf(lam[i] - lam[j], 0.f)) * dt[j] : 0.f;
}

// the accumulator rows (c_row 0 / 8 of this lane) times exp(min(Lam, 0)) of rows lam_r0 / lam_r1
template <int NTP>
__device__ __forceinline__ void scale_rows(mma::FragC (&acc)[1][NTP], float lam_r0, float lam_r1) {
  const float f0 = expf(fminf(lam_r0, 0.f));
  const float f1 = expf(fminf(lam_r1, 0.f));
#pragma unroll
  for (int nt = 0; nt < NTP; ++nt) {
    acc[0][nt].x[0] *= f0, acc[0][nt].x[1] *= f0;
    acc[0][nt].x[2] *= f1, acc[0][nt].x[3] *= f1;
  }
}

// acc = A B^T over K = NP columns in 64-column pieces (the order every chunk scan uses): A this warp's
// 16 rows (pitch lda), B NT * 8 rows (pitch ldb), both k-contiguous
template <typename T, int NT>
__device__ __forceinline__ void gemm_pieces(mma::FragC (&acc)[1][NT], const T* A, int lda, const T* B, int ldb, int NP) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[0][nt].zero();
  for (int n0 = 0; n0 < NP; n0 += 64)
    mma::warp_gemm<T, 1, NT, 4, /*A_ROW=*/true, /*B_KN=*/false>(acc, A + n0, lda, B + n0, ldb);
}

// acc += a (16 x 16 scores of key rows 16 kt ..) times the x rows x_kt (16 x NTP * 8, pitch ldx)
template <typename T, int NTP>
__device__ __forceinline__ void mma_scores_x(mma::FragC (&acc)[1][NTP], const mma::FragA& a, const T* x_kt, int ldx) {
#pragma unroll
  for (int np = 0; np < NTP / 2; ++np) {
    mma::FragB b0, b1;
    mma::load_b_kn(b0, b1, x_kt + np * 16, ldx);
    mma::mma<T>(acc[0][2 * np], a, b0);
    mma::mma<T>(acc[0][2 * np + 1], a, b1);
  }
}

// this warp's 16 x (NTP * 8) fp32 accumulators into stage (pitch ld floats), rows row0 + c_row
template <int NTP>
__device__ __forceinline__ void stage_acc(float* stage, int ld, int row0, const mma::FragC (&acc)[1][NTP], int lane) {
#pragma unroll
  for (int nt = 0; nt < NTP; ++nt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = row0 + mma::c_row(lane, 2 * half);
      const int col = nt * 8 + mma::c_col(lane, 2 * half);
      *reinterpret_cast<float2*>(stage + r * ld + col) = make_float2(acc[0][nt].x[2 * half], acc[0][nt].x[2 * half + 1]);
    }
}

// the accumulator pairs (x[2 rr], x[2 rr + 1]: row c_row(lane, 0) for rr 0, + 8 for rr 1) of NT
// 8-column tiles rounded to the in-type, two elements per 32-bit word (the A / stmatrix register
// layout)
template <typename T, int NT>
__device__ __forceinline__ void pack_pairs(uint32_t (&u)[NT][2], const mma::FragC (&acc)[1][NT]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) u[nt][rr] = mma::Elem<T>::pack(acc[0][nt].x[2 * rr], acc[0][nt].x[2 * rr + 1]);
}

using mma::pack8;  // mma.cuh's: 8 consecutive elements of T (one 16-byte word) <-> 8 floats
using mma::unpack8;

// 8 output columns of one row: f (fp32, from a staged accumulator row) + D x, y = that (saved when
// y is given and z is), out = y silu(z) (z given) else y; 16-byte stores at element idx of y / out.
// x8: the row's x values (shared memory); z8: the row's in-type z values (global or shared memory;
// used when z is given and not fp32; fp32 z is read from p.z at idx); Dh: D + h * P + col.
template <typename T>
__device__ __forceinline__ void epilogue8(const FwdParams& p, const float* stage_row, const T* x8, const T* z8,
                                          const float* Dh, int64_t idx, T* y, T* out) {
  float f[8];
  {
    const float4 a0 = *reinterpret_cast<const float4*>(stage_row);
    const float4 a1 = *reinterpret_cast<const float4*>(stage_row + 4);
    f[0] = a0.x, f[1] = a0.y, f[2] = a0.z, f[3] = a0.w, f[4] = a1.x, f[5] = a1.y, f[6] = a1.z, f[7] = a1.w;
  }
  if (Dh) {
    float xv[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(x8), xv);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] += Dh[k] * xv[k];
  }
  if (p.z) {
    if (y) *reinterpret_cast<uint4*>(y + idx) = pack8<T>(f);  // null: not saved (no grad)
    float zv[8];
    if (p.z_fp32) {
      const float4* zp = reinterpret_cast<const float4*>(static_cast<const float*>(p.z) + idx);
      const float4 z0 = zp[0], z1 = zp[1];
      zv[0] = z0.x, zv[1] = z0.y, zv[2] = z0.z, zv[3] = z0.w, zv[4] = z1.x, zv[5] = z1.y, zv[6] = z1.z, zv[7] = z1.w;
    } else {
      unpack8<T>(*reinterpret_cast<const uint4*>(z8), zv);
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] *= silu(zv[k]);
  }
  *reinterpret_cast<uint4*>(out + idx) = pack8<T>(f);
}

// --- the grouped chunk scan (ssd_chunk_scan_group_fwd.cu) -----------------------------------------

// its base shared-memory pieces, in elements of the in-type: c_s (L x ldc), sb[2] (max(PT, L) x ldc:
// the states; sb[1] first holds B), x_s[2] (L x PT + 8), z_s[2] (L x PT + 8, in-type z only); the
// kernel's layout adds its own pieces after these
struct ScanSmem {
  int64_t ldc, c_elems, sb_elems, x_elems, z_elems;
};
template <int L>
__host__ __device__ inline ScanSmem scan_smem(int64_t N, int PT, bool z_tile) {
  ScanSmem m;
  m.ldc = round64(N) + 8;
  m.c_elems = L * m.ldc;
  m.sb_elems = int64_t(PT > L ? PT : L) * m.ldc;
  m.x_elems = int64_t(L) * (PT + 8);
  m.z_elems = z_tile ? m.x_elems : 0;
  return m;
}

// a block's group g, chunk c and the first head of its slice (hpb heads from g hpg + slice hpb):
// blockIdx.x = (c * G + g) * splits + slice (the slice fastest)
struct ScanBlock {
  int64_t g, c, h_first;
};
__device__ __forceinline__ ScanBlock scan_block(int64_t G, int64_t hpg, int64_t hpb, int splits) {
  const int64_t bid = blockIdx.x;
  const int64_t slice = bid % splits;
  const int64_t cg = bid / splits;
  const int64_t g = cg % G, c = cg / G;
  return {g, c, g * hpg + slice * hpb};
}

// chunk c's token rows (p.gather, L of them) into tok_s by NT threads, then a block barrier; false
// (no barrier) for an all-padding chunk: uniform over the block, the caller returns
template <int L, int NT>
__device__ __forceinline__ bool chunk_tokens(const FwdParams& p, int64_t c, int64_t* tok_s, int tid) {
  const int64_t* gather = p.gather + c * L;
  if (gather[0] < 0) return false;
  for (int r = tid; r < L; r += NT) tok_s[r] = gather[r];
  __syncthreads();
  return true;
}

// group g's C and B rows (G groups, N columns) of the chunk's tokens (tok_s) into c_s and b_s (pitch
// ldc, CV 8-element vectors a row: zeros past N and on pad rows), one cp.async commit group
template <int L, int NT, typename T>
__device__ __forceinline__ void issue_cb(const FwdParams& p, T* c_s, T* b_s, int ldc, const int64_t* tok_s, int64_t g,
                                         int64_t G, int64_t N, int CV, int tid) {
  rows_async<NT>(c_s, ldc, static_cast<const T*>(p.C) + g * N, G * N, tok_s, L, CV, N, tid);
  rows_async<NT>(b_s, ldc, static_cast<const T*>(p.B) + g * N, G * N, tok_s, L, CV, N, tid);
  mma::cp_async_commit();
}

// the head loop's prefetch (one commit group a head): issue_next() (head k + 1's operands into the
// other buffer) when there is a head k + 1 of the hpb, then the wait for head k's group
template <typename F>
__device__ __forceinline__ void prefetch_next(int64_t k, int64_t hpb, F&& issue_next) {
  if (k + 1 < hpb) {
    issue_next();
    mma::cp_async_wait<1>();
  } else {
    mma::cp_async_wait<0>();
  }
}

// --- chunk states --------------------------------------------------------------------------------

__device__ __forceinline__ float softplus20(float v) {
  // torch's softplus with threshold 20, in a form that never exponentiates a positive number
  return v > 20.f ? v : fmaxf(v, 0.f) + log1pf(expf(-fabsf(v)));
}

// the prepared dt of a real row from its raw value: + bias, softplus (when asked), clamped
__device__ __forceinline__ float prep_dt(const FwdParams& p, float raw, float bias) {
  float d = raw + bias;
  if (p.dt_softplus) d = softplus20(d);
  return fminf(fmaxf(d, p.dt_min), p.dt_max);
}

// lam_s[j] = inclusive cumsum over j of dt_s[j] * a (L rows, NT threads): E consecutive values per
// thread, then a block scan of the thread totals (warp shuffles, then the warp totals in order).
// Fixed order: deterministic. One barrier inside (tot_s, NT / 32 floats); the caller syncs before
// reading lam_s.
template <int L, int NT>
__device__ __forceinline__ void block_cumsum(const float* dt_s, float* lam_s, float* tot_s, float a, int tid) {
  constexpr int E = (L + NT - 1) / NT;
  const int warp = tid >> 5, lane = tid & 31;
  float loc[E];
  float run = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int j = tid * E + e;
    if (j < L) run += dt_s[j] * a;
    loc[e] = run;
  }
  float incl = run;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float v = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += v;
  }
  if (lane == 31) tot_s[warp] = incl;
  __syncthreads();
  float prefix = incl - run;
  for (int w = 0; w < warp; ++w) prefix += tot_s[w];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int j = tid * E + e;
    if (j < L) lam_s[j] = prefix + loc[e];
  }
}

// dt and Lam of the chunk to rows row0.. of p.dt / p.Lam (when write), and w_s[j] (holding dt) to
// w_j = exp(min(Lam_last - Lam_j, 0)) dt_j
template <int L, int NT>
__device__ __forceinline__ void chunk_weights(const FwdParams& p, int64_t row0, bool write, const float* lam_s,
                                              float* w_s, int tid) {
  const float lam_last = lam_s[L - 1];
  for (int j = tid; j < L; j += NT) {
    const float d = w_s[j];
    if (write) {
      p.dt[row0 + j] = d;
      p.Lam[row0 + j] = lam_s[j];
    }
    w_s[j] = expf(fminf(lam_last - lam_s[j], 0.f)) * d;
  }
}

// 8 in-type values times w, rounded to the in-type
template <typename T>
__device__ __forceinline__ uint4 scale8(const uint4& raw, float w) {
  const T* e = reinterpret_cast<const T*>(&raw);
  uint4 packed;
  packed.x = mma::Elem<T>::pack(mma::Elem<T>::to_float(e[0]) * w, mma::Elem<T>::to_float(e[1]) * w);
  packed.y = mma::Elem<T>::pack(mma::Elem<T>::to_float(e[2]) * w, mma::Elem<T>::to_float(e[3]) * w);
  packed.z = mma::Elem<T>::pack(mma::Elem<T>::to_float(e[4]) * w, mma::Elem<T>::to_float(e[5]) * w);
  packed.w = mma::Elem<T>::pack(mma::Elem<T>::to_float(e[6]) * w, mma::Elem<T>::to_float(e[7]) * w);
  return packed;
}

// f(acc2, row, col, inside) for each adjacent pair (x[e], x[e + 1]) of a warp's P x 16 state
// accumulators acc[MT][2] (warp w: columns n0 + 16 w ..); acc2 points at x[e]; inside: the pair lies
// inside P x N
template <int MT, typename F>
__device__ __forceinline__ void state_pairs(mma::FragC (&acc)[MT][2], int64_t P, int64_t N, int64_t n0, int warp,
                                            int lane, F&& f) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int64_t row = mt * 16 + mma::c_row(lane, e);
        const int64_t col = n0 + warp * 16 + nt * 8 + mma::c_col(lane, e);
        f(&acc[mt][nt].x[e], row, col, row < P && col < N);
      }
}

// 16-byte vector access of the forward's x / z / y / out rows
inline bool rows_aligned16(const FwdParams& p) {
  const void* ptrs[4] = {p.out, p.y, p.z, p.x};
  for (const void* q : ptrs)
    if (q && reinterpret_cast<uintptr_t>(q) % 16 != 0) return false;
  return true;
}

// --- host: the launchers' template dispatch --------------------------------------------------------

template <typename T>
struct type_tag {
  using type = T;
};
template <int V>
struct int_tag {
  static constexpr int value = V;
};

// f(type_tag<T>{}, int_tag<L>{}, int_tag<PT>{}) for p's in-type (bf16 / fp16), chunk L (64 / 128 /
// 256) and P padded to PT (32 / 64 / 128); returns f's int
template <typename F>
int dispatch(const FwdParams& p, F&& f) {
  auto by_p = [&](auto t, auto l) {
    if (p.head_dim <= 32) return f(t, l, int_tag<32>{});
    if (p.head_dim <= 64) return f(t, l, int_tag<64>{});
    return f(t, l, int_tag<128>{});
  };
  auto by_l = [&](auto t) {
    if (p.chunk == 64) return by_p(t, int_tag<64>{});
    if (p.chunk == 128) return by_p(t, int_tag<128>{});
    return by_p(t, int_tag<256>{});
  };
  return p.in == InType::BFloat16 ? by_l(type_tag<__nv_bfloat16>{}) : by_l(type_tag<__half>{});
}

inline int padded_p(int64_t P) { return P <= 32 ? 32 : P <= 64 ? 64 : 128; }

// --- host: the grouped chunk scan's entry ------------------------------------------------------

// its shape conditions: chunk L, a supported shape with P <= 64, heads a multiple of groups
inline bool grouped_scan_shape(const FwdParams& p, int L) {
  return p.chunk == L && fwd_shape_supported(p.chunk, p.head_dim, p.state_dim) && p.head_dim <= 64 && p.groups > 0 &&
         p.heads % p.groups == 0;
}
// and the row conditions: chunk x head numbers below 2^31, 16-byte vectors of x / z / y / out rows
// (P % 8 == 0)
inline bool grouped_scan_rows(const FwdParams& p) {
  return p.num_chunks * p.heads <= 2147483647LL && rows_aligned16(p);
}

// how many blocks share a (chunk, group)'s heads: the least divisor of H / G giving min_blocks
// blocks (the grid fills the GPU), else H / G
inline int head_splits(const FwdParams& p, int64_t min_blocks) {
  const int64_t hpg = p.heads / p.groups;
  int64_t d = 1;
  while (d < hpg && p.num_chunks * p.groups * d < min_blocks) {
    ++d;
    while (hpg % d != 0) ++d;
  }
  return static_cast<int>(d);
}

// kernel<<<NC * G * splits blocks, threads, bytes>>>(p, splits), splits = head_splits(p, min_blocks)
template <typename K>
inline int launch_grouped(K kernel, int threads, size_t bytes, const FwdParams& p, int64_t min_blocks,
                          cudaStream_t stream) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  const int splits = head_splits(p, min_blocks);
  const int64_t blocks = p.num_chunks * p.groups * splits;
  kernel<<<dim3(static_cast<unsigned>(blocks)), threads, bytes, stream>>>(p, splits);
  return static_cast<int>(cudaGetLastError());
}

// an entry: cudaErrorInvalidValue unless supported, 0 without chunks, else by_type(type_tag<T>{},
// stream) for p's in-type T (bf16 / fp16)
template <typename F>
int run_grouped(bool supported, const FwdParams& p, void* stream, F&& by_type) {
  if (!supported) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return p.in == InType::BFloat16 ? by_type(type_tag<__nv_bfloat16>{}, s) : by_type(type_tag<__half>{}, s);
}

}  // namespace tree_recurrence::ssd::fused::kernels::tiles
