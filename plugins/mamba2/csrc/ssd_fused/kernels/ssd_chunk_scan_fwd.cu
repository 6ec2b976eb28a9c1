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

}  // namespace

int ssd_chunk_scan_fwd(const FwdParams& p, void* stream) {
  if (!fwd_shape_supported(p.chunk, p.head_dim, p.state_dim)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return p.in == InType::BFloat16 ? by_l<__nv_bfloat16>(p, s) : by_l<__half>(p, s);
}

}  // namespace tree_recurrence::ssd::fused::kernels
