// Fused SSD forward, stages a + b (params.h, ssd_fused.h): per (chunk, head) the prepared dt
// (bias, softplus, clamp; 0 on pad rows), the chunk-local cumsum Lam of dt * A, and the chunk's own
// state S_c (P x N) = X^T (P x L) . (w B) (L x N) with w_j = exp(Lam_last - Lam_j) dt_j, on tensor
// cores (bf16 / fp16 operands, fp32 accumulation; w B rounded to the in-type like mamba-ssm).
//
// Grid (NC, H, ceil(N / 64)); 128 threads. Warp w owns N columns [16 w, 16 w + 16) of the block's
// 64-column tile and every P row (PT = P padded to 32 / 64 / 128). L is staged in pieces of 64
// rows (x by cp.async, w B scaled on the way); pieces past the chunk's last token are skipped (pad
// rows are at a chunk's end). Only the z == 0 blocks write dt and Lam. Deterministic, no atomics.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {
namespace mma = tree_recurrence::kernels::mma;

constexpr int kThreads = 128;
constexpr int kPiece = 64;         // rows of L per staged piece; N columns per block
constexpr int kLdB = kPiece + 8;   // pitch of the staged (w B) piece

__device__ __forceinline__ float softplus20(float v) {
  // torch's softplus with threshold 20, in a form that never exponentiates a positive number
  return v > 20.f ? v : fmaxf(v, 0.f) + log1pf(expf(-fabsf(v)));
}

template <int L>
constexpr size_t state_smem_bytes(int PT) {
  return size_t(kPiece) * (PT + 8) * 2 + size_t(kPiece) * kLdB * 2 + 2 * L * sizeof(float) + 4 * sizeof(float) +
         L * sizeof(int64_t);
}

template <typename T, int L, int PT>
__global__ void __launch_bounds__(kThreads) chunk_state_kernel(FwdParams p) {
  constexpr int MT = PT / 16;
  constexpr int kLdX = PT + 8;
  constexpr int E = (L + kThreads - 1) / kThreads;  // Lam elements per thread
  extern __shared__ __align__(16) unsigned char smem[];
  T* x_s = reinterpret_cast<T*>(smem);                             // kPiece x kLdX: x(j, p)
  T* b_s = x_s + kPiece * kLdX;                                    // kPiece x kLdB: w_j B(j, n)
  float* lam_s = reinterpret_cast<float*>(b_s + kPiece * kLdB);    // L
  float* w_s = lam_s + L;                                          // L: dt, then w
  float* tot_s = w_s + L;                                          // 4 warp totals
  int64_t* tok_s = reinterpret_cast<int64_t*>(tot_s + 4);          // L

  const int64_t c = blockIdx.x, h = blockIdx.y;
  const int64_t n0 = int64_t(blockIdx.z) * kPiece;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const int64_t g = h / (H / G);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

  for (int j = tid; j < L; j += kThreads) {
    const int64_t tok = p.gather[c * L + j];
    tok_s[j] = tok;
    float d = 0.f;
    if (tok >= 0) {
      d = p.dt_raw[tok * H + h];
      if (p.dt_bias) d += p.dt_bias[h];
      if (p.dt_softplus) d = softplus20(d);
      d = fminf(fmaxf(d, p.dt_min), p.dt_max);
    }
    w_s[j] = d;
  }
  __syncthreads();

  // Lam = inclusive cumsum of dt * A: E consecutive values per thread, then a block scan of the
  // thread totals (warp shuffles, then the warp totals in order). Fixed order: deterministic.
  const float a = p.A[h];
  float loc[E];
  float run = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int j = tid * E + e;
    if (j < L) run += w_s[j] * a;
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
  __syncthreads();

  const float lam_last = lam_s[L - 1];
  const int64_t row0 = (c * H + h) * L;
  for (int j = tid; j < L; j += kThreads) {
    const float d = w_s[j];
    if (blockIdx.z == 0) {
      p.dt[row0 + j] = d;
      p.Lam[row0 + j] = lam_s[j];
    }
    w_s[j] = expf(fminf(lam_last - lam_s[j], 0.f)) * d;
  }
  __syncthreads();

  mma::FragC acc[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0].zero(), acc[mt][1].zero();

  const T* x = static_cast<const T*>(p.x);
  const T* Bm = static_cast<const T*>(p.B);
  for (int j0 = 0; j0 < L; j0 += kPiece) {
    if (tok_s[j0] < 0) break;  // the rest of the chunk is padding (uniform over the block)
    constexpr int XV = PT / 8;
    for (int v = tid; v < kPiece * XV; v += kThreads) {
      const int r = v / XV, col = (v % XV) * 8;
      const int64_t tok = tok_s[j0 + r];
      const bool ok = tok >= 0 && col < P;
      mma::cp_async_16(x_s + r * kLdX + col, ok ? x + (tok * H + h) * P + col : x, ok ? 16 : 0);
    }
    mma::cp_async_commit();
    for (int v = tid; v < kPiece * (kPiece / 8); v += kThreads) {
      const int r = v / (kPiece / 8), col = (v % (kPiece / 8)) * 8;
      const int64_t tok = tok_s[j0 + r];
      uint4 packed = make_uint4(0u, 0u, 0u, 0u);
      if (tok >= 0 && n0 + col < N) {
        const uint4 raw = *reinterpret_cast<const uint4*>(Bm + (tok * G + g) * N + n0 + col);
        const T* e = reinterpret_cast<const T*>(&raw);
        const float wj = w_s[j0 + r];
        packed.x = mma::Elem<T>::pack(mma::Elem<T>::to_float(e[0]) * wj, mma::Elem<T>::to_float(e[1]) * wj);
        packed.y = mma::Elem<T>::pack(mma::Elem<T>::to_float(e[2]) * wj, mma::Elem<T>::to_float(e[3]) * wj);
        packed.z = mma::Elem<T>::pack(mma::Elem<T>::to_float(e[4]) * wj, mma::Elem<T>::to_float(e[5]) * wj);
        packed.w = mma::Elem<T>::pack(mma::Elem<T>::to_float(e[6]) * wj, mma::Elem<T>::to_float(e[7]) * wj);
      }
      *reinterpret_cast<uint4*>(b_s + r * kLdB + col) = packed;
    }
    mma::cp_async_wait<0>();
    __syncthreads();
    mma::warp_gemm<T, MT, 2, kPiece / 16, /*A_ROW=*/false, /*B_KN=*/true>(acc, x_s, kLdX, b_s + warp * 16, kLdB);
    __syncthreads();
  }

  float* out = p.chunk_states + (c * H + h) * P * N;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int64_t row = mt * 16 + mma::c_row(lane, e);
        const int64_t col = n0 + warp * 16 + nt * 8 + mma::c_col(lane, e);
        if (row < P && col < N)
          *reinterpret_cast<float2*>(out + row * N + col) = make_float2(acc[mt][nt].x[e], acc[mt][nt].x[e + 1]);
      }
}

template <typename T, int L, int PT>
int launch(const FwdParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>((p.state_dim + kPiece - 1) / kPiece));
  const size_t bytes = state_smem_bytes<L>(PT);
  chunk_state_kernel<T, L, PT><<<grid, kThreads, bytes, stream>>>(p);
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

const char* ssd_fwd_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

int ssd_chunk_state_fwd(const FwdParams& p, void* stream) {
  if (!fwd_shape_supported(p.chunk, p.head_dim, p.state_dim)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return p.in == InType::BFloat16 ? by_l<__nv_bfloat16>(p, s) : by_l<__half>(p, s);
}

}  // namespace tree_recurrence::ssd::fused::kernels
