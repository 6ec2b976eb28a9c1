// Fused SSD forward, stages a + b + c for long segments (params.h, ssd_fused.h): the chunk states and
// the tree state pass in one pipelined kernel, chunk 64 only. It replaces, where the segments are long
// (not fused_passes_suit: one 49k-token row is 768 chunks in a row), the three-kernel path's chunk-state
// kernel (fp32 S_c to memory: 3.2 GB at GRPO) and elementwise state pass, with the same arithmetic:
//   chunk_dt_kernel, per (chunk, head): dt (bias, softplus, clamp; 0 on pad rows) and Lam (the
//     chunk-local cumsum of dt A) into p.dt / p.Lam, by tiles::block_cumsum at 128 threads, as
//     ssd_chunk_state_fwd.cu computes them (the same bits);
//   chunk_state_scan_kernel, per (segment of the level, head, 64 columns of N), the segment's chunks
//     in order: states[c] = s (rounded to the in-type), S_c = X^T (w B) from zero on tensor cores
//     (w_j = exp(min(Lam_last - Lam_j, 0)) dt_j, w B rounded to the in-type: ssd_chunk_state_fwd.cu's
//     warp_gemm on the same tiles), s = fmaf(exp(min(Lam_last, 0)), s, S_c) elementwise
//     (ssd_state_pass_fwd.cu's update). So states, dt, Lam and the workspace are bitwise those of the
//     three-kernel path (test_ssd_fused_gpu.py: test_pipelined_pass_bitwise*).
// S_c does not depend on s: only the fmaf chain is sequential. Chunk c + 2's token rows, x, B, dt and
// Lam rows are issued (cp.async, a ring of 3 stages) while chunk c computes, so a step waits on no
// load: per step two CTA barriers (A: chunk c landed, B: w B scaled in place), one 64 x 64 x 64 product
// per CTA and the state update in registers. 128 threads; warp w owns N columns [16 w, 16 w + 16) of
// the block's tile and every P row (PT = P padded to 32 / 64 / 128), as the chunk-state kernel.
// A segment starts from its parent's final state (fp32 workspace (S, H, P, N)), a root's initial
// state (shared or per root) or zeros; a segment with children writes its final state to the
// workspace. One launch per trie level (host loop over level_offsets). Deterministic, no atomics.
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
constexpr int kL = 64;            // chunk rows (this kernel: chunk 64 only)
constexpr int kCols = 64;         // N columns per block
constexpr int kLdB = kCols + 8;   // pitch of the staged B rows
constexpr int kStages = 3;        // chunks in flight: c (computing), c + 1, c + 2 (landing)

// One stage: x (kL x PT + 8), B (kL x kLdB), Lam and dt rows (kL floats each), the token rows (kL).
template <int PT>
struct Stage {
  static constexpr size_t x_elems = size_t(kL) * (PT + 8);
  static constexpr size_t b_elems = size_t(kL) * kLdB;
  static constexpr size_t bytes = (x_elems + b_elems) * 2 + 2 * kL * sizeof(float) + kL * sizeof(int64_t);
};

template <int PT>
constexpr size_t scan_smem_bytes() {
  return kStages * Stage<PT>::bytes;
}

// dt and Lam of chunk c, head h (blockIdx.x = c, blockIdx.y = h): ssd_chunk_state_fwd.cu's first half.
__global__ void __launch_bounds__(kThreads) chunk_dt_kernel(FwdParams p) {
  __shared__ float w_s[kL], lam_s[kL], tot_s[4];
  const int64_t c = blockIdx.x, h = blockIdx.y, H = p.heads;
  const int tid = threadIdx.x;
  const float bias = p.dt_bias ? p.dt_bias[h] : 0.f;
  for (int j = tid; j < kL; j += kThreads) {
    const int64_t tok = p.gather[c * kL + j];
    w_s[j] = tok >= 0 ? tiles::prep_dt(p, p.dt_raw[tok * H + h], bias) : 0.f;
  }
  __syncthreads();
  tiles::block_cumsum<kL, kThreads>(w_s, lam_s, tot_s, p.A[h], tid);
  __syncthreads();
  const int64_t row0 = (c * H + h) * kL;
  for (int j = tid; j < kL; j += kThreads) {
    p.dt[row0 + j] = w_s[j];
    p.Lam[row0 + j] = lam_s[j];
  }
}

