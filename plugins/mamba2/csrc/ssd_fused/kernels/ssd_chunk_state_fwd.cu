// Fused SSD forward, stages a + b of the three-kernel path (params.h: FwdPlan; ssd_fused.h; the
// stages op runs it on every path for its chunk_states): per (chunk, head) the prepared dt
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

#include "fwd_tiles.cuh"
#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {
namespace mma = tree_recurrence::kernels::mma;

constexpr int kThreads = 128;
constexpr int kPiece = 64;         // rows of L per staged piece; N columns per block
constexpr int kLdB = kPiece + 8;   // pitch of the staged (w B) piece

template <int L>
constexpr size_t state_smem_bytes(int PT) {
  return size_t(kPiece) * (PT + 8) * 2 + size_t(kPiece) * kLdB * 2 + 2 * L * sizeof(float) + 4 * sizeof(float) +
         L * sizeof(int64_t);
}

template <typename T, int L, int PT>
__global__ void __launch_bounds__(kThreads) chunk_state_kernel(FwdParams p) {
  constexpr int MT = PT / 16;
  constexpr int kLdX = PT + 8;
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

  const float bias = p.dt_bias ? p.dt_bias[h] : 0.f;
  for (int j = tid; j < L; j += kThreads) {
    const int64_t tok = p.gather[c * L + j];
    tok_s[j] = tok;
    w_s[j] = tok >= 0 ? tiles::prep_dt(p, p.dt_raw[tok * H + h], bias) : 0.f;
  }
  __syncthreads();

  // Lam = inclusive cumsum of dt * A (tiles::block_cumsum), then w
  tiles::block_cumsum<L, kThreads>(w_s, lam_s, tot_s, p.A[h], tid);
  __syncthreads();
  tiles::chunk_weights<L, kThreads>(p, (c * H + h) * L, blockIdx.z == 0, lam_s, w_s, tid);
  __syncthreads();

  mma::FragC acc[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) acc[mt][0].zero(), acc[mt][1].zero();

  const T* x = static_cast<const T*>(p.x);
  const T* Bm = static_cast<const T*>(p.B);
  for (int j0 = 0; j0 < L; j0 += kPiece) {
    if (tok_s[j0] < 0) break;  // the rest of the chunk is padding (uniform over the block)
    tiles::rows_async<kThreads>(x_s, kLdX, x + h * P, H * P, tok_s + j0, kPiece, PT / 8, P, tid);
    mma::cp_async_commit();
    for (int v = tid; v < kPiece * (kPiece / 8); v += kThreads) {
      const int r = v / (kPiece / 8), col = (v % (kPiece / 8)) * 8;
      const int64_t tok = tok_s[j0 + r];
      uint4 packed = make_uint4(0u, 0u, 0u, 0u);
      if (tok >= 0 && n0 + col < N)
        packed = tiles::scale8<T>(*reinterpret_cast<const uint4*>(Bm + (tok * G + g) * N + n0 + col), w_s[j0 + r]);
      *reinterpret_cast<uint4*>(b_s + r * kLdB + col) = packed;
    }
    mma::cp_async_wait<0>();
    __syncthreads();
    mma::warp_gemm<T, MT, 2, kPiece / 16, /*A_ROW=*/false, /*B_KN=*/true>(acc, x_s, kLdX, b_s + warp * 16, kLdB);
    __syncthreads();
  }

  float* out = p.chunk_states + (c * H + h) * P * N;
  tiles::state_pairs<MT>(acc, P, N, n0, warp, lane, [&](const float* v, int64_t row, int64_t col, bool inside) {
    if (inside) *reinterpret_cast<float2*>(out + row * N + col) = make_float2(v[0], v[1]);
  });
}

template <typename T, int L, int PT>
int launch(const FwdParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.heads),
                  static_cast<unsigned>((p.state_dim + kPiece - 1) / kPiece));
  const size_t bytes = state_smem_bytes<L>(PT);
  chunk_state_kernel<T, L, PT><<<grid, kThreads, bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

const char* ssd_fwd_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

int ssd_chunk_state_fwd(const FwdParams& p, void* stream) {
  if (!fwd_shape_supported(p.chunk, p.head_dim, p.state_dim)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return tiles::dispatch(p, [&](auto t, auto l, auto pt) {
    return launch<typename decltype(t)::type, decltype(l)::value, decltype(pt)::value>(p, s);
  });
}

}  // namespace tree_recurrence::ssd::fused::kernels
