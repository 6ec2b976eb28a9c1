// Fused SSD forward, stage d (params.h, ssd_fused.h): the grouped chunk scan, chunk 64, P <= 64.
//   y_i = exp(Lam_i) C_i s[c]^T + sum_{j <= i} <C_i, B_j> exp(Lam_i - Lam_j) dt_j x_j + D x_i
//   out_i = y_i * silu(z_i) (z given; y saved pre-gate), else y_i; written at the tokens' rows.
// A block owns one (chunk, group, head slice): it loads the chunk's C and B rows once, computes the
// 64 x 64 scores C B^T (fp32, kept in the MMA accumulators) and loops over its slice of the group's
// H / G heads. The next head's operands (Lam, dt, the state s[c] (P x N), x rows and, for an in-type
// z, z rows) are copied by cp.async into the other half of a double buffer while the current head
// computes, so the state / x / z reads (the kernel's HBM bytes) stay in flight through the MMAs.
//  * 256 threads: warp w owns a row block of 16 rows (w for w < 4, 7 - w after: balanced over the
//    schedulers) and half the P columns ((w / 4) * PT / 2 ..); C B^T (once per block) is computed by
//    both warps of a row block (each needs its 16 x 64 scores in registers), C s^T and the
//    scores-times-x MMAs are split by columns; 2 blocks per SM (<= 128 registers, <= 112 KB of
//    shared memory): 4 warps per scheduler;
//  * key tiles above the diagonal (kt > the row block: every score masked to 0) are skipped: no exps,
//    no MMAs; below the diagonal the mask is not evaluated;
//  * epilogue per accumulator element in registers: x and z pairs read as 32-bit words (conflict-free
//    at pitch PT + 8), D pairs from global (read at the head's start), y / out pairs rounded, written
//    to a warp-private shared tile by stmatrix and stored as 16-byte rows (16 full sectors per
//    instruction); no fp32 staging, no integer division;
//  * N rounded to 64 a template argument, the per-head copies with the thread's rows / columns fixed
//    at compile time (no division or 64-bit index math per 16-byte copy).
// Per element the same operations in the same order as the per-head scan (ssd_chunk_scan_fwd.cu;
// fwd_tiles.cuh's expressions: the accumulation over k of each accumulator tile, the row scale, the
// masked score rounded to the in-type, D x, y, silu(z)), so the outputs are bitwise equal to it (a
// masked tile there adds 0 * x: a -0 accumulator reads +0, equal under ==; a non-finite x of a later
// token of the chunk does not reach the earlier rows here).
// Grid: NC * G * splits blocks (splits divides H / G; the slice fastest, so the blocks of one chunk
// and group share C / B through L2).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "fwd_tiles.cuh"
#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {
namespace mma = tree_recurrence::kernels::mma;
using tiles::round64;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kL = 64;  // the chunk (rows i and keys j)
// at most this much dynamic shared memory (2 CTAs per SM: 228 KB per SM, 1 KB reserved per CTA)
constexpr size_t kMaxSmem = 112 * 1024;
// fewer blocks than this and the heads are split over more blocks (the grid fills the GPU)
constexpr int64_t kMinBlocks = 2048;

struct GroupLayout : tiles::ScanSmem {
  int64_t o_ld, o_elems;
  size_t bytes;
};
// c_s (kL x ldc) | sb[2] (max(PT, kL) x ldc: the states; sb[1] first holds B) | x_s[2] (kL x PT + 8)
// | z_s[2] (kL x PT + 8, in-type z only) (these: tiles::scan_smem) | o_s (per warp 2 tiles of 16 x
// (PT / 2 + 8): y, out) | lam[2][kL] | dt[2][kL] (fp32) | tok[kL] (int64)
__host__ __device__ inline GroupLayout group_layout(int64_t N, int PT, bool z_tile) {
  GroupLayout m{tiles::scan_smem<kL>(N, PT, z_tile)};
  m.o_ld = PT / 2 + 8;
  m.o_elems = 16 * m.o_ld;
  m.bytes = size_t(m.c_elems + 2 * m.sb_elems + 2 * m.x_elems + 2 * m.z_elems + 2 * kWarps * m.o_elems) * 2 +
            size_t(4 * kL) * sizeof(float) + kL * sizeof(int64_t);
  return m;
}

bool z_tile_of(const FwdParams& p) { return p.z != nullptr && !p.z_fp32; }

// four 8 x 8 b16 matrices into shared memory (the inverse of ldmatrix.x4: register j of lane l is
// row l / 4, columns 2 (l % 4) .. + 1 of matrix j; lane l addresses row l % 8 of matrix l / 8)
__device__ __forceinline__ void stsm_x4(void* p, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(mma::smem_addr(p)), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// the two in-type elements at p (4-byte aligned; one 32-bit load) as floats (exact conversions, the
// values Elem<T>::to_float gives)
template <typename T>
__device__ __forceinline__ float2 load2(const T* p) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(p);  // bf16 -> fp32: the bits shifted up
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else
    return __half22float2(*reinterpret_cast<const __half2*>(p));
}

