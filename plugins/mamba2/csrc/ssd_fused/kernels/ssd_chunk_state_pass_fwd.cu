// Fused SSD forward, stages a + b + c in one kernel (params.h, ssd_fused.h): the chunk states and
// the tree state pass together, so the fp32 chunk states S_c never go to memory.
//   per chunk c of a segment, in order: dt (bias, softplus, clamp; 0 on pad rows), Lam (chunk-local
//   cumsum of dt A), states[c] = s (the state entering c, stored in the in-type), then
//   s = exp(Lam_last) s + X^T (w B) with w_j = exp(Lam_last - Lam_j) dt_j, where the product
//   accumulates on tensor cores straight into the running fp32 state s (held in the MMA
//   accumulators; w B rounded to the in-type like mamba-ssm and like ssd_chunk_state_fwd.cu).
// A segment starts from its parent's final state (fp32 workspace (S, H, P, N), written by the
// previous level's launch), a root's initial state (shared or per root) or zeros; a segment with
// children writes its final state to the workspace.
//
// One launch per trie level (host loop over level_offsets); grid (segments of the level, H,
// ceil(N / 64)), 128 threads; warp w owns N columns [16 w, 16 w + 16) of the block's 64-column
// tile and every P row (PT = P padded to 32 / 64 / 128). Pipelining across chunks: the next
// chunk's gather rows are loaded into registers at a step's start and its raw dt after the cumsum;
// the next chunk's first 64-row piece of x and of raw B is copied by cp.async while the step ends
// and the next step's dt / cumsum run; B is scaled by w in shared memory once w is known. Further
// pieces (L 128 / 256) are loaded in the step. Deterministic (fixed order), no atomics.
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
constexpr int kLdB = kPiece + 8;   // pitch of the staged B piece

template <int L>
constexpr size_t pass_smem_bytes(int PT) {
  return size_t(kPiece) * (PT + 8) * 2 + size_t(kPiece) * kLdB * 2 + 2 * L * sizeof(float) + 4 * sizeof(float) +
         2 * L * sizeof(int64_t);
}

template <typename T, int PT>
__device__ __forceinline__ void issue_piece(T* x_s, T* b_s, const int64_t* tok, const T* x, const T* Bm, int64_t H,
                                            int64_t h, int64_t P, int64_t G, int64_t g, int64_t N, int64_t n0, int tid) {
  tiles::rows_async<kThreads>(x_s, PT + 8, x + h * P, H * P, tok, kPiece, PT / 8, P, tid);
  tiles::rows_async<kThreads>(b_s, kLdB, Bm + g * N + n0, G * N, tok, kPiece, kPiece / 8, N - n0, tid);
  mma::cp_async_commit();
}

// b_s rows r scaled by w[r] (in place, rounded to the in-type).
template <typename T>
__device__ __forceinline__ void scale_piece(T* b_s, const float* w, int tid) {
  for (int v = tid; v < kPiece * (kPiece / 8); v += kThreads) {
    const int r = v / (kPiece / 8), col = (v % (kPiece / 8)) * 8;
    uint4* q = reinterpret_cast<uint4*>(b_s + r * kLdB + col);
    const uint4 packed = tiles::scale8<T>(*q, w[r]);
    *q = packed;
  }
}

