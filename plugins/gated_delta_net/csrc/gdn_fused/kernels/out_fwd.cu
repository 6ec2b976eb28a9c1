// Stage 3 of the fused GDN forward (../gdn_fused.h, params.h): per (chunk, value head) one block of
// 256 threads (8 warps; warp w owns rows 16 (w % 4).. and output columns 64 (w / 4)..), 70 KB of
// shared memory and at most 80 registers (3 blocks per SM, 24 warps); grid value head fastest
// (tile_grid):
//   rows 0..63 of h[c] (K x V) and the q, k rows (through gather) in a first group of cp.async
//   copies, rows 64..127 of h[c] in a second (zero-filled pad rows and columns); q^ = l2norm(q)
//   scale, k^ = l2norm(k) in place (scale_rows_smem, 16-byte shared loads: bit for bit as prep_fwd
//   computes them); rq, q's norm factors, by the hv % groups == 0 block of each key head;
//   S = (q^ k^T) * exp(G_i - G_j) (j <= i; both warps of a row block compute it), rounded to the
//   input type into four A fragments; the k rows are then dead and v_new[c] (64 x V) is copied there
//   while O = q^ h runs (the late copy has all 8 k blocks of q^ h to hide behind); O *= exp(G_i),
//   O += S v_new (tensor cores, fp32 acc); o is staged in the q rows (after a barrier) and written at
//   the chunk's tokens with 16-byte stores.

#include "fwd_common.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileV = 64;         // output columns per warp
constexpr int kLdX = kMaxDim + 8;  // pitch of every tile (q, k, h, v_new, the o staging)

template <typename T>
struct OutSmem {
  T q[kChunk * kLdX];   // q^, then the o staging
  T k[kChunk * kLdX];   // k^, then v_new
  T h[kChunk * kLdX];   // rows 0..63 of h
  T hh[kChunk * kLdX];  // rows 64.. of h
  float G[kChunk];
  int64_t tok[kChunk];
};
static_assert(sizeof(OutSmem<__nv_bfloat16>) == sizeof(OutSmem<__half>), "out: one shared-memory size");

// O += q^ (rows 16 rw.., k blocks kt0..kt1-1) times the rows of h held in hk (h's row 16 kt0 at hk's row 0),
// output columns v0.. (vb16 blocks of 16 at most 4); k blocks in order.
template <typename T>
__device__ __forceinline__ void q_times_h(mm::FragC (&O)[8], const T* q, const T* hk, int rw, int v0, int vb16, int kt0,
                                          int kt1) {
  for (int kt = kt0; kt < kt1; ++kt) {
    const mm::FragA a = mm::load_a_row(q + rw * 16 * kLdX + kt * 16, kLdX);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (np < vb16) {
        mm::FragB b0, b1;
        mm::load_b_kn(b0, b1, hk + (kt - kt0) * 16 * kLdX + v0 + np * 16, kLdX);
        mm::mma<T>(O[2 * np], a, b0);
        mm::mma<T>(O[2 * np + 1], a, b1);
      }
    }
  }
}

