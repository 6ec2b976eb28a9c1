// Fused SSD forward, stage d (params.h, ssd_fused.h): the chunk scan, on tensor cores.
//   y_i = exp(Lam_i) C_i s[c]^T + sum_{j <= i} <C_i, B_j> exp(Lam_i - Lam_j) dt_j x_j + D x_i
//   out_i = y_i * silu(z_i) (z given; y saved pre-gate), else y_i; written at the tokens' rows.
// Grid (NC * L / 64, H): a block owns 64 rows i of one (chunk, head) and every P column (PT = P
// padded to 32 / 64 / 128); 128 threads, warp w rows [16 w, 16 w + 16). C rows (all N, padded to a
// multiple of 64) stay in shared memory; the state s[c] (P x N, in-type) is staged in 64-column
// pieces for C s^T; then per key block of 64 rows up to the diagonal: scores = C B^T (fp32),
// masked (j <= i), times exp(min(Lam_i - Lam_j, 0)) dt_j, rounded to the in-type in registers
// (the accumulator becomes the next MMA's A operand) and multiplied by the block's x rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {
namespace mma = tree_recurrence::kernels::mma;

constexpr int kThreads = 128;
constexpr int kRows = 64;          // rows i per block; key rows j per block step
constexpr int kPiece = 64;         // N columns per staged state piece
constexpr int kLdS = kPiece + 8;   // pitch of a staged state piece

__host__ __device__ constexpr int64_t round64(int64_t n) { return (n + 63) / 64 * 64; }

struct Smem {
  int64_t ldc, c_elems, buf_elems, x_elems;
  size_t bytes;
};
__host__ __device__ inline Smem smem_layout(int64_t N, int PT, int L) {
  Smem m;
  m.ldc = round64(N) + 8;
  m.c_elems = kRows * m.ldc;
  m.buf_elems = m.c_elems > int64_t(PT) * kLdS ? m.c_elems : int64_t(PT) * kLdS;
  m.x_elems = int64_t(kRows) * (PT + 8);
  m.bytes = size_t(m.c_elems + m.buf_elems + m.x_elems) * 2 + size_t(2 * L) * sizeof(float) + kRows * sizeof(int64_t);
  return m;
}

__device__ __forceinline__ float silu(float v) {
  // v * sigmoid(v), exponentiating only non-positive numbers
  const float e = expf(-fabsf(v));
  return v >= 0.f ? v / (1.f + e) : v * e / (1.f + e);
}

template <typename T>
__device__ __forceinline__ float2 load2(const T* p) {
  return make_float2(mma::Elem<T>::to_float(p[0]), mma::Elem<T>::to_float(p[1]));
}

