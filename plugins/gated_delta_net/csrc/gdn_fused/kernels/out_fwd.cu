// Stage 3 of the fused GDN forward (../gdn_fused.h, params.h): per (chunk, value head) one block of
// 256 threads (8 warps; warp w owns rows 16 (w % 4).. and output columns 64 (w / 4)..), 86 KB of
// shared memory (2 blocks per SM):
//   q, k rows (through gather), h[c] (K x V) and v_new[c] (64 x V) in one batch of cp.async copies
//   (zero-filled pad rows and columns); q^ = l2norm(q) scale, k^ = l2norm(k) in place (recomputed
//   bit for bit as prep_fwd computes them); S = (q^ k^T) * exp(G_i - G_j) (j <= i) kept in
//   registers as the A operand of S v_new (tensor cores, fp32 acc; both warps of a row block compute
//   it); o = exp(G_i) (q^ h) + S v_new, staged in shared memory (the k rows, dead by then) and
//   written at the chunk's tokens with 16-byte stores.
// That is version 1 (TREE_RECURRENCE_GDN_OUT_V1=1); version 2 (out_fwd_kernel_v2, the default) is
// the same math in the same order in 70 KB and <= 80 registers (3 blocks per SM), h staged 64 rows
// at a time (see there).
#include <cstdlib>

#include "fwd_common.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kTileV = 64;         // output columns per warp
constexpr int kLdX = kMaxDim + 8;  // pitch of every tile (q, k, h, v_new, the o staging)

template <typename T>
struct OutSmem {
  T q[kChunk * kLdX];
  T k[kChunk * kLdX];  // k^, then the o staging
  T h[kMaxDim * kLdX];
  T vn[kChunk * kLdX];
  float G[kChunk];
  int64_t tok[kChunk];
};