// Word c8 (8 elements) of row r of the o staging st (pitch kLdX) to o + token * ldo (nothing for a
// pad row, token < 0).
template <typename T>
__device__ __forceinline__ void store_o_word(T* __restrict__ o, int64_t ldo, const T* st, const int64_t* tok, int r, int c8) {
  const int64_t t = tok[r];
  if (t >= 0) *reinterpret_cast<uint4*>(o + t * ldo + c8 * 8) = *reinterpret_cast<const uint4*>(st + r * kLdX + c8 * 8);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 3) out_fwd_kernel(const OutParams p) {
  OutSmem<T>& s = *reinterpret_cast<OutSmem<T>*>(smem_raw);
  if (tile_chunk() >= p.num_chunks) return;
  const auto [c, hv, HV, HK, groups, hk, K, V] = tile_ids(p);
  const int kb16 = (K + 15) >> 4;
  const int kb_lo = min(kb16, 4);  // k blocks of h in s.h; kb_lo..kb16-1 in h_hi
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rw = warp & 3;
  const int v0 = (warp >> 2) * kTileV;
  const int vt = max(0, min(kTileV, V - v0));
  const int vb16 = (vt + 15) >> 4;
  const int64_t tile = c * HV + hv;
  const T* hp = static_cast<const T*>(p.h) + tile * static_cast<int64_t>(K) * V;
  const T* vnp = static_cast<const T*>(p.v_new) + tile * static_cast<int64_t>(kChunk) * V;
  const bool hi = kb16 > 4;
  T* const h_hi = s.hh;     // h's row 64 at row 0
  const T* const vn = s.k;  // v_new, once k^ is dead (the copy issued late: needed only after all of q^ h)

  // groups: (rows 0..63 of h, q, k), then rows 64.. of h
  cp_tile_async<kThreads>(s.h, kLdX, hp, 0, kb_lo * 16, K, V);
  ChunkRows<kThreads> rows;
  rows.load(p.gather + c * kChunk);
  rows.copy<T>(s.q, kLdX, static_cast<const T*>(p.q), HK, hk, K);
  rows.copy<T>(s.k, kLdX, static_cast<const T*>(p.k), HK, hk, K);
  mm::cp_async_commit();
  if (hi) cp_tile_async<kThreads>(h_hi, kLdX, hp, 64, (kb16 - 4) * 16, K, V);
  mm::cp_async_commit();
  if (tid < kChunk) {
    s.tok[tid] = p.gather[c * kChunk + tid];
    s.G[tid] = p.G[tile * kChunk + tid];
  }
  mm::cp_async_wait<1>();  // h rows 0..63, q, k landed
  __syncthreads();
  scale_rows_smem<T, kWarps>(s.q, kLdX, s.tok, HK, hk, p.l2norm, p.scale, hv % groups == 0 ? p.rq : nullptr,
                             true);
  scale_rows_smem<T, kWarps>(s.k, kLdX, s.tok, HK, hk, p.l2norm, 1.f, nullptr, true);
  __syncthreads();

  // S on the blocks at or below the diagonal, gated, then rounded into A fragments
  mm::FragA Sa[4];
  if (vb16 > 0) {
    mm::FragC S[8];
    lower_nt<T>(S, s.q, s.k, kLdX, rw, kb16);
    // the lane's rows r0 (elements 0, 1), r1 (2, 3) and column pairs: G loaded once each
    const int r0 = rw * 16 + mm::c_row(lane, 0), r1 = rw * 16 + mm::c_row(lane, 2);
    const float g0 = s.G[r0], g1 = s.G[r1];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const bool below = (nt >> 1) <= rw;  // column block at or left of the diagonal one (warp-uniform)
      const int c0 = nt * 8 + mm::c_col(lane, 0);
      const float2 gc = below ? *reinterpret_cast<const float2*>(s.G + c0) : make_float2(0.f, 0.f);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e < 2 ? r0 : r1, col = c0 + (e & 1);
        const float gr = e < 2 ? g0 : g1, gcol = (e & 1) ? gc.y : gc.x;
        S[nt].x[e] = below && col <= r ? S[nt].x[e] * exp_nonpos(gr - gcol) : 0.f;
      }
    }
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) Sa[kt] = mm::c_to_a<T>(S[2 * kt], S[2 * kt + 1]);
  }
  __syncthreads();  // every warp is done reading k^: v_new goes there
  cp_tile_async<kThreads>(s.k, kLdX, vnp, 0, kChunk, kChunk, V);
  mm::cp_async_commit();

  // O = q^ h, k blocks 0..3 from s.h while the last group flies, then 4.. from h_hi
  mm::FragC O[8];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) O[nt].zero();
  if (vb16 > 0) q_times_h<T>(O, s.q, s.h, rw, v0, vb16, 0, kb_lo);
  mm::cp_async_wait<1>();
  __syncthreads();  // rows 64.. of h (the second group) visible to every warp; v_new may still fly
  if (vb16 > 0) q_times_h<T>(O, s.q, h_hi, rw, v0, vb16, 4, kb16);
  mm::cp_async_wait<0>();
  __syncthreads();  // v_new visible to every warp
  if (vb16 > 0) {
    const float e0 = exp_nonpos(s.G[rw * 16 + mm::c_row(lane, 0)]);
    const float e1 = exp_nonpos(s.G[rw * 16 + mm::c_row(lane, 2)]);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      O[nt].x[0] *= e0;
      O[nt].x[1] *= e0;
      O[nt].x[2] *= e1;
      O[nt].x[3] *= e1;
    }
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) {
      if (kt <= rw) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (np < vb16) {
            mm::FragB b0, b1;
            mm::load_b_kn(b0, b1, vn + kt * 16 * kLdX + v0 + np * 16, kLdX);
            mm::mma<T>(O[2 * np], Sa[kt], b0);
            mm::mma<T>(O[2 * np + 1], Sa[kt], b1);
          }
        }
      }
    }
  }
  __syncthreads();  // every warp is done reading q^ (its rows become the o staging)
  if (vb16 == 0) return;  // no barrier follows
  T* st = s.q + v0;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    if ((nt >> 1) < vb16) {
      const int col = nt * 8 + mm::c_col(lane, 0);
      const int r0 = rw * 16 + mm::c_row(lane, 0), r1 = rw * 16 + mm::c_row(lane, 2);
      *reinterpret_cast<uint32_t*>(st + r0 * kLdX + col) = mm::Elem<T>::pack(O[nt].x[0], O[nt].x[1]);
      *reinterpret_cast<uint32_t*>(st + r1 * kLdX + col) = mm::Elem<T>::pack(O[nt].x[2], O[nt].x[3]);
    }
  }
  __syncwarp();
  T* o = static_cast<T*>(p.o) + static_cast<int64_t>(hv) * V + v0;  // token t's row at o + t HV V
  const int64_t ldo = static_cast<int64_t>(HV) * V;
  const int per_row = vt >> 3;
  if (per_row == kTileV / 8) {  // the full 64-column half: constant shifts, unrolled (same words, same lanes)
#pragma unroll
    for (int i = lane; i < 16 * (kTileV / 8); i += 32) store_o_word(o, ldo, st, s.tok, rw * 16 + (i >> 3), i & 7);
    return;
  }
  for (int i = lane; i < 16 * per_row; i += 32) store_o_word(o, ldo, st, s.tok, rw * 16 + i / per_row, i % per_row);
}

}  // namespace

const char* launch_out_fwd(const OutParams& p, void* cuda_stream) {
  return launch_checked(out_fwd_kernel<__nv_bfloat16>, out_fwd_kernel<__half>, kThreads,
                        static_cast<int>(sizeof(OutSmem<__half>)), p, cuda_stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