// the warp's accumulator tiles acc[nt] (16 rows x 8 * NTW columns, rounded pairs in u[nt][2]: rows
// g, g + 8) into a 16 x (8 * NTW) tile of pitch ld
template <int NTW>
__device__ __forceinline__ void tile_to_smem(void* tile, int ld, const uint32_t (&u)[NTW][2], int lane) {
  using E = uint16_t;
  const int m = lane >> 3, i = lane & 7;
#pragma unroll
  for (int np = 0; np < NTW / 2; ++np) {
    E* a = static_cast<E*>(tile) + (i + ((m & 1) << 3)) * ld + (2 * np + (m >> 1)) * 8;
    stsm_x4(a, u[2 * np][0], u[2 * np][1], u[2 * np + 1][0], u[2 * np + 1][1]);
  }
}

// NP = round64(N) (64 / 128 / 192) a template argument: the tile loaders' vector counts and the
// 64-column pieces of the C s^T / C B^T products are compile-time (a runtime division per 16-byte
// vector would be ~20% of the per-head instructions)
template <typename T, int PT, int NP>
__global__ void __launch_bounds__(kThreads, 2) chunk_scan_group_kernel(FwdParams p, int splits) {
  constexpr int NTW = PT / 16;  // 8-column accumulator tiles per warp (half the columns)
  constexpr int kLdX = PT + 8;
  constexpr int kWCols = PT / 2;
  constexpr int ldc = NP + 8;
  constexpr int o_ld = PT / 2 + 8;
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const int64_t hpg = H / G, hpb = hpg / splits;
  const bool z_tile = p.z != nullptr && !p.z_fp32;
  const GroupLayout lay = group_layout(NP, PT, z_tile);
  extern __shared__ __align__(16) unsigned char smem[];
  T* c_s = reinterpret_cast<T*>(smem);
  T* sb = c_s + lay.c_elems;                               // 2 x sb_elems
  T* x_s = sb + 2 * lay.sb_elems;                          // 2 x x_elems
  T* z_s = x_s + 2 * lay.x_elems;                          // 2 x z_elems
  T* o_s = z_s + 2 * lay.z_elems;                          // kWarps x 2 x o_elems
  float* lam_s = reinterpret_cast<float*>(o_s + 2 * kWarps * lay.o_elems);  // 2 x kL
  float* dt_s = lam_s + 2 * kL;                                             // 2 x kL
  int64_t* tok_s = reinterpret_cast<int64_t*>(dt_s + 2 * kL);               // kL

  const tiles::ScanBlock blk = tiles::scan_block(G, hpg, hpb, splits);
  const int64_t g = blk.g, c = blk.c, h_first = blk.h_first;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // row block wr (rows [16 wr, 16 wr + 16)) and column half: warps w and w + 4 (one scheduler,
  // warp % 4) take row blocks w and 3 - w, so every scheduler has 5 key tiles of scores per head
  // (row block wr has wr + 1)
  const int wr = warp < 4 ? warp : 7 - warp;
  const int col0 = (warp >> 2) * kWCols;  // this warp's first column
  const int wrow = wr * 16;
  if (!tiles::chunk_tokens<kL, kThreads>(p, c, tok_s, tid)) return;  // an all-padding chunk

  constexpr int CV = NP / 8;
  constexpr int XV = PT / 8;
  tiles::issue_cb<kL, kThreads>(p, c_s, sb + lay.sb_elems, ldc, tok_s, g, G, N, CV, tid);

  // one head's operands into buffer b: Lam, dt (fp32), the state s[c] (P x N), x rows, z rows (the
  // copies of tiles::dense_async / rows_async, with this thread's rows and columns fixed at compile
  // time where the vector counts divide the block: no division per copy)
  constexpr int kXR = kThreads / XV;  // x / z rows per pass
  const int xr = tid / XV, xc = (tid % XV) * 8;
  const T* x = static_cast<const T*>(p.x);
  const T* zin = static_cast<const T*>(p.z);
  const T* states = static_cast<const T*>(p.states);
  auto issue_head = [&](int64_t h, int b) {
    const int64_t row0 = (c * H + h) * kL;
    if (tid < 2 * (kL / 4)) {
      const int which = tid / (kL / 4), k = (tid % (kL / 4)) * 4;
      const float* src = (which == 0 ? p.Lam : p.dt) + row0 + k;
      mma::cp_async_16((which == 0 ? lam_s : dt_s) + b * kL + k, src, 16);
    }
    T* sdst = sb + b * lay.sb_elems;
    const T* ssrc = states + (c * H + h) * P * N;
    if constexpr (kThreads % CV == 0) {
      constexpr int kSR = kThreads / CV;  // state rows per pass
      const int sr = tid / CV, sc = (tid % CV) * 8;
      const bool col_ok = sc < N;
#pragma unroll
      for (int i = 0; i < PT / kSR; ++i) {
        const int r = sr + i * kSR;
        const bool ok = col_ok && r < P;
        mma::cp_async_16(sdst + r * ldc + sc, ok ? ssrc + int64_t(r) * N + sc : ssrc, ok ? 16 : 0);
      }
    } else {
      tiles::dense_async<kThreads>(sdst, ldc, ssrc, N, PT, P, CV, N, tid);
    }
    const bool xc_ok = xc < P;
#pragma unroll
    for (int i = 0; i < kL / kXR; ++i) {
      const int r = xr + i * kXR;
      const int64_t t = tok_s[r];
      const bool ok = t >= 0 && xc_ok;
      const int64_t off = ok ? t * (H * P) + h * P + xc : 0;
      mma::cp_async_16(x_s + b * lay.x_elems + r * kLdX + xc, x + off, ok ? 16 : 0);
      if (z_tile) mma::cp_async_16(z_s + b * lay.z_elems + r * kLdX + xc, zin + off, ok ? 16 : 0);
    }
    mma::cp_async_commit();
  };
  issue_head(h_first, 0);

  // scores C B^T (fp32, this warp's 16 rows x 64 keys), once for the slice's heads
  mma::cp_async_wait<1>();
  __syncthreads();
  mma::FragC cb[1][8];
  tiles::gemm_pieces<T, 8>(cb, c_s + wrow * ldc, ldc, sb + lay.sb_elems, ldc, NP);
  __syncthreads();  // sb[1] (B) is free for the heads

  T* out = static_cast<T*>(p.out);
  T* y = static_cast<T*>(p.y);
  const float* zf = static_cast<const float*>(p.z);
  // this lane's accumulator rows (c_row 0 / 8) and their tokens
  const int r0 = wrow + mma::c_row(lane, 0), r1 = r0 + 8;
  const int64_t tok0 = tok_s[r0], tok1 = tok_s[r1];
  const int cq = mma::c_col(lane, 0);  // the lane's first column inside an 8-column tile
  T* ys = o_s + (2 * warp) * lay.o_elems;
  T* os = ys + lay.o_elems;
  const bool save_y = p.z != nullptr && y != nullptr;
  for (int64_t k = 0; k < hpb; ++k) {
    const int b = static_cast<int>(k & 1);
    const int64_t h = h_first + k;
    tiles::prefetch_next(k, hpb, [&] { issue_head(h + 1, b ^ 1); });
    // D pairs of this lane's columns (global, L1 / L2; in flight through the MMAs)
    float2 dv[NTW];
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt) {
      const int col = col0 + nt * 8 + cq;
      dv[nt] = make_float2(0.f, 0.f);
      if (p.D && col < P) dv[nt] = make_float2(__ldg(p.D + h * P + col), __ldg(p.D + h * P + col + 1));
    }
    __syncthreads();  // head k's operands (buffer b) visible to every warp
    const float* lam = lam_s + b * kL;
    const float* dtv = dt_s + b * kL;
    const T* xbuf = x_s + b * lay.x_elems;

    // 1. C s^T (this warp's columns of the state in buffer b), rows scaled by exp(Lam_i)
    mma::FragC acc[1][NTW];
    tiles::gemm_pieces<T, NTW>(acc, c_s + wrow * ldc, ldc, sb + b * lay.sb_elems + col0 * ldc, ldc, NP);
    const float lam_r0 = lam[r0], lam_r1 = lam[r1];
    tiles::scale_rows<NTW>(acc, lam_r0, lam_r1);

    // 2. the chunk's own tokens up to the diagonal: masked, decayed scores times x
#pragma unroll
    for (int kt = 0; kt < kL / 16; ++kt) {
      if (kt > wr) break;  // every score of the tile masked: nothing to add
      mma::FragC s2[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int nt = 2 * kt + half;
        const int j0 = nt * 8 + cq;
        const float2 lj = *reinterpret_cast<const float2*>(lam + j0);
        const float2 dj = *reinterpret_cast<const float2*>(dtv + j0);
        const float ljs[2] = {lj.x, lj.y}, djs[2] = {dj.x, dj.y};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e < 2 ? r0 : r1;
          const float li = e < 2 ? lam_r0 : lam_r1;
          const int j = j0 + (e & 1);
          // tiles::masked_score's expression (the mask only on the diagonal tile)
          const float v = cb[0][nt].x[e] * expf(fminf(li - ljs[e & 1], 0.f)) * djs[e & 1];
          s2[half].x[e] = (kt < wr || j <= i) ? v : 0.f;
        }
      }
      tiles::mma_scores_x<T, NTW>(acc, mma::c_to_a<T>(s2[0], s2[1]), xbuf + kt * 16 * kLdX + col0, kLdX);
    }

    // 3. epilogue on the fragments, per element the per-head scan's order: + D x, y = that (pre-gate,
    // rounded), times silu(z), out rounded; each optional step one uniform branch over the warp's 4 NTW
    // elements
    const T* zbuf = z_s + b * lay.z_elems;
    if (p.D) {
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const float2 xv = load2<T>(xbuf + (rr == 0 ? r0 : r1) * kLdX + col0 + nt * 8 + cq);
          acc[0][nt].x[2 * rr] += dv[nt].x * xv.x;
          acc[0][nt].x[2 * rr + 1] += dv[nt].y * xv.y;
        }
    }
    if (p.z) {
      float2 zv[NTW][2];
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int col = col0 + nt * 8 + cq;
          if (z_tile) {
            zv[nt][rr] = load2<T>(zbuf + (rr == 0 ? r0 : r1) * kLdX + col);
          } else {
            const int64_t tok = rr == 0 ? tok0 : tok1;
            zv[nt][rr] = make_float2(0.f, 0.f);
            if (tok >= 0 && col < P) zv[nt][rr] = *reinterpret_cast<const float2*>(zf + (tok * H + h) * P + col);
          }
        }
      if (save_y) {
        uint32_t yu[NTW][2];
        tiles::pack_pairs<T, NTW>(yu, acc);
        tile_to_smem<NTW>(ys, o_ld, yu, lane);
      }
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          acc[0][nt].x[2 * rr] *= tiles::silu(zv[nt][rr].x);
          acc[0][nt].x[2 * rr + 1] *= tiles::silu(zv[nt][rr].y);
        }
    }
    uint32_t ou[NTW][2];
    tiles::pack_pairs<T, NTW>(ou, acc);
    tile_to_smem<NTW>(os, o_ld, ou, lane);
    __syncwarp();
    // 16-byte rows: lane -> row v % 16, 8-column piece v / 16 (16 rows x 32 bytes per instruction)