template <typename T>
__global__ void __launch_bounds__(kThreads, 2) out_fwd_kernel(const OutParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  OutSmem<T>& s = *reinterpret_cast<OutSmem<T>*>(smem_raw);
  const int64_t c = blockIdx.x;
  const int hv = blockIdx.y;
  const int HV = p.value_heads, HK = p.key_heads, groups = HV / HK, hk = hv / groups;
  const int K = p.k_dim, V = p.v_dim;
  const int kb16 = (K + 15) >> 4;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rw = warp & 3;             // row block
  const int v0 = (warp >> 2) * kTileV;  // first output column of this warp
  const int vt = max(0, min(kTileV, V - v0));  // valid columns of this warp (multiple of 8, maybe 0)
  const int vb16 = (vt + 15) >> 4;
  const int64_t tile = c * HV + hv;

  // h (K rows, padded to a multiple of 16 with zeros) and v_new, by cp.async (zero-filled past V)
  {
    const T* hp = static_cast<const T*>(p.h) + tile * static_cast<int64_t>(K) * V;
    const int rows = kb16 * 16;
    for (int i = tid; i < rows * (kMaxDim / 8); i += kThreads) {
      const int r = i >> 4, c8 = i & 15;
      const bool ok = r < K && c8 * 8 < V;
      const T* src = ok ? hp + static_cast<int64_t>(r) * V + c8 * 8 : hp;
      mm::cp_async_16(s.h + r * kLdX + c8 * 8, src, ok ? 16 : 0);
    }
    const T* vp = static_cast<const T*>(p.v_new) + tile * static_cast<int64_t>(kChunk) * V;
    for (int i = tid; i < kChunk * (kMaxDim / 8); i += kThreads) {
      const int r = i >> 4, c8 = i & 15;
      const bool ok = c8 * 8 < V;
      const T* src = ok ? vp + static_cast<int64_t>(r) * V + c8 * 8 : vp;
      mm::cp_async_16(s.vn + r * kLdX + c8 * 8, src, ok ? 16 : 0);
    }
  }
  if (tid < kChunk) {
    s.tok[tid] = p.gather[c * kChunk + tid];
    s.G[tid] = p.G[tile * kChunk + tid];
  }
  __syncthreads();
  cp_rows_async<T>(s.q, kLdX, static_cast<const T*>(p.q), s.tok, HK, hk, K);
  cp_rows_async<T>(s.k, kLdX, static_cast<const T*>(p.k), s.tok, HK, hk, K);
  mm::cp_async_commit();
  mm::cp_async_wait<0>();
  __syncthreads();
  scale_rows_smem<T, kWarps>(s.q, kLdX, s.tok, HK, hk, p.use_qk_l2norm, p.scale, nullptr, true);
  scale_rows_smem<T, kWarps>(s.k, kLdX, s.tok, HK, hk, p.use_qk_l2norm, 1.f, nullptr, true);
  __syncthreads();

  // S = q^ k^T on the blocks at or below the diagonal, gated
  mm::FragC S[8];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) S[nt].zero();
  if (vb16 > 0) {
    for (int kt = 0; kt < kb16; ++kt) {
      const mm::FragA a = mm::load_a_row(s.q + rw * 16 * kLdX + kt * 16, kLdX);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np <= rw) {
          mm::FragB b0, b1;
          mm::load_b_nk(b0, b1, s.k + np * 16 * kLdX + kt * 16, kLdX);
          mm::mma<T>(S[2 * np], a, b0);
          mm::mma<T>(S[2 * np + 1], a, b1);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = rw * 16 + mm::c_row(lane, e), col = nt * 8 + mm::c_col(lane, e);
        S[nt].x[e] = col <= r ? S[nt].x[e] * exp_nonpos(s.G[r] - s.G[col]) : 0.f;
      }
  }
  __syncthreads();  // every warp is done reading k^ (its rows become the o staging)
  if (vb16 == 0) return;  // V <= 64: the second column half has nothing to do (no barrier follows)

  // O = q^ h (K x this warp's columns), rows times exp(G_i)
  mm::FragC O[8];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) O[nt].zero();
  for (int kt = 0; kt < kb16; ++kt) {
    const mm::FragA a = mm::load_a_row(s.q + rw * 16 * kLdX + kt * 16, kLdX);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (np < vb16) {
        mm::FragB b0, b1;
        mm::load_b_kn(b0, b1, s.h + kt * 16 * kLdX + v0 + np * 16, kLdX);
        mm::mma<T>(O[2 * np], a, b0);
        mm::mma<T>(O[2 * np + 1], a, b1);
      }
    }
  }
  {
    const float e0 = exp_nonpos(s.G[rw * 16 + mm::c_row(lane, 0)]);
    const float e1 = exp_nonpos(s.G[rw * 16 + mm::c_row(lane, 2)]);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      O[nt].x[0] *= e0;
      O[nt].x[1] *= e0;
      O[nt].x[2] *= e1;
      O[nt].x[3] *= e1;
    }
  }
  // O += S v_new (k blocks <= rw)
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    if (kt <= rw) {
      const mm::FragA a = mm::c_to_a<T>(S[2 * kt], S[2 * kt + 1]);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np < vb16) {
          mm::FragB b0, b1;
          mm::load_b_kn(b0, b1, s.vn + kt * 16 * kLdX + v0 + np * 16, kLdX);
          mm::mma<T>(O[2 * np], a, b0);
          mm::mma<T>(O[2 * np + 1], a, b1);
        }
      }
    }
  }

  // stage this warp's 16 x 64 piece in the k rows (disjoint per warp), then 16-byte stores
  T* st = s.k + v0;
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
  T* o = static_cast<T*>(p.o);
  const int per_row = vt >> 3;
  for (int i = lane; i < 16 * per_row; i += 32) {
    const int r = rw * 16 + i / per_row, c8 = i % per_row;
    const int64_t t = s.tok[r];
    if (t >= 0)
      *reinterpret_cast<uint4*>(o + (t * HV + hv) * static_cast<int64_t>(V) + v0 + c8 * 8) =
          *reinterpret_cast<const uint4*>(st + r * kLdX + c8 * 8);
  }
}

// Version 2 (the default; TREE_RECURRENCE_GDN_OUT_V1=1 gives version 1 above): the same math in
// the same order (bit for bit the same o), 70 KB of shared memory and at most 80 registers (3 blocks
// per SM, 24 warps): h is staged 64 rows at a time. Rows 0..63 of h, q, k are copied first, v_new
// in a second group (waited for with rows 64.. of h); after S = q^ k^T the k rows are dead and
// rows 64..127 of h are copied there (cp.async) while O = q^ h[0:64] runs; then O += q^ h[64:128], O *= exp(G_i), O += S v_new; o is
// staged in the q rows (after a barrier) and written with 16-byte stores. S is kept as four A
// fragments (rounded to the input type right after gating: the same rounding c_to_a does in
// version 1).
template <typename T>
struct OutSmem2 {
  T q[kChunk * kLdX];   // q^, then the o staging
  T k[kChunk * kLdX];   // k^, then rows 64.. of h
  T h[kChunk * kLdX];   // rows 0..63 of h
  T vn[kChunk * kLdX];
  float G[kChunk];
  int64_t tok[kChunk];
};

