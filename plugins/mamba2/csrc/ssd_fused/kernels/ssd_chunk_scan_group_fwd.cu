// Fused SSD forward, stage d for chunk 64 with C B^T shared per group (params.h, ssd_fused.h):
//   y_i = exp(Lam_i) C_i s[c]^T + sum_{j <= i} <C_i, B_j> exp(Lam_i - Lam_j) dt_j x_j + D x_i
//   out_i = y_i * silu(z_i) (z given; y saved pre-gate), else y_i; written at the tokens' rows.
// The per-head kernel (ssd_chunk_scan_fwd.cu) computes C B^T once per head; here a block owns one
// (chunk, group): it computes the chunk's 64 x 64 scores C B^T once (kept in the MMA accumulators,
// fp32) and loops over the group's H / G heads, with the next head's state s[c] (P x N), x rows, Lam
// and dt copied by cp.async into the other half of a double buffer while the current head computes.
// Same arithmetic per head as the per-head kernel (C s^T in 64-column pieces, then the masked,
// decayed scores rounded to the in-type as the next MMA's A operand), so results are bitwise equal.
// Grid (NC, G); 128 threads, warp w rows [16 w, 16 w + 16), every P column (PT = P padded to 32 / 64
// / 128). Only chunk 64 (one row tile, one key block); the launcher returns cudaErrorInvalidValue
// for other chunks.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {
namespace mma = tree_recurrence::kernels::mma;

constexpr int kThreads = 128;
constexpr int kL = 64;      // the chunk (rows i and keys j)
constexpr int kPiece = 64;  // N columns per C s^T step

__host__ __device__ constexpr int64_t round64(int64_t n) { return (n + 63) / 64 * 64; }

struct GroupSmem {
  int64_t ldc, c_elems, sb_elems, x_elems;
  size_t bytes;
};
// c_s (kL x ldc) | sb[2] (max(PT, kL) x ldc: the states; sb[1] first holds B) | x_s[2] (kL x PT + 8)
// | lam[2][kL] | dt[2][kL] (fp32) | tok[kL] (int64)
__host__ __device__ inline GroupSmem group_layout(int64_t N, int PT) {
  GroupSmem m;
  m.ldc = round64(N) + 8;
  m.c_elems = kL * m.ldc;
  m.sb_elems = int64_t(PT > kL ? PT : kL) * m.ldc;
  m.x_elems = int64_t(kL) * (PT + 8);
  m.bytes = size_t(m.c_elems + 2 * m.sb_elems + 2 * m.x_elems) * 2 + size_t(4 * kL) * sizeof(float) +
            kL * sizeof(int64_t);
  return m;
}

__device__ __forceinline__ float silu(float v) {
  const float e = expf(-fabsf(v));
  return v >= 0.f ? v / (1.f + e) : v * e / (1.f + e);
}

template <typename T>
__device__ __forceinline__ float2 load2(const T* p) {
  return make_float2(mma::Elem<T>::to_float(p[0]), mma::Elem<T>::to_float(p[1]));
}