template <typename T, int L, int PT>
__global__ void __launch_bounds__(kThreads) chunk_scan_kernel(FwdParams p) {
  constexpr int NTP = PT / 8;  // 8-column accumulator tiles over P
  constexpr int kLdX = PT + 8;
  constexpr int kTiles = L / kRows;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const Smem lay = smem_layout(N, PT, L);
  const int ldc = static_cast<int>(lay.ldc);
  const int NP = ldc - 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* c_s = reinterpret_cast<T*>(smem);   // kRows x ldc: C(i, n)
  T* buf = c_s + lay.c_elems;            // state piece s(p, n) (pitch kLdS) or B(j, n) (pitch ldc)
  T* x_s = buf + lay.buf_elems;          // kRows x kLdX: x(j, p)
  float* lam_s = reinterpret_cast<float*>(x_s + lay.x_elems);  // L
  float* dt_s = lam_s + L;                                     // L
  int64_t* tok_s = reinterpret_cast<int64_t*>(dt_s + L);       // kRows (this block's rows)

  const int64_t c = blockIdx.x / kTiles;
  const int mtile = blockIdx.x % kTiles;
  const int64_t h = blockIdx.y, g = h / (H / G);
  const int i0 = mtile * kRows;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t* gather = p.gather + c * L;
  if (gather[i0] < 0) return;  // every row of this tile is padding (uniform over the block)

  const int64_t row0 = (c * H + h) * L;
  for (int j = tid; j < i0 + kRows; j += kThreads) {
    lam_s[j] = p.Lam[row0 + j];
    dt_s[j] = p.dt[row0 + j];
  }
  for (int r = tid; r < kRows; r += kThreads) tok_s[r] = gather[i0 + r];
  __syncthreads();

  const T* Cm = static_cast<const T*>(p.C);
  const T* Bm = static_cast<const T*>(p.B);
  const T* x = static_cast<const T*>(p.x);
  const T* states = static_cast<const T*>(p.states) + (c * H + h) * P * N;
  const int CV = NP / 8;
  for (int v = tid; v < kRows * CV; v += kThreads) {
    const int r = v / CV, col = (v % CV) * 8;
    const int64_t tok = tok_s[r];
    const bool ok = tok >= 0 && col < N;
    mma::cp_async_16(c_s + r * ldc + col, ok ? Cm + (tok * G + g) * N + col : Cm, ok ? 16 : 0);
  }
  mma::cp_async_commit();

  // 1. C s^T, then rows scaled by exp(Lam_i)
  mma::FragC acc[1][NTP];
#pragma unroll
  for (int nt = 0; nt < NTP; ++nt) acc[0][nt].zero();
  for (int n0 = 0; n0 < NP; n0 += kPiece) {
    for (int v = tid; v < PT * (kPiece / 8); v += kThreads) {
      const int r = v / (kPiece / 8), col = (v % (kPiece / 8)) * 8;
      const bool ok = r < P && n0 + col < N;
      mma::cp_async_16(buf + r * kLdS + col, ok ? states + int64_t(r) * N + n0 + col : states, ok ? 16 : 0);
    }
    mma::cp_async_commit();
    mma::cp_async_wait<0>();
    __syncthreads();
    mma::warp_gemm<T, 1, NTP, kPiece / 16, /*A_ROW=*/true, /*B_KN=*/false>(acc, c_s + warp * 16 * ldc + n0, ldc, buf, kLdS);
    __syncthreads();
  }
  {
    const float f0 = expf(fminf(lam_s[i0 + warp * 16 + mma::c_row(lane, 0)], 0.f));
    const float f1 = expf(fminf(lam_s[i0 + warp * 16 + mma::c_row(lane, 2)], 0.f));
#pragma unroll
    for (int nt = 0; nt < NTP; ++nt) {
      acc[0][nt].x[0] *= f0, acc[0][nt].x[1] *= f0;
      acc[0][nt].x[2] *= f1, acc[0][nt].x[3] *= f1;
    }
  }

  // 2. the chunk's own tokens: key blocks up to the diagonal
  constexpr int XV = PT / 8;
  for (int kb = 0; kb <= mtile; ++kb) {
    const int j0 = kb * kRows;
    for (int v = tid; v < kRows * CV; v += kThreads) {
      const int r = v / CV, col = (v % CV) * 8;
      const int64_t tok = gather[j0 + r];
      const bool ok = tok >= 0 && col < N;
      mma::cp_async_16(buf + r * ldc + col, ok ? Bm + (tok * G + g) * N + col : Bm, ok ? 16 : 0);
    }
    for (int v = tid; v < kRows * XV; v += kThreads) {
      const int r = v / XV, col = (v % XV) * 8;
      const int64_t tok = gather[j0 + r];
      const bool ok = tok >= 0 && col < P;
      mma::cp_async_16(x_s + r * kLdX + col, ok ? x + (tok * H + h) * P + col : x, ok ? 16 : 0);
    }
    mma::cp_async_commit();
    mma::cp_async_wait<0>();
    __syncthreads();
    mma::FragC sc[1][8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) sc[0][nt].zero();
    for (int n0 = 0; n0 < NP; n0 += kPiece)
      mma::warp_gemm<T, 1, 8, kPiece / 16, /*A_ROW=*/true, /*B_KN=*/false>(sc, c_s + warp * 16 * ldc + n0, ldc, buf + n0, ldc);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + warp * 16 + mma::c_row(lane, e);
        const int j = j0 + nt * 8 + mma::c_col(lane, e);
        sc[0][nt].x[e] = j <= i ? sc[0][nt].x[e] * expf(fminf(lam_s[i] - lam_s[j], 0.f)) * dt_s[j] : 0.f;
      }
#pragma unroll
    for (int kt = 0; kt < kRows / 16; ++kt) {
      const mma::FragA a = mma::c_to_a<T>(sc[0][2 * kt], sc[0][2 * kt + 1]);
#pragma unroll
      for (int np = 0; np < NTP / 2; ++np) {
        mma::FragB b0, b1;
        mma::load_b_kn(b0, b1, x_s + kt * 16 * kLdX + np * 16, kLdX);
        mma::mma<T>(acc[0][2 * np], a, b0);
        mma::mma<T>(acc[0][2 * np + 1], a, b1);
      }
    }
    __syncthreads();
  }

  // 3. D x, the z gate, stores at the tokens' rows
  T* out = static_cast<T*>(p.out);
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + mma::c_row(lane, 2 * half);
    const int64_t tok = tok_s[r];
    if (tok < 0) continue;