// cp.async copies of rows r0..r0+nrows-1 of h (K x V, zero rows past K, zero columns past V) into
// dst (pitch kLdX).
template <typename T>
__device__ __forceinline__ void cp_h_rows(T* dst, const T* __restrict__ hp, int r0, int nrows, int K, int V) {
  for (int i = threadIdx.x; i < nrows * (kMaxDim / 8); i += kThreads) {
    const int r = i >> 4, c8 = i & 15;
    const bool ok = r0 + r < K && c8 * 8 < V;
    const T* src = ok ? hp + static_cast<int64_t>(r0 + r) * V + c8 * 8 : hp;
    mm::cp_async_16(dst + r * kLdX + c8 * 8, src, ok ? 16 : 0);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 3) out_fwd_kernel_v2(const OutParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  OutSmem2<T>& s = *reinterpret_cast<OutSmem2<T>*>(smem_raw);
  const int64_t c = blockIdx.x;
  const int hv = blockIdx.y;
  const int HV = p.value_heads, HK = p.key_heads, groups = HV / HK, hk = hv / groups;
  const int K = p.k_dim, V = p.v_dim;
  const int kb16 = (K + 15) >> 4;
  const int kb_lo = min(kb16, 4);  // k blocks of h in s.h; kb_lo..kb16-1 later in s.k
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rw = warp & 3;
  const int v0 = (warp >> 2) * kTileV;
  const int vt = max(0, min(kTileV, V - v0));
  const int vb16 = (vt + 15) >> 4;
  const int64_t tile = c * HV + hv;
  const T* hp = static_cast<const T*>(p.h) + tile * static_cast<int64_t>(K) * V;

  // groups: (rows 0..63 of h, q, k), then v_new (waited for only before S v_new)
  cp_h_rows<T>(s.h, hp, 0, kb_lo * 16, K, V);
  if (tid < kChunk) {
    s.tok[tid] = p.gather[c * kChunk + tid];
    s.G[tid] = p.G[tile * kChunk + tid];
  }
  __syncthreads();
  cp_rows_async<T>(s.q, kLdX, static_cast<const T*>(p.q), s.tok, HK, hk, K);
  cp_rows_async<T>(s.k, kLdX, static_cast<const T*>(p.k), s.tok, HK, hk, K);
  mm::cp_async_commit();
  {
    const T* vp = static_cast<const T*>(p.v_new) + tile * static_cast<int64_t>(kChunk) * V;
    for (int i = tid; i < kChunk * (kMaxDim / 8); i += kThreads) {
      const int r = i >> 4, c8 = i & 15;
      const bool ok = c8 * 8 < V;
      const T* src = ok ? vp + static_cast<int64_t>(r) * V + c8 * 8 : vp;
      mm::cp_async_16(s.vn + r * kLdX + c8 * 8, src, ok ? 16 : 0);
    }
  }
  mm::cp_async_commit();
  mm::cp_async_wait<1>();  // h rows 0..63, q, k landed
  __syncthreads();
  scale_rows_smem<T, kWarps>(s.q, kLdX, s.tok, HK, hk, p.use_qk_l2norm, p.scale, nullptr, true);
  scale_rows_smem<T, kWarps>(s.k, kLdX, s.tok, HK, hk, p.use_qk_l2norm, 1.f, nullptr, true);
  __syncthreads();

  // S (as in version 1), then rounded into A fragments
  mm::FragA Sa[4];
  if (vb16 > 0) {
    mm::FragC S[8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) S[nt].zero();
    for (int kt = 0; kt < kb16; ++kt) {
      const mm::FragA a = mm::load_a_row(s.q + rw * 16 * kLdX + kt * 16, kLdX);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np <= rw) {
          mm::FragB b0, b1;
          mm::load_b_nk(b0, b1, s.k + np * 16 * kLdX + kt * 16, kLdX);
          mm::mma<T>(S[2 * np], a, b0);
          mm::mma<T>(S[2 * np + 1], a, b1);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = rw * 16 + mm::c_row(lane, e), col = nt * 8 + mm::c_col(lane, e);
        S[nt].x[e] = col <= r ? S[nt].x[e] * exp_nonpos(s.G[r] - s.G[col]) : 0.f;
      }
#pragma unroll
    for (int kt = 0; kt < 4; ++kt) Sa[kt] = mm::c_to_a<T>(S[2 * kt], S[2 * kt + 1]);
  }
  __syncthreads();  // every warp is done reading k^: rows 64.. of h go there
  const bool hi = kb16 > 4;
  if (hi) cp_h_rows<T>(s.k, hp, 64, (kb16 - 4) * 16, K, V);
  mm::cp_async_commit();

  // O = q^ h, k blocks 0..3 from s.h while rows 64.. fly, then 4.. from s.k (same order as v1)
  mm::FragC O[8];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) O[nt].zero();
  if (vb16 > 0) {
    for (int kt = 0; kt < kb_lo; ++kt) {
      const mm::FragA a = mm::load_a_row(s.q + rw * 16 * kLdX + kt * 16, kLdX);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np < vb16) {
          mm::FragB b0, b1;
          mm::load_b_kn(b0, b1, s.h + kt * 16 * kLdX + v0 + np * 16, kLdX);
          mm::mma<T>(O[2 * np], a, b0);
          mm::mma<T>(O[2 * np + 1], a, b1);
        }
      }
    }
  }
  mm::cp_async_wait<0>();
  __syncthreads();  // rows 64.. of h and v_new visible to every warp
  if (vb16 > 0) {
    for (int kt = 4; kt < kb16; ++kt) {
      const mm::FragA a = mm::load_a_row(s.q + rw * 16 * kLdX + kt * 16, kLdX);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np < vb16) {
          mm::FragB b0, b1;
          mm::load_b_kn(b0, b1, s.k + (kt - 4) * 16 * kLdX + v0 + np * 16, kLdX);
          mm::mma<T>(O[2 * np], a, b0);
          mm::mma<T>(O[2 * np + 1], a, b1);
        }
      }
    }
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
            mm::load_b_kn(b0, b1, s.vn + kt * 16 * kLdX + v0 + np * 16, kLdX);
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
  T* o = static_cast<T*>(p.o);
  const int per_row = vt >> 3;
  for (int i = lane; i < 16 * per_row; i += 32) {
    const int r = rw * 16 + i / per_row, c8 = i % per_row;
    const int64_t t = s.tok[r];
    if (t >= 0)
      *reinterpret_cast<uint4*>(o + (t * HV + hv) * static_cast<int64_t>(V) + v0 + c8 * 8) =
          *reinterpret_cast<const uint4*>(st + r * kLdX + c8 * 8);
  }
}