template <typename T, int PT>
__device__ __forceinline__ void chunk_scan_group_body(const FwdParams& p) {
  constexpr int NTP = PT / 8;
  constexpr int kLdX = PT + 8;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const int64_t hpg = H / G;
  const GroupSmem lay = group_layout(N, PT);
  const int ldc = static_cast<int>(lay.ldc);
  const int NP = ldc - 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* c_s = reinterpret_cast<T*>(smem);
  T* sb = c_s + lay.c_elems;              // 2 x sb_elems
  T* x_s = sb + 2 * lay.sb_elems;         // 2 x x_elems
  float* lam_s = reinterpret_cast<float*>(x_s + 2 * lay.x_elems);  // 2 x kL
  float* dt_s = lam_s + 2 * kL;                                     // 2 x kL
  int64_t* tok_s = reinterpret_cast<int64_t*>(dt_s + 2 * kL);       // kL

  const int64_t c = blockIdx.x, g = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t* gather = p.gather + c * kL;
  if (gather[0] < 0) return;  // an all-padding chunk (uniform over the block)
  for (int r = tid; r < kL; r += kThreads) tok_s[r] = gather[r];
  __syncthreads();

  const T* Cm = static_cast<const T*>(p.C);
  const T* Bm = static_cast<const T*>(p.B);
  const T* x = static_cast<const T*>(p.x);
  const T* states = static_cast<const T*>(p.states);
  const int CV = NP / 8;
  // group 1: C and B rows of the chunk (B into sb[1])
  for (int v = tid; v < kL * CV; v += kThreads) {
    const int r = v / CV, col = (v % CV) * 8;
    const int64_t tok = tok_s[r];
    const bool ok = tok >= 0 && col < N;
    mma::cp_async_16(c_s + r * ldc + col, ok ? Cm + (tok * G + g) * N + col : Cm, ok ? 16 : 0);
    mma::cp_async_16(sb + lay.sb_elems + r * ldc + col, ok ? Bm + (tok * G + g) * N + col : Bm, ok ? 16 : 0);
  }
  mma::cp_async_commit();

  // one head's operands into buffer b: Lam, dt (fp32), the state s[c] (P x N), x rows
  auto issue_head = [&](int64_t h, int b) {
    const int64_t row0 = (c * H + h) * kL;
    for (int v = tid; v < 2 * (kL / 4); v += kThreads) {
      const int which = v / (kL / 4), k = (v % (kL / 4)) * 4;
      const float* src = (which == 0 ? p.Lam : p.dt) + row0 + k;
      mma::cp_async_16((which == 0 ? lam_s : dt_s) + b * kL + k, src, 16);
    }
    const T* st = states + (c * H + h) * P * N;
    T* sdst = sb + b * lay.sb_elems;
    for (int v = tid; v < PT * CV; v += kThreads) {
      const int r = v / CV, col = (v % CV) * 8;
      const bool ok = r < P && col < N;
      mma::cp_async_16(sdst + r * ldc + col, ok ? st + int64_t(r) * N + col : st, ok ? 16 : 0);
    }
    constexpr int XV = PT / 8;
    T* xdst = x_s + b * lay.x_elems;
    for (int v = tid; v < kL * XV; v += kThreads) {
      const int r = v / XV, col = (v % XV) * 8;
      const int64_t tok = tok_s[r];
      const bool ok = tok >= 0 && col < P;
      mma::cp_async_16(xdst + r * kLdX + col, ok ? x + (tok * H + h) * P + col : x, ok ? 16 : 0);
    }
    mma::cp_async_commit();
  };
  issue_head(g * hpg, 0);  // group 2

  // scores C B^T (fp32, this warp's 16 rows x 64 keys), once for the group's heads
  mma::cp_async_wait<1>();
  __syncthreads();
  mma::FragC cb[1][8];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) cb[0][nt].zero();
  for (int n0 = 0; n0 < NP; n0 += kPiece)
    mma::warp_gemm<T, 1, 8, kPiece / 16, /*A_ROW=*/true, /*B_KN=*/false>(cb, c_s + warp * 16 * ldc + n0, ldc,
                                                                          sb + lay.sb_elems + n0, ldc);
  __syncthreads();  // sb[1] (B) is free for the heads

  T* out = static_cast<T*>(p.out);
  T* y = static_cast<T*>(p.y);
  const int ri0 = warp * 16 + mma::c_row(lane, 0), ri1 = warp * 16 + mma::c_row(lane, 2);
  for (int64_t k = 0; k < hpg; ++k) {
    const int b = static_cast<int>(k & 1);
    const int64_t h = g * hpg + k;
    if (k + 1 < hpg) {
      issue_head(h + 1, b ^ 1);
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    const float* lam = lam_s + b * kL;
    const float* dtv = dt_s + b * kL;
    const T* sbuf = sb + b * lay.sb_elems;
    const T* xbuf = x_s + b * lay.x_elems;

    // 1. C s^T, rows scaled by exp(Lam_i)
    mma::FragC acc[1][NTP];
#pragma unroll
    for (int nt = 0; nt < NTP; ++nt) acc[0][nt].zero();
    for (int n0 = 0; n0 < NP; n0 += kPiece)
      mma::warp_gemm<T, 1, NTP, kPiece / 16, /*A_ROW=*/true, /*B_KN=*/false>(acc, c_s + warp * 16 * ldc + n0, ldc,
                                                                             sbuf + n0, ldc);
    {
      const float f0 = expf(fminf(lam[ri0], 0.f));
      const float f1 = expf(fminf(lam[ri1], 0.f));
#pragma unroll
      for (int nt = 0; nt < NTP; ++nt) {
        acc[0][nt].x[0] *= f0, acc[0][nt].x[1] *= f0;
        acc[0][nt].x[2] *= f1, acc[0][nt].x[3] *= f1;
      }
    }

    // 2. the chunk's own tokens: masked, decayed scores times x
#pragma unroll
    for (int kt = 0; kt < kL / 16; ++kt) {
      mma::FragC s2[2];
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int nt = 2 * kt + half;
          const int i = warp * 16 + mma::c_row(lane, e);
          const int j = nt * 8 + mma::c_col(lane, e);
          s2[half].x[e] = j <= i ? cb[0][nt].x[e] * expf(fminf(lam[i] - lam[j], 0.f)) * dtv[j] : 0.f;
        }
      const mma::FragA a = mma::c_to_a<T>(s2[0], s2[1]);
#pragma unroll
      for (int np = 0; np < NTP / 2; ++np) {
        mma::FragB b0, b1;
        mma::load_b_kn(b0, b1, xbuf + kt * 16 * kLdX + np * 16, kLdX);
        mma::mma<T>(acc[0][2 * np], a, b0);
        mma::mma<T>(acc[0][2 * np + 1], a, b1);
      }
    }

    // 3. D x, the z gate, stores at the tokens' rows
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half ? ri1 : ri0;
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
    __syncthreads();  // buffer b is refilled by the next iteration's issue (head k + 2)
  }
}