#pragma unroll
    for (int nt = 0; nt < NTP; ++nt) {
      const int64_t col = nt * 8 + mma::c_col(lane, 2 * half);
      if (col >= P) continue;
      const int64_t idx = (tok * H + h) * P + col;
      float y0 = acc[0][nt].x[2 * half], y1 = acc[0][nt].x[2 * half + 1];
      if (p.D) {
        const float2 xv = load2(x + idx);
        y0 += p.D[h * P + col] * xv.x;
        y1 += p.D[h * P + col + 1] * xv.y;
      }
      if (p.z) {
        if (y) *reinterpret_cast<uint32_t*>(y + idx) = mma::Elem<T>::pack(y0, y1);  // null: not saved (no grad)
        const float2 zv = p.z_fp32 ? *reinterpret_cast<const float2*>(static_cast<const float*>(p.z) + idx)
                                   : load2(static_cast<const T*>(p.z) + idx);
        y0 *= silu(zv.x);
        y1 *= silu(zv.y);
      }
      *reinterpret_cast<uint32_t*>(out + idx) = mma::Elem<T>::pack(y0, y1);
    }
  }
}

template <typename T, int L, int PT>
int launch(const FwdParams& p, cudaStream_t stream) {
  const Smem lay = smem_layout(p.state_dim, PT, L);
  auto kernel = chunk_scan_kernel<T, L, PT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(lay.bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  const dim3 grid(static_cast<unsigned>(p.num_chunks * (L / kRows)), static_cast<unsigned>(p.heads));
  kernel<<<grid, kThreads, lay.bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int L>
int by_p(const FwdParams& p, cudaStream_t s) {
  if (p.head_dim <= 32) return launch<T, L, 32>(p, s);
  if (p.head_dim <= 64) return launch<T, L, 64>(p, s);
  return launch<T, L, 128>(p, s);
}

template <typename T>
int by_l(const FwdParams& p, cudaStream_t s) {
  if (p.chunk == 64) return by_p<T, 64>(p, s);
  if (p.chunk == 128) return by_p<T, 128>(p, s);
  return by_p<T, 256>(p, s);
}


// --- v2 (default; TREE_RECURRENCE_SSD_FWD_SCAN=v1 selects the kernel above) ---------------------
// Same arithmetic as chunk_scan_kernel (C s^T in 64-column pieces into the same accumulators, the
// same masked / decayed scores rounded to the in-type, the same epilogue expressions), so results
// are expected bitwise equal; the memory side differs:
//  * 1-D grid with the head fastest: the H / G heads of one (chunk, row tile) run next to each other,
//    so C and B rows (per group) are read from DRAM once and hit L2 for the other heads (v1's grid
//    (chunk tiles, H) put one head's 768 chunks between two heads of a chunk: C and B re-read per head);
//  * all operands of the first key block in flight at once: C + the whole state s[c] (commit group 0)
//    and B + x of key block 0 (group 1); C s^T runs while group 1 lands;
//  * epilogue through shared memory: the fp32 accumulators are staged in the dead C / state region,
//    then each thread owns 8 consecutive columns of a row: D x from the staged x rows (the last key
//    block is the tile's own rows), z read, y and out written as 16-byte vectors (v1: 4-byte stores
//    and 4-byte x / z loads in the MMA fragment layout);
//  * <= 168 registers at P <= 64 (3 CTAs of 128 threads per SM; P 128: 2), 62 KB of shared memory
//    at P 64, N 128 (3 CTAs per SM).
// Taken when the layout fits in kV2MaxSmem (else v1).
constexpr size_t kV2MaxSmem = 110 * 1024;

struct SmemV2 {
  int64_t ldc, c_elems, st_elems, b_elems, x_elems, stage_floats;
  size_t lo_bytes;  // c_s + st_s (bf16), or the fp32 stage when larger
  size_t bytes;
};
__host__ __device__ inline SmemV2 smem_layout_v2(int64_t N, int PT, int L) {
  SmemV2 m;
  m.ldc = round64(N) + 8;
  m.c_elems = kRows * m.ldc;
  m.st_elems = int64_t(PT) * m.ldc;
  m.b_elems = kRows * m.ldc;
  m.x_elems = int64_t(kRows) * (PT + 8);
  m.stage_floats = int64_t(kRows) * (PT + 4);
  const size_t ops = size_t(m.c_elems + m.st_elems) * 2;
  const size_t stage = size_t(m.stage_floats) * sizeof(float);
  m.lo_bytes = ((ops > stage ? ops : stage) + 15) / 16 * 16;
  m.bytes = m.lo_bytes + size_t(m.b_elems + m.x_elems) * 2 + size_t(2 * L) * sizeof(float) + kRows * sizeof(int64_t);
  return m;
}

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int k = 0; k < 8; ++k) f[k] = mma::Elem<T>::to_float(e[k]);
}
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  v.x = mma::Elem<T>::pack(f[0], f[1]);
  v.y = mma::Elem<T>::pack(f[2], f[3]);
  v.z = mma::Elem<T>::pack(f[4], f[5]);
  v.w = mma::Elem<T>::pack(f[6], f[7]);
  return v;
}