// TREE_RECURRENCE_GDN_OUT_V1=1 (read once): version 1.
bool use_v1() {
  static const bool on = [] {
    const char* e = std::getenv("TREE_RECURRENCE_GDN_OUT_V1");
    return e != nullptr && e[0] == '1';
  }();
  return on;
}

template <typename T>
const char* launch_v2(const OutParams& p, cudaStream_t stream) {
  const int smem = static_cast<int>(sizeof(OutSmem2<T>));
  cudaError_t e = cudaFuncSetAttribute(out_fwd_kernel_v2<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  // the largest shared-memory carveout (a hint: 3 / 4 blocks per SM need it)
  e = cudaFuncSetAttribute(out_fwd_kernel_v2<T>, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  const dim3 grid(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.value_heads));
  out_fwd_kernel_v2<T><<<grid, kThreads, smem, stream>>>(p);
  return launch_error(cudaGetLastError());
}

template <typename T>
const char* launch(const OutParams& p, cudaStream_t stream) {
  if (p.num_chunks == 0) return "";
  if (!use_v1()) return launch_v2<T>(p, stream);
  const int smem = static_cast<int>(sizeof(OutSmem<T>));
  cudaError_t e = cudaFuncSetAttribute(out_fwd_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  const dim3 grid(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.value_heads));
  out_fwd_kernel<T><<<grid, kThreads, smem, stream>>>(p);
  return launch_error(cudaGetLastError());
}

}  // namespace

const char* launch_out_fwd(const OutParams& p, void* cuda_stream) {
  if (p.k_dim < 8 || p.k_dim > kMaxDim || p.k_dim % 8 || p.v_dim < 8 || p.v_dim > kMaxDim || p.v_dim % 8)
    return "gdn fused out: K and V must be multiples of 8 in 8..128";
  if (p.num_chunks > 0x7fffffffLL || p.value_heads > 65535 || p.key_heads <= 0 || p.value_heads % p.key_heads)
    return "gdn fused out: chunks must be < 2^31, value heads <= 65535 and a multiple of key heads";
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  return p.in == InType::BFloat16 ? launch<__nv_bfloat16>(p, stream) : launch<__half>(p, stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