template <typename T, int L, int PT>
__global__ void __launch_bounds__(kThreads) chunk_state_pass_kernel(FwdParams p, int64_t level_begin) {
  constexpr int MT = PT / 16;
  constexpr int kLdX = PT + 8;
  constexpr int E = (L + kThreads - 1) / kThreads;  // rows per thread (dt, Lam)
  extern __shared__ __align__(16) unsigned char smem[];
  T* x_s = reinterpret_cast<T*>(smem);                             // kPiece x kLdX: x(j, p)
  T* b_s = x_s + kPiece * kLdX;                                    // kPiece x kLdB: B(j, n), then w_j B(j, n)
  float* lam_s = reinterpret_cast<float*>(b_s + kPiece * kLdB);    // L
  float* w_s = lam_s + L;                                          // L: dt, then w
  float* tot_s = w_s + L;                                          // 4 warp totals
  int64_t* tok_buf = reinterpret_cast<int64_t*>(tot_s + 4);        // 2 x L (this chunk's, the next one's)

  const int64_t s = p.level_segments[level_begin + blockIdx.x];
  const int64_t h = blockIdx.y;
  const int64_t n0 = int64_t(blockIdx.z) * kPiece;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups, PN = P * N;
  const int64_t g = h / (H / G);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const T* x = static_cast<const T*>(p.x);
  const T* Bm = static_cast<const T*>(p.B);
  T* states = static_cast<T*>(p.states);
  const float a = p.A[h];
  const float bias = p.dt_bias ? p.dt_bias[h] : 0.f;

  // the entering state, in the accumulator layout: acc[mt][nt].x[e] = s(row, col)
  const float* init = nullptr;
  const int64_t parent = p.parents[s];
  if (parent >= 0)
    init = p.workspace + (parent * H + h) * PN;
  else if (p.initial_state)
    init = p.initial_state + ((p.initial_per_root ? p.root_index[s] : 0) * H + h) * PN;
  mma::FragC acc[MT][2];
  tiles::state_pairs<MT>(acc, P, N, n0, warp, lane, [&](float* v, int64_t row, int64_t col, bool inside) {
    float2 i2 = make_float2(0.f, 0.f);
    if (init && inside) i2 = *reinterpret_cast<const float2*>(init + row * N + col);
    v[0] = i2.x, v[1] = i2.y;
  });

  const int64_t c_begin = p.seg_chunk_offsets[s], c_end = p.seg_chunk_offsets[s + 1];
  // prologue: chunk c_begin's gather rows, raw dt and first piece
  int64_t tok_r[E];
  float raw_r[E];
  if (c_begin < c_end) {
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = tid + k * kThreads;
      tok_r[k] = j < L ? p.gather[c_begin * L + j] : -1;
      if (j < L) tok_buf[j] = tok_r[k];
      raw_r[k] = tok_r[k] >= 0 ? p.dt_raw[tok_r[k] * H + h] : 0.f;
    }
    __syncthreads();
    issue_piece<T, PT>(x_s, b_s, tok_buf, x, Bm, H, h, P, G, g, N, n0, tid);
  }

  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t* tok_s = tok_buf + ((c - c_begin) & 1) * L;
    int64_t* tok_next = tok_buf + (((c - c_begin) & 1) ^ 1) * L;
    const bool has_next = c + 1 < c_end;

    // dt of this chunk (from the prefetched raw values); the next chunk's gather rows in flight
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const int j = tid + k * kThreads;
      if (j < L) w_s[j] = tok_r[k] >= 0 ? tiles::prep_dt(p, raw_r[k], bias) : 0.f;
      tok_r[k] = has_next && j < L ? p.gather[(c + 1) * L + j] : -1;
    }

    // states[c] = s, the state entering the chunk
    {
      T* out = states + (c * H + h) * PN;
      tiles::state_pairs<MT>(acc, P, N, n0, warp, lane, [&](const float* v, int64_t row, int64_t col, bool inside) {
        if (inside) *reinterpret_cast<uint32_t*>(out + row * N + col) = mma::Elem<T>::pack(v[0], v[1]);
      });
    }
    __syncthreads();

    // Lam = inclusive cumsum of dt * A (tiles::block_cumsum: the same arithmetic as
    // ssd_chunk_state_fwd.cu, so both write identical dt / Lam)
    tiles::block_cumsum<L, kThreads>(w_s, lam_s, tot_s, a, tid);
    // the next chunk's raw dt (its gather rows have arrived by now)
#pragma unroll
    for (int k = 0; k < E; ++k) raw_r[k] = tok_r[k] >= 0 ? p.dt_raw[tok_r[k] * H + h] : 0.f;
    __syncthreads();

    const float lam_last = lam_s[L - 1];
    tiles::chunk_weights<L, kThreads>(p, (c * H + h) * L, blockIdx.z == 0, lam_s, w_s, tid);
    const float decay = expf(fminf(lam_last, 0.f));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt].x[e] *= decay;
    mma::cp_async_wait<0>();
    __syncthreads();

    for (int j0 = 0; j0 < L; j0 += kPiece) {
      if (tok_s[j0] < 0) break;  // the rest of the chunk is padding (uniform over the block)
      if (j0 > 0) {
        issue_piece<T, PT>(x_s, b_s, tok_s + j0, x, Bm, H, h, P, G, g, N, n0, tid);
        mma::cp_async_wait<0>();
        __syncthreads();
      }
      scale_piece<T>(b_s, w_s + j0, tid);
      __syncthreads();
      mma::warp_gemm<T, MT, 2, kPiece / 16, /*A_ROW=*/false, /*B_KN=*/true>(acc, x_s, kLdX, b_s + warp * 16, kLdB);
      __syncthreads();
    }

    // the next chunk's gather rows to shared memory, then its first piece in flight
    if (has_next) {
#pragma unroll
      for (int k = 0; k < E; ++k) {
        const int j = tid + k * kThreads;
        if (j < L) tok_next[j] = tok_r[k];
      }
      __syncthreads();
      issue_piece<T, PT>(x_s, b_s, tok_next, x, Bm, H, h, P, G, g, N, n0, tid);
    }
  }

  if (p.child_offsets[s + 1] > p.child_offsets[s]) {
    float* ws = p.workspace + (s * H + h) * PN;
    tiles::state_pairs<MT>(acc, P, N, n0, warp, lane, [&](const float* v, int64_t row, int64_t col, bool inside) {
      if (inside) *reinterpret_cast<float2*>(ws + row * N + col) = make_float2(v[0], v[1]);
    });
  }
}

template <typename T, int L, int PT>
int launch_levels(const FwdParams& p, cudaStream_t stream) {
  const size_t bytes = pass_smem_bytes<L>(PT);
  const unsigned zblocks = static_cast<unsigned>((p.state_dim + kPiece - 1) / kPiece);
  for (int64_t level = 0; level < p.num_levels; ++level) {
    const int64_t begin = p.level_offsets[level], count = p.level_offsets[level + 1] - begin;
    if (count <= 0) continue;
    const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(p.heads), zblocks);
    chunk_state_pass_kernel<T, L, PT><<<grid, kThreads, bytes, stream>>>(p, begin);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return 0;
}

}  // namespace

int ssd_chunk_state_pass_fwd(const FwdParams& p, void* stream) {
  if (!fwd_shape_supported(p.chunk, p.head_dim, p.state_dim)) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  return tiles::dispatch(p, [&](auto t, auto l, auto pt) {
    return launch_levels<typename decltype(t)::type, decltype(l)::value, decltype(pt)::value>(p, s);
  });
}

}  // namespace tree_recurrence::ssd::fused::kernels