template <typename T, int PT>
struct StagePtrs {
  T* x;
  T* b;
  float* lam;
  float* dt;
  int64_t* tok;
  __device__ __forceinline__ StagePtrs(unsigned char* smem, int i) {
    unsigned char* base = smem + size_t(i) * Stage<PT>::bytes;
    x = reinterpret_cast<T*>(base);
    b = x + Stage<PT>::x_elems;
    lam = reinterpret_cast<float*>(b + Stage<PT>::b_elems);
    dt = lam + kL;
    tok = reinterpret_cast<int64_t*>(dt + kL);
  }
};

template <typename T, int PT>
__global__ void __launch_bounds__(kThreads) chunk_state_scan_kernel(FwdParams p, int64_t level_begin) {
  constexpr int MT = PT / 16;
  constexpr int kLdX = PT + 8;
  extern __shared__ __align__(16) unsigned char smem[];

  const int64_t s = p.level_segments[level_begin + blockIdx.x];
  const int64_t h = blockIdx.y;
  const int64_t n0 = int64_t(blockIdx.z) * kCols;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups, PN = P * N;
  const int64_t g = h / (H / G);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const T* x = static_cast<const T*>(p.x);
  const T* Bm = static_cast<const T*>(p.B);
  T* states = static_cast<T*>(p.states);

  // the entering state, in the accumulator layout
  const float* init = nullptr;
  const int64_t parent = p.parents[s];
  if (parent >= 0)
    init = p.workspace + (parent * H + h) * PN;
  else if (p.initial_state)
    init = p.initial_state + ((p.initial_per_root ? p.root_index[s] : 0) * H + h) * PN;
  mma::FragC st[MT][2];
  tiles::state_pairs<MT>(st, P, N, n0, warp, lane, [&](float* v, int64_t row, int64_t col, bool inside) {
    float2 i2 = make_float2(0.f, 0.f);
    if (init && inside) i2 = *reinterpret_cast<const float2*>(init + row * N + col);
    v[0] = i2.x, v[1] = i2.y;
  });

  const int64_t c_begin = p.seg_chunk_offsets[s], c_end = p.seg_chunk_offsets[s + 1];
  // Issues chunk c's x, B, Lam and dt rows into stage sp (its token rows already in sp.tok, visible to
  // every thread) as one cp.async group; an empty group past the segment's end (uniform counting).
  auto issue = [&](int64_t c, const StagePtrs<T, PT>& sp) {
    if (c < c_end) {
      tiles::rows_async<kThreads>(sp.x, kLdX, x + h * P, H * P, sp.tok, kL, PT / 8, P, tid);
      tiles::rows_async<kThreads>(sp.b, kLdB, Bm + g * N + n0, G * N, sp.tok, kL, kCols / 8, N - n0, tid);
      const int64_t row0 = (c * H + h) * kL;
      if (tid < kL / 4) mma::cp_async_16(sp.lam + 4 * tid, p.Lam + row0 + 4 * tid, 16);
      else if (tid < kL / 2) mma::cp_async_16(sp.dt + 4 * (tid - kL / 4), p.dt + row0 + 4 * (tid - kL / 4), 16);
    }
    mma::cp_async_commit();
  };
  // prologue: the token rows of the first two chunks, then their loads
  for (int k = 0; k < 2; ++k) {
    const int64_t c = c_begin + k;
    if (c < c_end && tid < kL) StagePtrs<T, PT>(smem, k).tok[tid] = p.gather[c * kL + tid];
  }
  __syncthreads();
  for (int k = 0; k < 2; ++k) issue(c_begin + k, StagePtrs<T, PT>(smem, k));

  int cur = 0;  // stage of chunk c
  for (int64_t c = c_begin; c < c_end; ++c) {
    const StagePtrs<T, PT> sc(smem, cur);
    const int ahead = cur == 0 ? 2 : cur - 1;  // stage of chunk c + 2 (= that of chunk c - 1, free)
    const StagePtrs<T, PT> sa(smem, ahead);
    const bool has_ahead = c + 2 < c_end;
    int64_t tok_ahead = -1;
    if (has_ahead && tid < kL) tok_ahead = p.gather[(c + 2) * kL + tid];  // lands while chunk c's loads are waited on

    // states[c] = s, the state entering the chunk
    {
      T* out = states + (c * H + h) * PN;
      tiles::state_pairs<MT>(st, P, N, n0, warp, lane, [&](const float* v, int64_t row, int64_t col, bool inside) {
        if (inside) *reinterpret_cast<uint32_t*>(out + row * N + col) = mma::Elem<T>::pack(v[0], v[1]);
      });
    }
    mma::cp_async_wait<1>();  // chunk c's group landed (c + 1's may still fly)
    // stage `ahead` (chunk c - 1's): its token rows were last read before barrier B of step c - 1,
    // its x, B, Lam, dt rows are overwritten only after barrier A below (every thread is past step
    // c - 1's product then)
    if (has_ahead && tid < kL) sa.tok[tid] = tok_ahead;
    // A: chunk c's x, B, Lam, dt visible to all; chunk c + 2's token rows visible
    __syncthreads();
    issue(c + 2, sa);  // (an empty group when c + 2 is past the end)
    const bool any_rows = sc.tok[0] >= 0;  // read before barrier B (the stage's token rows are rewritten after it)

    // w B in place: row r times w_r = exp(min(Lam_last - Lam_r, 0)) dt_r (tiles::chunk_weights' value)
    const float lam_last = sc.lam[kL - 1];
    for (int v = tid; v < kL * (kCols / 8); v += kThreads) {
      const int r = v / (kCols / 8), col = (v % (kCols / 8)) * 8;
      const float w = expf(fminf(lam_last - sc.lam[r], 0.f)) * sc.dt[r];
      uint4* q = reinterpret_cast<uint4*>(sc.b + r * kLdB + col);
      *q = tiles::scale8<T>(*q, w);
    }
    __syncthreads();  // B: w B complete

    mma::FragC acc[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc[mt][0].zero(), acc[mt][1].zero();
    if (any_rows)  // an all-padding chunk (none in a plan's tables) adds nothing, as in the chunk-state kernel
      mma::warp_gemm<T, MT, 2, kL / 16, /*A_ROW=*/false, /*B_KN=*/true>(acc, sc.x, kLdX, sc.b + warp * 16, kLdB);
    const float decay = expf(fminf(lam_last, 0.f));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[mt][nt].x[e] = fmaf(decay, st[mt][nt].x[e], acc[mt][nt].x[e]);
    cur = cur == 2 ? 0 : cur + 1;
  }
  mma::cp_async_wait<0>();

  if (p.child_offsets[s + 1] > p.child_offsets[s]) {
    float* ws = p.workspace + (s * H + h) * PN;
    tiles::state_pairs<MT>(st, P, N, n0, warp, lane, [&](const float* v, int64_t row, int64_t col, bool inside) {
      if (inside) *reinterpret_cast<float2*>(ws + row * N + col) = make_float2(v[0], v[1]);
    });
  }
}

template <typename T, int PT>
int launch_levels(const FwdParams& p, cudaStream_t stream) {
  const dim3 dt_grid(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.heads));
  chunk_dt_kernel<<<dt_grid, kThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return static_cast<int>(err);
  const size_t bytes = scan_smem_bytes<PT>();
  err = cudaFuncSetAttribute(chunk_state_scan_kernel<T, PT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  const unsigned zblocks = static_cast<unsigned>((p.state_dim + kCols - 1) / kCols);
  for (int64_t level = 0; level < p.num_levels; ++level) {
    const int64_t begin = p.level_offsets[level], count = p.level_offsets[level + 1] - begin;
    if (count <= 0) continue;
    const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(p.heads), zblocks);
    chunk_state_scan_kernel<T, PT><<<grid, kThreads, bytes, stream>>>(p, begin);
    err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return 0;
}

}  // namespace

bool ssd_chunk_state_scan_supported(const FwdParams& p) {
  return p.chunk == kL && fwd_shape_supported(p.chunk, p.head_dim, p.state_dim) && p.groups > 0 &&
         p.heads % p.groups == 0 && p.num_chunks <= 2147483647LL && p.heads <= 65535 &&
         reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && reinterpret_cast<uintptr_t>(p.B) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(p.dt) % 16 == 0 && reinterpret_cast<uintptr_t>(p.Lam) % 16 == 0;
}

int ssd_chunk_state_scan_fwd(const FwdParams& p, void* stream) {
  if (!ssd_chunk_state_scan_supported(p)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return tiles::dispatch(p, [&](auto t, auto l, auto pt) {
    (void)l;  // chunk 64 (checked above)
    return launch_levels<typename decltype(t)::type, decltype(pt)::value>(p, s);
  });
}

}  // namespace tree_recurrence::ssd::fused::kernels