template <typename T, int L, int PT>
__global__ void __launch_bounds__(kThreads, PT > 64 ? 2 : 3) chunk_scan_kernel_v2(FwdParams p) {
  constexpr int NTP = PT / 8;
  constexpr int kLdX = PT + 8;
  constexpr int kLdStage = PT + 4;
  constexpr int kTiles = L / kRows;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const SmemV2 lay = smem_layout_v2(N, PT, L);
  const int ldc = static_cast<int>(lay.ldc);
  const int NP = ldc - 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* c_s = reinterpret_cast<T*>(smem);                         // kRows x ldc: C(i, n)
  T* st_s = c_s + lay.c_elems;                                 // PT x ldc: s(p, n)
  float* stage = reinterpret_cast<float*>(smem);               // kRows x kLdStage (after the MMAs)
  T* b_s = reinterpret_cast<T*>(smem + lay.lo_bytes);          // kRows x ldc: B(j, n)
  T* x_s = b_s + lay.b_elems;                                  // kRows x kLdX: x(j, p)
  float* lam_s = reinterpret_cast<float*>(x_s + lay.x_elems);  // L
  float* dt_s = lam_s + L;                                     // L
  int64_t* tok_s = reinterpret_cast<int64_t*>(dt_s + L);       // kRows (this tile's rows)

  // head fastest: blockIdx.x = (c * kTiles + mtile) * H + h
  const int64_t bid = blockIdx.x;
  const int64_t h = bid % H;
  const int64_t rest = bid / H;
  const int mtile = static_cast<int>(rest % kTiles);
  const int64_t c = rest / kTiles;
  const int64_t g = h / (H / G);
  const int i0 = mtile * kRows;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t* gather = p.gather + c * L;
  if (gather[i0] < 0) return;  // every row of this tile is padding (uniform over the block)

  const T* Cm = static_cast<const T*>(p.C);
  const T* Bm = static_cast<const T*>(p.B);
  const T* x = static_cast<const T*>(p.x);
  const T* states = static_cast<const T*>(p.states) + (c * H + h) * P * N;
  const int CV = NP / 8;
  constexpr int XV = PT / 8;
  // group 0: C rows of the tile and the whole state
  for (int v = tid; v < kRows * CV; v += kThreads) {
    const int r = v / CV, col = (v % CV) * 8;
    const int64_t tok = gather[i0 + r];
    const bool ok = tok >= 0 && col < N;
    mma::cp_async_16(c_s + r * ldc + col, ok ? Cm + (tok * G + g) * N + col : Cm, ok ? 16 : 0);
  }
  for (int v = tid; v < PT * CV; v += kThreads) {
    const int r = v / CV, col = (v % CV) * 8;
    const bool ok = r < P && col < N;
    mma::cp_async_16(st_s + r * ldc + col, ok ? states + int64_t(r) * N + col : states, ok ? 16 : 0);
  }
  mma::cp_async_commit();
  // B and x rows of key block kb
  auto issue_keys = [&](int kb) {
    const int j0 = kb * kRows;
    for (int v = tid; v < kRows * CV; v += kThreads) {
      const int r = v / CV, col = (v % CV) * 8;
      const int64_t tok = gather[j0 + r];
      const bool ok = tok >= 0 && col < N;
      mma::cp_async_16(b_s + r * ldc + col, ok ? Bm + (tok * G + g) * N + col : Bm, ok ? 16 : 0);
    }
    for (int v = tid; v < kRows * XV; v += kThreads) {
      const int r = v / XV, col = (v % XV) * 8;
      const int64_t tok = gather[j0 + r];
      const bool ok = tok >= 0 && col < P;
      mma::cp_async_16(x_s + r * kLdX + col, ok ? x + (tok * H + h) * P + col : x, ok ? 16 : 0);
    }
    mma::cp_async_commit();
  };
  issue_keys(0);  // group 1

  const int64_t row0 = (c * H + h) * L;
  for (int j = tid; j < i0 + kRows; j += kThreads) {
    lam_s[j] = p.Lam[row0 + j];
    dt_s[j] = p.dt[row0 + j];
  }
  for (int r = tid; r < kRows; r += kThreads) tok_s[r] = gather[i0 + r];
  mma::cp_async_wait<1>();
  __syncthreads();

  // 1. C s^T, then rows scaled by exp(Lam_i)
  mma::FragC acc[1][NTP];
#pragma unroll
  for (int nt = 0; nt < NTP; ++nt) acc[0][nt].zero();
  for (int n0 = 0; n0 < NP; n0 += kPiece)
    mma::warp_gemm<T, 1, NTP, kPiece / 16, /*A_ROW=*/true, /*B_KN=*/false>(acc, c_s + warp * 16 * ldc + n0, ldc,
                                                                           st_s + n0, ldc);
  {
    const float f0 = expf(fminf(lam_s[i0 + warp * 16 + mma::c_row(lane, 0)], 0.f));
    const float f1 = expf(fminf(lam_s[i0 + warp * 16 + mma::c_row(lane, 2)], 0.f));
#pragma unroll
    for (int nt = 0; nt < NTP; ++nt) {
      acc[0][nt].x[0] *= f0, acc[0][nt].x[1] *= f0;
      acc[0][nt].x[2] *= f1, acc[0][nt].x[3] *= f1;
    }
  }

  // 2. the chunk's own tokens: key blocks up to the diagonal
  for (int kb = 0; kb <= mtile; ++kb) {
    const int j0 = kb * kRows;
    if (kb > 0) {
      __syncthreads();  // every warp is done with b_s / x_s of key block kb - 1
      issue_keys(kb);
    }
    mma::cp_async_wait<0>();
    __syncthreads();
    mma::FragC sc[1][8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) sc[0][nt].zero();
    for (int n0 = 0; n0 < NP; n0 += kPiece)
      mma::warp_gemm<T, 1, 8, kPiece / 16, /*A_ROW=*/true, /*B_KN=*/false>(sc, c_s + warp * 16 * ldc + n0, ldc, b_s + n0, ldc);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + warp * 16 + mma::c_row(lane, e);
        const int j = j0 + nt * 8 + mma::c_col(lane, e);
        sc[0][nt].x[e] = j <= i ? sc[0][nt].x[e] * expf(fminf(lam_s[i] - lam_s[j], 0.f)) * dt_s[j] : 0.f;
      }
#pragma unroll
    for (int kt = 0; kt < kRows / 16; ++kt) {
      const mma::FragA a = mma::c_to_a<T>(sc[0][2 * kt], sc[0][2 * kt + 1]);
#pragma unroll
      for (int np = 0; np < NTP / 2; ++np) {
        mma::FragB b0, b1;
        mma::load_b_kn(b0, b1, x_s + kt * 16 * kLdX + np * 16, kLdX);
        mma::mma<T>(acc[0][2 * np], a, b0);
        mma::mma<T>(acc[0][2 * np + 1], a, b1);
      }
    }
  }

  // 3. stage the fp32 accumulators (over the dead C / state region), then 8 columns per thread:
  // D x (x_s holds the tile's own rows: the last key block is kb = mtile, j0 = i0), the z gate,
  // 16-byte stores at the tokens' rows
  __syncthreads();  // every warp is done reading c_s / st_s