#pragma unroll
    for (int v = lane; v < 16 * (kWCols / 8); v += 32) {
      const int r = v & 15, piece = v >> 4;
      const int col = col0 + piece * 8;
      const int64_t tok = tok_s[wrow + r];
      if (tok < 0 || col >= P) continue;
      const int64_t idx = (tok * H + h) * P + col;
      if (save_y) *reinterpret_cast<uint4*>(y + idx) = *reinterpret_cast<const uint4*>(ys + r * o_ld + piece * 8);
      *reinterpret_cast<uint4*>(out + idx) = *reinterpret_cast<const uint4*>(os + r * o_ld + piece * 8);
    }
    // every warp is done with buffer b (refilled by the next iteration's issue, head k + 2) and this
    // warp with its output tiles (rewritten for head k + 1)
    __syncthreads();
  }
}

template <typename T, int PT, int NP>
int launch(const FwdParams& p, cudaStream_t stream) {
  return tiles::launch_grouped(chunk_scan_group_kernel<T, PT, NP>, kThreads,
                               group_layout(p.state_dim, PT, z_tile_of(p)).bytes, p, kMinBlocks, stream);
}

// (P 64 with N > 128 does not fit: ssd_chunk_scan_group_supported)
template <typename T>
int by_p(const FwdParams& p, cudaStream_t s) {
  const int64_t NP = round64(p.state_dim);
  if (p.head_dim <= 32) {
    if (NP == 64) return launch<T, 32, 64>(p, s);
    if (NP == 128) return launch<T, 32, 128>(p, s);
    if (NP == 192) return launch<T, 32, 192>(p, s);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (NP == 64) return launch<T, 64, 64>(p, s);
  if (NP == 128) return launch<T, 64, 128>(p, s);
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

bool ssd_chunk_scan_group_supported(const FwdParams& p) {
  if (!tiles::grouped_scan_shape(p, kL)) return false;
  if (group_layout(p.state_dim, tiles::padded_p(p.head_dim), z_tile_of(p)).bytes > kMaxSmem) return false;
  const int64_t NP = round64(p.state_dim);  // the instantiated (PT, NP): by_p
  if (NP > (p.head_dim <= 32 ? 192 : 128)) return false;
  return tiles::grouped_scan_rows(p);
}

int ssd_chunk_scan_group_fwd(const FwdParams& p, void* stream) {
  return tiles::run_grouped(ssd_chunk_scan_group_supported(p), p, stream,
                            [&](auto t, cudaStream_t s) { return by_p<typename decltype(t)::type>(p, s); });
}

}  // namespace tree_recurrence::ssd::fused::kernels
