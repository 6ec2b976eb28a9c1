// Fused SSD (Mamba2) backward, the local entering-state gradient on bf16 / fp16 tensor cores (the Half route's
// two-kernel reverse pass, long segments):
//   ds_local[c, h] = (e^Lam . dy)^T C      (P x N), dy = dout silu(z) (= dout without z)
// with dy computed on the fly from dout and z (no gate kernel, no fp32 dy buffer). Block per
// (chunk, head), 4 warps; heads of a group are neighbours in the grid, so their C tile is an L2 hit.
//   * C (L x N, the input dtype) -> shared memory by 16-byte cp.async (pad rows / columns zero-filled);
//   * dout, z -> 16-byte loads, dy_i = dout z sigmoid(z) (the gate's formula) times e^{Lam_i} in fp32,
//     rounded ONCE to the input dtype into shared memory (stored (L x P), so it is the A operand
//     transposed: ldmatrix.trans);
//   * one mma.sync m16n8k16 per product (bf16 or fp16 operands, fp32 accumulation), warp tiles of
//     32 x 32 (P x N) over the zero-padded (ceil32(P) x ceil64(N)) output, K = L = 64 in 4 steps; 32 fp32
//     accumulators, 72 registers, 7 CTAs/SM by the launch bound;
//   * the accumulators rounded once (RN) to the input type (p.ds16): one xor-1 shuffle per two column blocks,
//     then 8-byte stores of 4 consecutive columns (whole 32-byte sectors).
// Shared memory: 64 x (ceil32(P) + 8) + 64 x (ceil64(N) + 8) elements + 64 int64 + 64 floats; at
// P 64 / N 128: 9.2 + 17.4 + 0.75 KB = 27.4 KB (P, N 128: 35.6 KB).
// Fixed mma order: two runs give identical bits; no atomics. 64-bit global indexing.
// Requirements (ssd_bwd_local_bf16_supported): chunk 64, P and N in 1..128 and multiples of 8, C, dout
// (and z) of one 16-bit type, ds16 set of that type, the pointers 16-byte aligned.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bwd_tiles.cuh"
#include "params_bwd.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {

namespace mm = tree_recurrence::kernels::mma;

constexpr int kL = 64;
constexpr int kWarps = 4, kThreads = kWarps * 32;
constexpr int kMaxDim = 128;
constexpr int kBatch = 4;  // dout / z pieces loaded ahead per thread

struct Plan {
  int Pp, Np, DP, CP;                 // padded P (32), padded N (64), pitches (elements)
  int64_t off_dy, off_C, bytes;       // byte offsets (after 64 int64 tokens + 64 floats)
  __host__ __device__ explicit Plan(int64_t P, int64_t N) {
    Pp = bwd_tiles::ceil_to(P, 32);
    Np = bwd_tiles::ceil_to(N, 64);
    DP = Pp + 8;
    CP = Np + 8;
    int64_t o = kL * 8 + kL * 4;      // tokens, e^Lam
    off_dy = o; o += static_cast<int64_t>(kL) * DP * 2;
    off_C = o; o += static_cast<int64_t>(kL) * CP * 2;
    bytes = o;
  }
};