#pragma unroll
  for (int nt = 0; nt < NTP; ++nt)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = warp * 16 + mma::c_row(lane, 2 * half);
      const int col = nt * 8 + mma::c_col(lane, 2 * half);
      *reinterpret_cast<float2*>(stage + r * kLdStage + col) = make_float2(acc[0][nt].x[2 * half], acc[0][nt].x[2 * half + 1]);
    }
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  T* y = static_cast<T*>(p.y);
  const int PV = static_cast<int>(P / 8);
  for (int v = tid; v < kRows * PV; v += kThreads) {
    const int r = v / PV, col = (v % PV) * 8;
    const int64_t tok = tok_s[r];
    if (tok < 0) continue;
    const int64_t idx = (tok * H + h) * P + col;
    float f[8];
    {
      const float4 a0 = *reinterpret_cast<const float4*>(stage + r * kLdStage + col);
      const float4 a1 = *reinterpret_cast<const float4*>(stage + r * kLdStage + col + 4);
      f[0] = a0.x, f[1] = a0.y, f[2] = a0.z, f[3] = a0.w, f[4] = a1.x, f[5] = a1.y, f[6] = a1.z, f[7] = a1.w;
    }
    if (p.D) {
      float xv[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(x_s + r * kLdX + col), xv);
      const float* Dh = p.D + h * P + col;
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
        unpack8<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.z) + idx), zv);
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] *= silu(zv[k]);
    }
    *reinterpret_cast<uint4*>(out + idx) = pack8<T>(f);
  }
}

