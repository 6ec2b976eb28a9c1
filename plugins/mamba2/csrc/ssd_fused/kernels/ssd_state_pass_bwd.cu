// Fused SSD (Mamba2) backward, the reverse local + state pass in one kernel (the Half route on short segments): the mirror of the
// forward's fused chunk-state pass (ssd_chunk_state_pass_fwd.cu). Per (segment, head, N tile), the chunks of
// the segment from the last one down:
//   local  = (e^Lam . dy)^T C                 (P x N, one bf16 / fp16 mma.sync per product, fp32 accumulators;
//                                              dy = dout silu(z), dout without z, formed on the fly)
//   ddecay partial = <s[c], carry>            (s[c] the saved entering state, carry = ds_leave[c], fp32)
//   ds_leave[c] = carry                       (rounded to the 16-bit input type: the post kernel reads it)
//   carry = e^(Lam_last) carry + local        (fp32; local rounded once to the 16-bit type first, as
//                                              local_bf16 stores it for the two-kernel path)
// so ds_local is never written or re-read (at GRPO 1.6 GB written by local_bf16 and read back by the state
// pass). A segment's last chunk starts from the sum of its children's entering gradients (fp32 ws, children
// order), a leaf from zero; the first chunk's carry goes to ws[s] (and d_roots[root]).
//
// Bitwise the two-kernel path's values: the local product is local_bf16's (same operand rounding, the same
// per-element MMA k order from zero accumulators), the carry update and the children's sum are the state
// pass's (same fmaf / adds in the same order), so ds_leave, ws and d_roots are bitwise equal to
// local_bf16 + state_pass_kernel's. The ddecay partials are per warp of this kernel's layout (another
// summation order than the state pass's per-128-element partials): ddecay agrees to fp32 rounding only.
//
// One launch per trie level (deepest first, the host loops over level_offsets: no host sync). Grid: one CTA
// of 8 warps per (level segment, head, N tile), N tile fastest then head (the heads of a group are neighbours:
// their C tiles are L2 hits). Warp tiles of 32 x 32 (P x N); the CTA covers all of P (padded to 32) and NB =
// 256 / 128 / 64 N columns for P padded to 32 / 64 / 96-128 (ceil(N / NB) tiles: 1 at P <= 64, N <= 128).
// Pipelining: the dout / z rows (raw, 16-byte cp.async, zero-filled on pad rows / columns) and the C rows of
// chunk c - 1 are copied into the second stage of double buffers right after the step of chunk c starts, so
// they land while chunk c forms dy, runs its MMAs and writes ds_leave; the gather rows and Lam of chunk c - 2
// are loaded in chunk c's step (a 3-slot ring); the saved states of chunk c - 1 go to registers (8-byte loads,
// whole 32-byte sectors) after chunk c used its own.
// Shared memory (P 64, N 128, with z): 2.25 KB ring + 2 x 16 KB raw dout / z + 9 KB dy + 2 x 17 KB C = 77.3 KB
// (2 CTAs / SM, the register bound of __launch_bounds__(256, 2)).
// Deterministic (fixed order, no atomics), 64-bit global offsets.
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
constexpr int kMaxDim = 128;
constexpr int kWarps = 8, kThreads = kWarps * 32;
constexpr int kRing = 3;  // gather / e^Lam slots: chunk c (in use), c - 1 (loads in flight), c - 2 (arriving)

struct PassPlan {
  int Pp, mtiles, nct, NB, Nc, zt, CW;  // padded P, 32-row blocks, 32-col blocks per CTA, CTA columns, N padded
                                        // to 32, N tiles, staged C width
  int DP, CP;                           // dy and C pitches (elements)
  int64_t off_raw, raw_stage, off_dy, off_C, c_stage, bytes;  // bytes
  __host__ __device__ PassPlan(int64_t P, int64_t N, bool has_z) {
    Pp = bwd_tiles::ceil_to(P, 32);
    mtiles = Pp / 32;
    nct = mtiles == 1 ? 8 : mtiles == 2 ? 4 : 2;
    NB = 32 * nct;
    Nc = bwd_tiles::ceil_to(N, 32);
    zt = (Nc + NB - 1) / NB;
    CW = NB < Nc ? NB : Nc;
    DP = Pp + 8;
    CP = CW + 8;
    int64_t o = kRing * kL * (8 + 4);  // tokens, e^Lam
    off_raw = o;
    raw_stage = static_cast<int64_t>(kL) * Pp * 2 * (has_z ? 2 : 1);  // dout (then z) rows, pitch Pp
    o += 2 * raw_stage;
    off_dy = o;
    o += static_cast<int64_t>(kL) * DP * 2;
    off_C = o;
    c_stage = static_cast<int64_t>(kL) * CP * 2;
    o += 2 * c_stage;
    bytes = o;
  }
};