// P <= 64: ptxas's own choice (no spills, <= 170 registers: 3 blocks per SM); P 128: up to 255
// registers (the 64-column accumulators and the scores; 1 block per SM by the bound).
template <typename T, int PT>
__global__ void __launch_bounds__(kThreads) chunk_scan_group_kernel(FwdParams p) {
  chunk_scan_group_body<T, PT>(p);
}
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) chunk_scan_group_kernel_wide(FwdParams p) {
  chunk_scan_group_body<T, 128>(p);
}

template <typename T, int PT>
int launch(const FwdParams& p, cudaStream_t stream) {
  const GroupSmem lay = group_layout(p.state_dim, PT);
  void (*kernel)(FwdParams) = nullptr;
  if constexpr (PT > 64)
    kernel = chunk_scan_group_kernel_wide<T>;
  else
    kernel = chunk_scan_group_kernel<T, PT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(lay.bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  const dim3 grid(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.groups));
  kernel<<<grid, kThreads, lay.bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int by_p(const FwdParams& p, cudaStream_t s) {
  if (p.head_dim <= 32) return launch<T, 32>(p, s);
  if (p.head_dim <= 64) return launch<T, 64>(p, s);
  return launch<T, 128>(p, s);
}

}  // namespace

bool ssd_chunk_scan_group_supported(const FwdParams& p) {
  return p.chunk == kL && fwd_shape_supported(p.chunk, p.head_dim, p.state_dim) && p.groups > 0 &&
         p.heads % p.groups == 0;
}

int ssd_chunk_scan_group_fwd(const FwdParams& p, void* stream) {
  if (!ssd_chunk_scan_group_supported(p)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return p.in == InType::BFloat16 ? by_p<__nv_bfloat16>(p, s) : by_p<__half>(p, s);
}

}  // namespace tree_recurrence::ssd::fused::kernels