template <typename T, int L, int PT>
int launch_v2(const FwdParams& p, cudaStream_t stream) {
  const SmemV2 lay = smem_layout_v2(p.state_dim, PT, L);
  auto kernel = chunk_scan_kernel_v2<T, L, PT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(lay.bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  const int64_t blocks = p.num_chunks * (L / kRows) * p.heads;
  kernel<<<dim3(static_cast<unsigned>(blocks)), kThreads, lay.bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, int L>
int by_p_v2(const FwdParams& p, cudaStream_t s) {
  if (p.head_dim <= 32) return launch_v2<T, L, 32>(p, s);
  if (p.head_dim <= 64) return launch_v2<T, L, 64>(p, s);
  return launch_v2<T, L, 128>(p, s);
}

template <typename T>
int by_l_v2(const FwdParams& p, cudaStream_t s) {
  if (p.chunk == 64) return by_p_v2<T, 64>(p, s);
  if (p.chunk == 128) return by_p_v2<T, 128>(p, s);
  return by_p_v2<T, 256>(p, s);
}

int padded_p(int64_t P) { return P <= 32 ? 32 : P <= 64 ? 64 : 128; }

}  // namespace

int ssd_chunk_scan_fwd(const FwdParams& p, void* stream) {
  if (!fwd_shape_supported(p.chunk, p.head_dim, p.state_dim)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return p.in == InType::BFloat16 ? by_l<__nv_bfloat16>(p, s) : by_l<__half>(p, s);
}

}  // namespace tree_recurrence::ssd::fused::kernels

namespace tree_recurrence::ssd::fused::kernels {

bool ssd_chunk_scan_v2_supported(const FwdParams& p) {
  if (!fwd_shape_supported(p.chunk, p.head_dim, p.state_dim) || p.groups <= 0 || p.heads % p.groups != 0) return false;
  if (smem_layout_v2(p.state_dim, padded_p(p.head_dim), static_cast<int>(p.chunk)).bytes > kV2MaxSmem) return false;
  const int64_t blocks = p.num_chunks * (p.chunk / kRows) * p.heads;
  if (blocks > 2147483647LL) return false;
  // 16-byte vector access of out / y / z / x rows (P % 8 == 0 by fwd_shape_supported)
  const void* ptrs[4] = {p.out, p.y, p.z, p.x};
  for (const void* q : ptrs)
    if (q && reinterpret_cast<uintptr_t>(q) % 16 != 0) return false;
  return true;
}

int ssd_chunk_scan_fwd_v2(const FwdParams& p, void* stream) {
  if (!ssd_chunk_scan_v2_supported(p)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return p.in == InType::BFloat16 ? by_l_v2<__nv_bfloat16>(p, s) : by_l_v2<__half>(p, s);
}

}  // namespace tree_recurrence::ssd::fused::kernels
