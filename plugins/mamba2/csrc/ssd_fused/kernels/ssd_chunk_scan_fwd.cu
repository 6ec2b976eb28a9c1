// Fused SSD forward, stage d (params.h, ssd_fused.h): the chunk scan per head, on tensor cores.
//   y_i = exp(Lam_i) C_i s[c]^T + sum_{j <= i} <C_i, B_j> exp(Lam_i - Lam_j) dt_j x_j + D x_i
//   out_i = y_i * silu(z_i) (z given; y saved pre-gate), else y_i; written at the tokens' rows.
// Every chunk (64 / 128 / 256) and every supported P / N: the plan (FwdPlan) runs it wherever the
// grouped scan (ssd_chunk_scan_group_fwd.cu, chunk 64, P <= 64; the same arithmetic, bitwise equal
// outputs) does not fit.
// A block owns 64 rows i of one (chunk, head) and every P column (PT = P padded to 32 / 64 / 128);
// 128 threads, warp w rows [16 w, 16 w + 16):
//  * 1-D grid with the head fastest: the H / G heads of one (chunk, row tile) run next to each other,
//    so C and B rows (per group) are read from DRAM once and hit L2 for the other heads;
//  * all operands of the first key block in flight at once: C + the whole state s[c] (commit group 0)
//    and B + x of key block 0 (group 1); C s^T (the state in 64-column pieces into one accumulator)
//    runs while group 1 lands, then rows scaled by exp(Lam_i);
//  * per key block of 64 rows up to the diagonal: scores = C B^T (fp32), masked (j <= i), times
//    exp(min(Lam_i - Lam_j, 0)) dt_j, rounded to the in-type in registers (the accumulator becomes
//    the next MMA's A operand) and multiplied by the block's x rows;
//  * epilogue through shared memory: the fp32 accumulators are staged in the dead C / state region,
//    then each thread owns 8 consecutive columns of a row: D x from the staged x rows (the last key
//    block is the tile's own rows), z read, y and out written as 16-byte vectors.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fwd_tiles.cuh"
#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {
namespace mma = tree_recurrence::kernels::mma;
using tiles::round64;

constexpr int kThreads = 128;
constexpr int kRows = 64;   // rows i per block; key rows j per block step
// the opt-in maximum of dynamic shared memory per block on sm_90 (227 KB); the largest shape
// (P 128, N 256, chunk 256) takes ~155 KB
constexpr size_t kMaxSmem = 227 * 1024;

