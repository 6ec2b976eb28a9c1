// Fused SSD forward, stage d, v3 (the default at chunk 64; params.h, ssd_fused.h): the chunk scan
// with C B^T once per (chunk, group) and the heads' operands streamed through a double buffer.
//   y_i = exp(Lam_i) C_i s[c]^T + sum_{j <= i} <C_i, B_j> exp(Lam_i - Lam_j) dt_j x_j + D x_i
//   out_i = y_i * silu(z_i) (z given; y saved pre-gate), else y_i; written at the tokens' rows.
// A block owns one (chunk, group, head slice): it loads the chunk's C and B rows once, computes the
// 64 x 64 scores C B^T (fp32, kept in the MMA accumulators) and loops over its slice of the group's
// H / G heads. Per head, the next head's operands (Lam, dt, the state s[c] (P x N), x rows and, for
// an in-type z, z rows) are copied by cp.async into the other half of a double buffer while the
// current head computes, so the state / x / z reads (the kernel's HBM bytes) stay in flight through
// the MMAs and the epilogue. Epilogue per warp: its 16 accumulator rows staged in a warp-private
// fp32 region (__syncwarp only), then 8 columns per lane: D x and z from shared memory, y and out
// as 16-byte stores. Two block barriers per head.
// Same arithmetic per head as v2 (ssd_chunk_scan_fwd.cu: C s^T in 64-column pieces, the masked,
// decayed scores rounded to the in-type as the next MMA's A operand, the same epilogue, all through
// fwd_tiles.cuh), so results are expected bitwise equal to v2.
// Grid: NC * G * splits blocks (splits divides H / G; the slice fastest, so the blocks of one chunk
// and group share C / B through L2); 128 threads, warp w rows [16 w, 16 w + 16), every P column
// (PT = P padded to 32 / 64). Only chunk 64 and P <= 64; supported when the layout leaves 2 CTAs per
// SM (P 64, N 128, in-type z: 106 KB).
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
constexpr int kL = 64;      // the chunk (rows i and keys j)
// at most this much dynamic shared memory (2 CTAs per SM: 228 KB per SM, 1 KB reserved per CTA)
constexpr size_t kV3MaxSmem = 112 * 1024;
// fewer blocks than this and the heads are split over more blocks (the grid fills the GPU)
constexpr int64_t kMinBlocks = 2048;

struct V3Smem : tiles::ScanSmem {
  int64_t stage_floats;
  size_t bytes;
};
// c_s (kL x ldc) | sb[2] (max(PT, kL) x ldc: the states; sb[1] first holds B) | x_s[2] (kL x PT + 8)
// | z_s[2] (kL x PT + 8, in-type z only) (these: tiles::scan_smem) | stage (kL x PT + 4 fp32)
// | lam[2][kL] | dt[2][kL] (fp32) | tok[kL] (int64)
__host__ __device__ inline V3Smem v3_layout(int64_t N, int PT, bool z_tile) {
  V3Smem m{tiles::scan_smem<kL>(N, PT, z_tile)};
  m.stage_floats = int64_t(kL) * (PT + 4);
  m.bytes = size_t(m.c_elems + 2 * m.sb_elems + 2 * m.x_elems + 2 * m.z_elems) * 2 +
            size_t(m.stage_floats + 4 * kL) * sizeof(float) + kL * sizeof(int64_t);
  return m;
}

bool z_tile_of(const FwdParams& p) { return p.z != nullptr && !p.z_fp32; }