// The lane's pieces of a warp's 32 x 32 tile (2 x 4 m16n8 accumulator fragments [mt][nt], rows
// r = r0 + 16 mt + gr + 8 hh), in a fixed order (mt, then nt / np, then hh; unrolled):
// for_frags: f(mt, nt) per fragment;
template <typename F>
__device__ __forceinline__ void for_frags(F f) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) f(mt, nt);
}
// for_pairs: f(mt, nt, hh, r, n) per accumulator pair x[2 hh], x[2 hh + 1] of fragment [mt][nt], columns n, n + 1
// (n = n0 + 8 nt + 2 tq);
template <typename F>
__device__ __forceinline__ void for_pairs(int r0, int n0, int gr, int tq, F f) {
  for_frags([&](int mt, int nt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) f(mt, nt, hh, r0 + mt * 16 + gr + 8 * hh, n0 + nt * 8 + 2 * tq);
  });
}
// for_quads: f(mt, np, hh, r, n, in) per 4-column piece of the 16-bit store layout (local_bf16's): an even lane
// columns n .. n + 3 of block 2 np (n = n0 + 16 np + 2 tq), an odd lane of block 2 np + 1 (n = n0 + 16 np + 8 +
// 2 (tq - 1)), same row; in: the piece lies inside P x N (N % 8 == 0: a block is all in or out)
template <typename F>
__device__ __forceinline__ void for_quads(int r0, int n0, int gr, int tq, bool odd, int64_t P, int64_t N, F f) {
#pragma unroll
  for (int q = 0; q < 8; ++q) {  // (mt, np, hh) = (q / 4, q / 2 % 2, q % 2)
    const int mt = q >> 2, np = (q >> 1) & 1, hh = q & 1;
    const int r = r0 + mt * 16 + gr + 8 * hh, na = n0 + np * 16, nb = na + 8;
    f(mt, np, hh, r, odd ? nb + 2 * (tq - 1) : na + 2 * tq, (odd ? nb : na) < N && r < P);
  }
}