constexpr int kTN = 32;  // the warp tile's width in N (32 x 32 P x N tiles)
template <typename T, bool HAS_Z>
__global__ void __launch_bounds__(kThreads, 7) local_bf16_kernel(BwdParams p) {
  constexpr int NB = kTN / 8;  // 8-column accumulator blocks per warp tile
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups;
  const int64_t ch = blockIdx.x, c = ch / H, h = ch % H, g = h / (H / G);
  const Plan pl(P, N);
  int64_t* tok = reinterpret_cast<int64_t*>(smem);
  float* el = reinterpret_cast<float*>(smem + kL * 8);
  T* dys = reinterpret_cast<T*>(smem + pl.off_dy);
  T* Cs = reinterpret_cast<T*>(smem + pl.off_C);
  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5;

  if (tid < kL) {
    tok[tid] = p.gather[c * kL + tid];
    el[tid] = expf(p.Lam[ch * kL + tid]);
  }
  __syncthreads();

  // C rows of the group: cp.async 16-byte pieces (8 elements), zero-filled outside the data
  const T* Cg = static_cast<const T*>(p.C);
  const int cq = pl.Np / 8;
  for (int e = tid; e < kL * cq; e += kThreads) {
    const int i = e / cq, n0 = (e % cq) * 8;
    const int64_t t = tok[i];
    const bool in = t >= 0 && n0 < N;
    const T* src = in ? Cg + (t * G + g) * N + n0 : Cg;
    mm::cp_async_16(Cs + i * pl.CP + n0, src, in ? 16 : 0);
  }
  mm::cp_async_commit();

  // dy rows, scaled by e^Lam and rounded once. kBatch 16-byte pieces per thread are loaded (__ldg:
  // global, read-only) before any of them is converted and stored, so each thread keeps kBatch x 32
  // bytes in flight (at P 64 a thread's whole share: 4 pieces).
  const T* dout = static_cast<const T*>(p.dout);
  const T* zz = static_cast<const T*>(p.z);
  const int dq = pl.Pp / 8, total = kL * dq;
  for (int e0 = tid; e0 < total; e0 += kBatch * kThreads) {
    uint4 gv[kBatch], zv[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads;
      gv[u] = zv[u] = make_uint4(0u, 0u, 0u, 0u);
      if (e < total) {
        const int i = e / dq, p0 = (e % dq) * 8;
        const int64_t t = tok[i];
        if (t >= 0 && p0 < P) {
          const int64_t off = (t * H + h) * P + p0;
          gv[u] = __ldg(reinterpret_cast<const uint4*>(dout + off));
          if constexpr (HAS_Z) zv[u] = __ldg(reinterpret_cast<const uint4*>(zz + off));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int e = e0 + u * kThreads;
      if (e >= total) break;
      const int i = e / dq, p0 = (e % dq) * 8;
      const float s = el[i];  // pad rows and columns: zero pieces stay zero
      const uint32_t gw[4] = {gv[u].x, gv[u].y, gv[u].z, gv[u].w};
      const uint32_t zw[4] = {zv[u].x, zv[u].y, zv[u].z, zv[u].w};
      uint32_t ow[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) ow[k] = bwd_tiles::scaled_dy2<T, HAS_Z>(gw[k], zw[k], s);
      *reinterpret_cast<uint4*>(dys + i * pl.DP + p0) = make_uint4(ow[0], ow[1], ow[2], ow[3]);
    }
  }
  mm::cp_async_wait<0>();
  __syncthreads();

  const int mtiles = pl.Pp / 32, ntiles = pl.Np / kTN;
  const int lane = tid & 31;
  for (int b = warp; b < mtiles * ntiles; b += kWarps) {
    const int r0 = (b / ntiles) * 32, n0 = (b % ntiles) * kTN;
    mm::FragC acc[2][NB];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int nt = 0; nt < NB; ++nt) acc[mt][nt].zero();
    // A(r = p, k = i) = dys[i][p] (stored transposed), B(k = i, n) = Cs[i][n]
    mm::warp_gemm<T, 2, NB, kL / 16, false, true>(acc, dys + r0, pl.DP, Cs + n0, pl.CP);
    {
      // rounded once (RN) to T. Column blocks nt, nt + 1 in pairs: a lane holds columns 2 tq, 2 tq + 1 of
      // both; one xor-1 shuffle gives an even lane 4 consecutive columns of block nt and its odd partner 4
      // of block nt + 1 (same row), so a warp store writes 8 rows x 32 contiguous bytes (whole sectors).
      T* out = static_cast<T*>(p.ds16) + ch * P * N;
      const bool odd = (lane & 1) != 0;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int np = 0; np < NB / 2; ++np) {
          const int na = n0 + np * 16, nb = na + 8;  // warp-uniform; N % 8 == 0: a block is all in or out
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const uint32_t a = mm::Elem<T>::pack(acc[mt][2 * np].x[2 * hh], acc[mt][2 * np].x[2 * hh + 1]);
            const uint32_t bb = mm::Elem<T>::pack(acc[mt][2 * np + 1].x[2 * hh], acc[mt][2 * np + 1].x[2 * hh + 1]);
            const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? a : bb, 1);
            const int r = r0 + mt * 16 + mm::c_row(lane, 2 * hh);
            const int tq = lane & 3;
            // even: columns na + 2 tq .. + 3 (its a, then the partner's a); odd: nb + 2 (tq - 1) .. + 3
            const int n = odd ? nb + 2 * (tq - 1) : na + 2 * tq;
            const bool in = (odd ? nb : na) < N && r < P;
            if (in)
              *reinterpret_cast<uint2*>(out + static_cast<int64_t>(r) * N + n) = odd ? make_uint2(got, bb)
                                                                                      : make_uint2(a, got);
          }
        }
    }
  }
}

bool aligned16(const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; }
using bwd_tiles::half_type;

template <typename T, bool HAS_Z>
int launch_kernel(const BwdParams& p, cudaStream_t st, int bytes) {
  auto* kern = local_bf16_kernel<T, HAS_Z>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return static_cast<int>(e);
  kern<<<static_cast<unsigned>(p.num_chunks * p.heads), kThreads, bytes, st>>>(p);
  return static_cast<int>(cudaGetLastError());
}
template <typename T>
int launch(const BwdParams& p, cudaStream_t st) {
  const int bytes = static_cast<int>(Plan(p.head_dim, p.state_dim).bytes);
  return p.z != nullptr ? launch_kernel<T, true>(p, st, bytes) : launch_kernel<T, false>(p, st, bytes);
}

}  // namespace

bool ssd_bwd_local_bf16_supported(const BwdParams& p) {
  if (p.chunk != kL || p.head_dim < 1 || p.head_dim > kMaxDim || p.state_dim < 1 || p.state_dim > kMaxDim) return false;
  if (p.head_dim % 8 != 0 || p.state_dim % 8 != 0) return false;
  if (p.groups < 1 || p.heads % p.groups != 0) return false;
  if (!half_type(p.bc_type) || p.dout_type != p.bc_type) return false;
  if (p.z != nullptr && p.z_type != p.bc_type) return false;
  if (p.num_chunks * p.heads > 0x7fffffffLL) return false;
  if (p.ds16 == nullptr || p.ds16_type != p.bc_type) return false;  // ds16: in C's (the input) type
  return aligned16(p.C) && aligned16(p.dout) && (p.z == nullptr || aligned16(p.z)) && aligned16(p.ds16);
}

int ssd_bwd_local_bf16(const BwdParams& p, void* stream) {
  if (p.num_chunks * p.heads == 0) return 0;
  if (!ssd_bwd_local_bf16_supported(p)) return static_cast<int>(cudaErrorInvalidValue);
  const auto st = static_cast<cudaStream_t>(stream);
  return p.bc_type == BwdType::BFloat16 ? launch<__nv_bfloat16>(p, st) : launch<__half>(p, st);
}

}  // namespace tree_recurrence::ssd::fused::kernels