template <typename T, int PT>
__global__ void __launch_bounds__(kThreads, 2) chunk_scan_kernel_v3(FwdParams p, int splits) {
  constexpr int NTP = PT / 8;
  constexpr int kLdX = PT + 8;
  constexpr int kLdStage = PT + 4;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const int64_t hpg = H / G, hpb = hpg / splits;
  const bool z_tile = p.z != nullptr && !p.z_fp32;
  const V3Smem lay = v3_layout(N, PT, z_tile);
  const int ldc = static_cast<int>(lay.ldc);
  const int NP = ldc - 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T* c_s = reinterpret_cast<T*>(smem);
  T* sb = c_s + lay.c_elems;                                    // 2 x sb_elems
  T* x_s = sb + 2 * lay.sb_elems;                               // 2 x x_elems
  T* z_s = x_s + 2 * lay.x_elems;                               // 2 x z_elems
  float* stage = reinterpret_cast<float*>(z_s + 2 * lay.z_elems);  // kL x kLdStage
  float* lam_s = stage + lay.stage_floats;                      // 2 x kL
  float* dt_s = lam_s + 2 * kL;                                 // 2 x kL
  int64_t* tok_s = reinterpret_cast<int64_t*>(dt_s + 2 * kL);   // kL

  const tiles::ScanBlock blk = tiles::scan_block(G, hpg, hpb, splits);
  const int64_t g = blk.g, c = blk.c, h_first = blk.h_first;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (!tiles::chunk_tokens<kL, kThreads>(p, c, tok_s, tid)) return;  // an all-padding chunk

  const int CV = NP / 8;
  constexpr int XV = PT / 8;
  // group: C and B rows of the chunk (B into sb[1])
  tiles::issue_cb<kL, kThreads>(p, c_s, sb + lay.sb_elems, ldc, tok_s, g, G, N, CV, tid);

  const T* x = static_cast<const T*>(p.x);
  const T* zin = static_cast<const T*>(p.z);
  const T* states = static_cast<const T*>(p.states);
  // one head's operands into buffer b: Lam, dt (fp32), the state s[c] (P x N), x rows, z rows
  auto issue_head = [&](int64_t h, int b) {
    const int64_t row0 = (c * H + h) * kL;
    for (int v = tid; v < 2 * (kL / 4); v += kThreads) {
      const int which = v / (kL / 4), k = (v % (kL / 4)) * 4;
      const float* src = (which == 0 ? p.Lam : p.dt) + row0 + k;
      mma::cp_async_16((which == 0 ? lam_s : dt_s) + b * kL + k, src, 16);
    }
    tiles::dense_async<kThreads>(sb + b * lay.sb_elems, ldc, states + (c * H + h) * P * N, N, PT, P, CV, N, tid);
    tiles::rows_async<kThreads>(x_s + b * lay.x_elems, kLdX, x + h * P, H * P, tok_s, kL, XV, P, tid);
    if (z_tile) tiles::rows_async<kThreads>(z_s + b * lay.z_elems, kLdX, zin + h * P, H * P, tok_s, kL, XV, P, tid);
    mma::cp_async_commit();
  };
  issue_head(h_first, 0);

  // scores C B^T (fp32, this warp's 16 rows x 64 keys), once for the slice's heads
  mma::cp_async_wait<1>();
  __syncthreads();
  mma::FragC cb[1][8];
  tiles::gemm_pieces<T, 8>(cb, c_s + warp * 16 * ldc, ldc, sb + lay.sb_elems, ldc, NP);
  __syncthreads();  // sb[1] (B) is free for the heads

  T* out = static_cast<T*>(p.out);
  T* y = static_cast<T*>(p.y);
  const int PV = static_cast<int>(P / 8);
  const int wrow = warp * 16;
  for (int64_t k = 0; k < hpb; ++k) {
    const int b = static_cast<int>(k & 1);
    const int64_t h = h_first + k;
    tiles::prefetch_next(k, hpb, [&] { issue_head(h + 1, b ^ 1); });
    __syncthreads();  // head k's operands (buffer b) visible to every warp
    const float* lam = lam_s + b * kL;
    const float* dtv = dt_s + b * kL;
    const T* xbuf = x_s + b * lay.x_elems;

    // 1. C s^T (the state in buffer b), rows scaled by exp(Lam_i)
    mma::FragC acc[1][NTP];
    tiles::gemm_pieces<T, NTP>(acc, c_s + wrow * ldc, ldc, sb + b * lay.sb_elems, ldc, NP);
    tiles::scale_rows<NTP>(acc, lam[wrow + mma::c_row(lane, 0)], lam[wrow + mma::c_row(lane, 2)]);

    // 2. the chunk's own tokens: masked, decayed scores times x
#pragma unroll
    for (int kt = 0; kt < kL / 16; ++kt) {
      mma::FragC s2[2];
#pragma unroll
      for (int half = 0; half < 2; ++half)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int nt = 2 * kt + half;
          s2[half].x[e] = tiles::masked_score(cb[0][nt].x[e], wrow + mma::c_row(lane, e), nt * 8 + mma::c_col(lane, e),
                                              lam, dtv);
        }
      tiles::mma_scores_x<T, NTP>(acc, mma::c_to_a<T>(s2[0], s2[1]), xbuf + kt * 16 * kLdX, kLdX);
    }

    // 3. this warp's rows: staged (warp-private rows of stage), then D x, the z gate, 16-byte stores
    tiles::stage_acc<NTP>(stage, kLdStage, wrow, acc, lane);
    __syncwarp();
    const T* zbuf = z_s + b * lay.z_elems;
    for (int v = lane; v < 16 * PV; v += 32) {
      const int r = wrow + v / PV, col = (v % PV) * 8;
      const int64_t tok = tok_s[r];
      if (tok < 0) continue;
      const int64_t idx = (tok * H + h) * P + col;
      tiles::epilogue8<T>(p, stage + r * kLdStage + col, xbuf + r * kLdX + col, z_tile ? zbuf + r * kLdX + col : nullptr,
                          p.D ? p.D + h * P + col : nullptr, idx, y, out);
    }
    // every warp is done with buffer b (refilled by the next iteration's issue, head k + 2) and this
    // warp with its stage rows (rewritten for head k + 1)
    __syncthreads();
  }
}

template <typename T, int PT>
int launch_v3(const FwdParams& p, cudaStream_t stream) {
  return tiles::launch_grouped(chunk_scan_kernel_v3<T, PT>, kThreads, v3_layout(p.state_dim, PT, z_tile_of(p)).bytes, p,
                               kMinBlocks, stream);
}

// P <= 64 only (ssd_chunk_scan_v3_supported): at P 128 the layout leaves 1 CTA per SM; v2 takes it
template <typename T>
int by_p_v3(const FwdParams& p, cudaStream_t s) {
  if (p.head_dim <= 32) return launch_v3<T, 32>(p, s);
  return launch_v3<T, 64>(p, s);
}

}  // namespace

bool ssd_chunk_scan_v3_supported(const FwdParams& p) {
  return tiles::grouped_scan_shape(p, kL) &&
         v3_layout(p.state_dim, tiles::padded_p(p.head_dim), z_tile_of(p)).bytes <= kV3MaxSmem &&
         tiles::grouped_scan_rows(p);
}

int ssd_chunk_scan_fwd_v3(const FwdParams& p, void* stream) {
  return tiles::run_grouped(ssd_chunk_scan_v3_supported(p), p, stream,
                            [&](auto t, cudaStream_t s) { return by_p_v3<typename decltype(t)::type>(p, s); });
}

}  // namespace tree_recurrence::ssd::fused::kernels