__device__ __forceinline__ float warp_sum(float v) {  // xor butterfly: fixed order
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T, bool HAS_Z>
__global__ void __launch_bounds__(kThreads, 2) fused_pass_kernel(BwdParams p, int64_t begin) {
  extern __shared__ __align__(16) unsigned char smem[];
  const PassPlan pl(p.head_dim, p.state_dim, HAS_Z);
  const int64_t H = p.heads, P = p.head_dim, N = p.state_dim, G = p.groups, PN = P * N;
  const int64_t bid = blockIdx.x;
  const int zi = static_cast<int>(bid % pl.zt);
  const int64_t h = (bid / pl.zt) % H, k = bid / (static_cast<int64_t>(pl.zt) * H);
  const int64_t g = h / (H / G);
  const int64_t s = p.level_segments[begin + k];
  const int64_t c0 = p.seg_chunk_offsets[s], c1 = p.seg_chunk_offsets[s + 1];

  int64_t* tok = reinterpret_cast<int64_t*>(smem);                      // [kRing][kL]
  float* el = reinterpret_cast<float*>(smem + kRing * kL * 8);          // [kRing][kL]
  T* raw = reinterpret_cast<T*>(smem + pl.off_raw);                     // [2] x (dout [kL][Pp], z [kL][Pp])
  T* dys = reinterpret_cast<T*>(smem + pl.off_dy);                      // [kL][DP]: e^Lam dy, rounded once
  T* Cs = reinterpret_cast<T*>(smem + pl.off_C);                        // [2][kL][CP]
  const int64_t raw_elems = pl.raw_stage / 2, c_elems = pl.c_stage / 2;

  const int tid = static_cast<int>(threadIdx.x), warp = tid >> 5, lane = tid & 31;
  const int mi = warp / pl.nct, ni = warp % pl.nct;
  const int r0 = mi * 32;                    // the warp tile's first P row
  const int ncol0 = zi * pl.NB;              // the CTA's first N column
  const int n0 = ncol0 + ni * 32;            // the warp tile's first N column
  const bool active = mi < pl.mtiles && n0 < pl.Nc;  // warp-uniform
  const bool odd = (lane & 1) != 0;
  const int tq = lane & 3, gr = lane >> 2;

  const T* dout = static_cast<const T*>(p.dout);
  const T* zz = static_cast<const T*>(p.z);
  const T* Cg = static_cast<const T*>(p.C);
  const T* states = static_cast<const T*>(p.states);
  const auto pairs = [&](auto f) { for_pairs(r0, n0, gr, tq, f); };
  const auto quads = [&](auto f) { for_quads(r0, n0, gr, tq, odd, P, N, f); };

  // ring slot and double-buffer stage of chunk cc (counted from the segment's last chunk)
  const auto slot = [&](int64_t cc) { return static_cast<int>((c1 - 1 - cc) % kRing); };
  const auto stage = [&](int64_t cc) { return static_cast<int>((c1 - 1 - cc) & 1); };

  // chunk cc's dout / z rows and C rows (the CTA's columns) -> stage st by 16-byte cp.async, one group
  const auto issue = [&](int64_t cc, int st) {
    const int64_t* tk = tok + slot(cc) * kL;
    T* rd = raw + st * raw_elems;
    const int dq = pl.Pp / 8;
    for (int e = tid; e < kL * dq; e += kThreads) {
      const int i = e / dq, p0 = (e % dq) * 8;
      const int64_t t = tk[i];
      const bool in = t >= 0 && p0 < P;
      const int64_t off = in ? (t * H + h) * P + p0 : 0;
      mm::cp_async_16(rd + i * pl.Pp + p0, dout + off, in ? 16 : 0);
      if constexpr (HAS_Z) mm::cp_async_16(rd + kL * pl.Pp + i * pl.Pp + p0, zz + off, in ? 16 : 0);
    }
    T* cs = Cs + st * c_elems;
    const int cq = pl.CW / 8;
    for (int e = tid; e < kL * cq; e += kThreads) {
      const int i = e / cq, n = (e % cq) * 8;
      const int64_t t = tk[i], col = ncol0 + n;
      const bool in = t >= 0 && col < N;
      mm::cp_async_16(cs + i * pl.CP + n, in ? Cg + (t * G + g) * N + col : Cg, in ? 16 : 0);
    }
    mm::cp_async_commit();
  };

  // chunk cc's saved states of this warp's tile, in the store layout (8-byte pieces: an even lane holds 4
  // consecutive columns of block 2 np, an odd lane 4 of block 2 np + 1, same row), zero outside P x N
  uint2 sv[2][2][2];
  const auto load_states = [&](int64_t cc) {
    const T* base = states + (cc * H + h) * PN;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int np = 0; np < 2; ++np)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = r0 + mt * 16 + gr + 8 * hh;
          const int na = n0 + np * 16, nb = na + 8;
          const int n = odd ? nb + 2 * (tq - 1) : na + 2 * tq;
          const bool in = (odd ? nb : na) < N && r < P;
          sv[mt][np][hh] = in ? __ldg(reinterpret_cast<const uint2*>(base + static_cast<int64_t>(r) * N + n))
                              : make_uint2(0u, 0u);
        }
  };

  // prologue: the last two chunks' gather rows and e^Lam; the children's gradients summed in order
  if (tid < kL) {
    for (int64_t cc = c1 - 1; cc >= c0 && cc >= c1 - 2; --cc) {
      tok[slot(cc) * kL + tid] = p.gather[cc * kL + tid];
      el[slot(cc) * kL + tid] = expf(p.Lam[(cc * H + h) * kL + tid]);
    }
  }
  mm::FragC carry[2][4];
  for_frags([&](int mt, int nt) { carry[mt][nt].zero(); });
  if (active) {
    const int64_t q0 = p.child_offsets[s], q1 = p.child_offsets[s + 1];
    for (int64_t q = q0; q < q1; ++q) {
      const float* w = p.ws + (p.children[q] * H + h) * PN;
      float2 v[2][4][2];
      pairs([&](int mt, int nt, int hh, int r, int n) {
        v[mt][nt][hh] = r < P && n < N ? *reinterpret_cast<const float2*>(w + static_cast<int64_t>(r) * N + n)
                                       : make_float2(0.f, 0.f);
      });
      pairs([&](int mt, int nt, int hh, int, int) {
        carry[mt][nt].x[2 * hh] += v[mt][nt][hh].x;
        carry[mt][nt].x[2 * hh + 1] += v[mt][nt][hh].y;
      });
    }
  }
  __syncthreads();
  if (c1 > c0) {
    issue(c1 - 1, 0);
    if (active) load_states(c1 - 1);
  }

  const int dq = pl.Pp / 8;
  const int64_t parts = p.ddecay_parts, pslot = static_cast<int64_t>(zi) * kWarps + warp;
  for (int64_t c = c1 - 1; c >= c0; --c) {
    const int ts = slot(c), st = stage(c);
    // chunk c - 2's gather row and Lam: in flight during this step, stored into the ring before its end
    const bool pre2 = c - 2 >= c0;
    int64_t tn = -1;
    float lraw = 0.f;
    if (tid < kL && pre2) {
      tn = p.gather[(c - 2) * kL + tid];
      lraw = p.Lam[((c - 2) * H + h) * kL + tid];
    }
    mm::cp_async_wait<0>();
    __syncthreads();  // chunk c's stage has landed; the previous step's MMA is done with dys and stage st ^ 1
    if (c - 1 >= c0) issue(c - 1, st ^ 1);

    // dy rows of chunk c: e^Lam_i dout z sigmoid(z) (local_bf16's formula and rounding), pad rows / columns 0
    {
      const T* rd = raw + st * raw_elems;
      const float* e_l = el + ts * kL;
      for (int e = tid; e < kL * dq; e += kThreads) {
        const int i = e / dq, p0 = (e % dq) * 8;
        const float sc = e_l[i];
        const uint4 gv = *reinterpret_cast<const uint4*>(rd + i * pl.Pp + p0);
        uint4 zv = make_uint4(0u, 0u, 0u, 0u);
        if constexpr (HAS_Z) zv = *reinterpret_cast<const uint4*>(rd + kL * pl.Pp + i * pl.Pp + p0);
        const uint32_t gw[4] = {gv.x, gv.y, gv.z, gv.w};
        const uint32_t zw[4] = {zv.x, zv.y, zv.z, zv.w};
        uint32_t ow[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) ow[u] = bwd_tiles::scaled_dy2<T, HAS_Z>(gw[u], zw[u], sc);
        *reinterpret_cast<uint4*>(dys + i * pl.DP + p0) = make_uint4(ow[0], ow[1], ow[2], ow[3]);
      }
    }
    if (tid < kL && pre2) {  // slot(c - 2) = slot(c + 1): free since this step's first barrier
      tok[slot(c - 2) * kL + tid] = tn;
      el[slot(c - 2) * kL + tid] = expf(lraw);
    }
    __syncthreads();  // dys complete

    if (active) {
      mm::FragC acc[2][4];
      for_frags([&](int mt, int nt) { acc[mt][nt].zero(); });
      // A(r = p, k = i) = dys[i][p] (stored transposed), B(k = i, n) = C[i][n]
      mm::warp_gemm<T, 2, 4, kL / 16, false, true>(acc, dys + r0, pl.DP, Cs + st * c_elems + ni * 32, pl.CP);

      // ddecay partial <s[c], ds_leave[c]> from the fp32 carry; states shuffled into the accumulator layout
      float part = 0.f;
      quads([&](int mt, int np, int hh, int, int, bool) {
        const uint2 w = sv[mt][np][hh];
        const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w.x : w.y, 1);
        const float2 fa = bwd_tiles::unpack2<T>(odd ? got : w.x), fb = bwd_tiles::unpack2<T>(odd ? w.y : got);
        part = fmaf(fa.x, carry[mt][2 * np].x[2 * hh], part);
        part = fmaf(fa.y, carry[mt][2 * np].x[2 * hh + 1], part);
        part = fmaf(fb.x, carry[mt][2 * np + 1].x[2 * hh], part);
        part = fmaf(fb.y, carry[mt][2 * np + 1].x[2 * hh + 1], part);
      });
      part = warp_sum(part);
      if (lane == 0) p.ddecay_part[(c * H + h) * parts + pslot] = part;

      // ds_leave[c] = carry
      {
        // rounded once (RN); the xor-1 shuffle gives each lane 4 consecutive columns (local_bf16's store)
        T* out = static_cast<T*>(p.ds16) + (c * H + h) * PN;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int np = 0; np < 2; ++np) {
            const int na = n0 + np * 16, nb = na + 8;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const uint32_t a = mm::Elem<T>::pack(carry[mt][2 * np].x[2 * hh], carry[mt][2 * np].x[2 * hh + 1]);
              const uint32_t b =
                  mm::Elem<T>::pack(carry[mt][2 * np + 1].x[2 * hh], carry[mt][2 * np + 1].x[2 * hh + 1]);
              const uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? a : b, 1);
              const int r = r0 + mt * 16 + gr + 8 * hh;
              const int n = odd ? nb + 2 * (tq - 1) : na + 2 * tq;
              if ((odd ? nb : na) < N && r < P)
                *reinterpret_cast<uint2*>(out + static_cast<int64_t>(r) * N + n) = odd ? make_uint2(got, b)
                                                                                         : make_uint2(a, got);
            }
          }
      }
      if (c - 1 >= c0) load_states(c - 1);

      // carry = e^(Lam_last) carry + local (the state pass's fmaf on local_bf16's stored value)
      const float d = el[ts * kL + kL - 1];
      for_frags([&](int mt, int nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float loc = acc[mt][nt].x[e];
          loc = mm::Elem<T>::to_float(mm::Elem<T>::from_float(loc));
          carry[mt][nt].x[e] = fmaf(d, carry[mt][nt].x[e], loc);
        }
      });
    } else if (lane == 0) {
      p.ddecay_part[(c * H + h) * parts + pslot] = 0.f;  // idle warp (padding tile): a zero partial
    }
  }

  if (!active) return;
  float* wso = p.ws + (s * H + h) * PN;
  const int64_t r_idx = p.root_index[s];
  float* dro = r_idx >= 0 && p.droots != nullptr ? p.droots + (r_idx * H + h) * PN : nullptr;
  pairs([&](int mt, int nt, int hh, int r, int n) {
    if (r < P && n < N) {
      const float2 v = make_float2(carry[mt][nt].x[2 * hh], carry[mt][nt].x[2 * hh + 1]);
      const int64_t o = static_cast<int64_t>(r) * N + n;
      *reinterpret_cast<float2*>(wso + o) = v;
      if (dro != nullptr) *reinterpret_cast<float2*>(dro + o) = v;
    }
  });
}