struct ScanLayout {
  int64_t ldc, c_elems, st_elems, b_elems, x_elems, stage_floats;
  size_t lo_bytes;  // c_s + st_s (bf16), or the fp32 stage when larger
  size_t bytes;
};
__host__ __device__ inline ScanLayout scan_layout(int64_t N, int PT, int L) {
  ScanLayout m;
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

template <typename T, int L, int PT>
__global__ void __launch_bounds__(kThreads, PT > 64 ? 2 : 3) chunk_scan_kernel(FwdParams p) {
  constexpr int NTP = PT / 8;
  constexpr int kLdX = PT + 8;
  constexpr int kLdStage = PT + 4;
  constexpr int kTiles = L / kRows;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const ScanLayout lay = scan_layout(N, PT, L);
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

  const T* Cg = static_cast<const T*>(p.C) + g * N;
  const T* Bg = static_cast<const T*>(p.B) + g * N;
  const T* xh = static_cast<const T*>(p.x) + h * P;
  const T* states = static_cast<const T*>(p.states) + (c * H + h) * P * N;
  const int CV = NP / 8;
  constexpr int XV = PT / 8;
  // group 0: C rows of the tile and the whole state
  tiles::rows_async<kThreads>(c_s, ldc, Cg, G * N, gather + i0, kRows, CV, N, tid);
  tiles::dense_async<kThreads>(st_s, ldc, states, N, PT, P, CV, N, tid);
  mma::cp_async_commit();
  // B and x rows of key block kb
  auto issue_keys = [&](int kb) {
    const int j0 = kb * kRows;
    tiles::rows_async<kThreads>(b_s, ldc, Bg, G * N, gather + j0, kRows, CV, N, tid);
    tiles::rows_async<kThreads>(x_s, kLdX, xh, H * P, gather + j0, kRows, XV, P, tid);
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
  tiles::gemm_pieces<T, NTP>(acc, c_s + warp * 16 * ldc, ldc, st_s, ldc, NP);
  tiles::scale_rows<NTP>(acc, lam_s[i0 + warp * 16 + mma::c_row(lane, 0)], lam_s[i0 + warp * 16 + mma::c_row(lane, 2)]);

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
    tiles::gemm_pieces<T, 8>(sc, c_s + warp * 16 * ldc, ldc, b_s, ldc, NP);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        sc[0][nt].x[e] = tiles::masked_score(sc[0][nt].x[e], i0 + warp * 16 + mma::c_row(lane, e),
                                             j0 + nt * 8 + mma::c_col(lane, e), lam_s, dt_s);
#pragma unroll
    for (int kt = 0; kt < kRows / 16; ++kt)
      tiles::mma_scores_x<T, NTP>(acc, mma::c_to_a<T>(sc[0][2 * kt], sc[0][2 * kt + 1]), x_s + kt * 16 * kLdX, kLdX);
  }

  // 3. stage the fp32 accumulators (over the dead C / state region), then 8 columns per thread:
  // D x (x_s holds the tile's own rows: the last key block is kb = mtile, j0 = i0), the z gate,
  // 16-byte stores at the tokens' rows
  __syncthreads();  // every warp is done reading c_s / st_s
  tiles::stage_acc<NTP>(stage, kLdStage, warp * 16, acc, lane);
  __syncthreads();
  T* out = static_cast<T*>(p.out);
  T* y = static_cast<T*>(p.y);
  const T* zin = p.z_fp32 ? nullptr : static_cast<const T*>(p.z);
  const int PV = static_cast<int>(P / 8);
  for (int v = tid; v < kRows * PV; v += kThreads) {
    const int r = v / PV, col = (v % PV) * 8;
    const int64_t tok = tok_s[r];
    if (tok < 0) continue;
    const int64_t idx = (tok * H + h) * P + col;
    tiles::epilogue8<T>(p, stage + r * kLdStage + col, x_s + r * kLdX + col, zin ? zin + idx : nullptr,
                        p.D ? p.D + h * P + col : nullptr, idx, y, out);
  }
}

template <typename T, int L, int PT>
int launch(const FwdParams& p, cudaStream_t stream) {
  const ScanLayout lay = scan_layout(p.state_dim, PT, L);
  auto kernel = chunk_scan_kernel<T, L, PT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(lay.bytes));
  if (err != cudaSuccess) return static_cast<int>(err);
  const int64_t blocks = p.num_chunks * (L / kRows) * p.heads;
  kernel<<<dim3(static_cast<unsigned>(blocks)), kThreads, lay.bytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

bool ssd_chunk_scan_supported(const FwdParams& p) {
  if (!fwd_shape_supported(p.chunk, p.head_dim, p.state_dim) || p.groups <= 0 || p.heads % p.groups != 0) return false;
  if (scan_layout(p.state_dim, tiles::padded_p(p.head_dim), static_cast<int>(p.chunk)).bytes > kMaxSmem) return false;
  const int64_t blocks = p.num_chunks * (p.chunk / kRows) * p.heads;
  if (blocks > 2147483647LL) return false;
  return tiles::rows_aligned16(p);  // 16-byte vectors of x / z / y / out rows (P % 8 == 0)
}

int ssd_chunk_scan_fwd(const FwdParams& p, void* stream) {
  if (!ssd_chunk_scan_supported(p)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.num_chunks == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  return tiles::dispatch(p, [&](auto t, auto l, auto pt) {
    return launch<typename decltype(t)::type, decltype(l)::value, decltype(pt)::value>(p, s);
  });
}

}  // namespace tree_recurrence::ssd::fused::kernels