bool aligned(const void* q, uintptr_t a) { return reinterpret_cast<uintptr_t>(q) % a == 0; }
using bwd_tiles::half_type;

template <typename T, bool HAS_Z>
int launch_kernel(const BwdParams& p, int64_t begin, unsigned blocks, cudaStream_t st) {
  const int bytes = static_cast<int>(PassPlan(p.head_dim, p.state_dim, HAS_Z).bytes);
  auto* kern = fused_pass_kernel<T, HAS_Z>;
  cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return static_cast<int>(e);
  kern<<<blocks, kThreads, bytes, st>>>(p, begin);
  return static_cast<int>(cudaGetLastError());
}
template <typename T>
int launch(const BwdParams& p, int64_t begin, unsigned blocks, cudaStream_t st) {
  return p.z != nullptr ? launch_kernel<T, true>(p, begin, blocks, st) : launch_kernel<T, false>(p, begin, blocks, st);
}

}  // namespace

bool ssd_bwd_fused_pass_supported(const BwdParams& p) {
  if (p.chunk != kL || p.head_dim < 1 || p.head_dim > kMaxDim || p.state_dim < 1 || p.state_dim > kMaxDim) return false;
  if (p.head_dim % 8 != 0 || p.state_dim % 8 != 0) return false;
  if (p.groups < 1 || p.heads < 1 || p.heads % p.groups != 0) return false;
  if (!half_type(p.bc_type) || p.dout_type != p.bc_type || p.states_type != p.bc_type) return false;
  if (p.z != nullptr && p.z_type != p.bc_type) return false;
  if (p.ds16 == nullptr || p.ds16_type != p.bc_type) return false;
  if (p.ws == nullptr || p.states == nullptr) return false;
  const void* ds = p.ds16;
  return aligned(p.C, 16) && aligned(p.dout, 16) && (p.z == nullptr || aligned(p.z, 16)) && aligned(p.states, 8) &&
         aligned(ds, 8) && aligned(p.ws, 8) && (p.droots == nullptr || aligned(p.droots, 8));
}

int64_t ssd_bwd_fused_pass_ddecay_parts(const BwdParams& p) {
  return static_cast<int64_t>(PassPlan(p.head_dim, p.state_dim, p.z != nullptr).zt) * kWarps;
}

int ssd_bwd_fused_pass(const BwdParams& p, int64_t begin, int64_t count, void* stream) {
  if (count * p.heads * p.head_dim * p.state_dim == 0) return 0;
  if (!ssd_bwd_fused_pass_supported(p)) return static_cast<int>(cudaErrorInvalidValue);
  if (p.ddecay_part == nullptr || p.ddecay_parts != ssd_bwd_fused_pass_ddecay_parts(p))
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t blocks = count * p.heads * PassPlan(p.head_dim, p.state_dim, p.z != nullptr).zt;
  if (blocks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  const auto st = static_cast<cudaStream_t>(stream);
  const auto b = static_cast<unsigned>(blocks);
  return p.bc_type == BwdType::BFloat16 ? launch<__nv_bfloat16>(p, begin, b, st) : launch<__half>(p, begin, b, st);
}

}  // namespace tree_recurrence::ssd::fused::kernels
