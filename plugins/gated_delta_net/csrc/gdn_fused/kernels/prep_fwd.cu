// Stage 1 of the fused GDN forward (../gdn_fused.h, params.h): per (chunk, value head) one block of
// 128 threads (4 warps, warp w owns rows 16w..16w+15):
//   1. rows through gather (half a warp per row, 16-byte loads): k^ = l2norm(k), v, g, beta
//      (pad rows zero); rq, rk written by the hv % groups == 0 block;
//   2. G = cumsum(g) (one thread, sequential: G is non-increasing exactly), decay = exp(G_63);
//   3. A_ij = beta_i exp(G_i - G_j) <k^_i, k^_j>, j < i (K K^T on tensor cores, fp32 acc), and
//      kd_j = exp(G_63 - G_j) k^_j;
//   4. Ainv = (I + A)^-1 by forward substitution in fp32 (one thread per column, the column in
//      registers, a fixed order: deterministic);
//   5. w = (Ainv diag(beta exp G)) k^, u = (Ainv diag(beta)) v on tensor cores (operands rounded to
//      the input type, fp32 acc), staged in shared memory and stored with 16-byte writes.
// Every exponent is min(., 0) (G is non-increasing, so this only guards against g > 0 input).
#include "fwd_common.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace {

constexpr int kThreads = 128;
constexpr int kLdX = kMaxDim + 8;  // pitch of the k / v rows (elements)
constexpr int kLdA = kChunk + 4;   // fp32 A pitch (floats; 16-byte rows)
constexpr int kLdI = kChunk + 8;   // pitch of the Ainv operands (elements)

template <typename T>
struct PrepSmem {
  T k[kChunk * kLdX];
  T v[kChunk * kLdX];
  float A[kChunk * kLdA];
  T ainv[kChunk * kLdI];
  T ab[kChunk * kLdI];
  T abg[kChunk * kLdI];
  float graw[kChunk];
  float G[kChunk];
  float beta[kChunk];
  int64_t tok[kChunk];
};

// acc (16 x 128, 16 tiles of 8 columns, only the first ncols columns) rounded into rows
// 16 * warp.. of dst (pitch kLdX).
template <typename T>
__device__ __forceinline__ void stash(T* dst, const mm::FragC (&acc)[16], int warp, int nblocks16) {
  const int l = mm::lane_id();
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    if ((nt >> 1) < nblocks16) {
      const int col = nt * 8 + mm::c_col(l, 0);
      const int r0 = warp * 16 + mm::c_row(l, 0), r1 = warp * 16 + mm::c_row(l, 2);
      *reinterpret_cast<uint32_t*>(dst + r0 * kLdX + col) = mm::Elem<T>::pack(acc[nt].x[0], acc[nt].x[1]);
      *reinterpret_cast<uint32_t*>(dst + r1 * kLdX + col) = mm::Elem<T>::pack(acc[nt].x[2], acc[nt].x[3]);
    }
  }
}

// acc = Op (16 x 64, rows 16 * warp.. of op, pitch kLdI; lower block triangular: k blocks <= warp)
// times X (64 x 16 * nblocks16, pitch kLdX).
template <typename T>
__device__ __forceinline__ void lower_times(mm::FragC (&acc)[16], const T* op, const T* X, int warp, int nblocks16) {
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) acc[nt].zero();
#pragma unroll
  for (int kt = 0; kt < 4; ++kt) {
    if (kt > warp) break;
    const mm::FragA a = mm::load_a_row(op + warp * 16 * kLdI + kt * 16, kLdI);
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      if (np < nblocks16) {
        mm::FragB b0, b1;
        mm::load_b_kn(b0, b1, X + kt * 16 * kLdX + np * 16, kLdX);
        mm::mma<T>(acc[2 * np], a, b0);
        mm::mma<T>(acc[2 * np + 1], a, b1);
      }
    }
  }
}

// 64 rows x ncols (multiple of 8) from shared (pitch kLdX) to global rows of pitch ncols, 16 bytes
// per thread and step.
template <typename T>
__device__ __forceinline__ void store_rows(T* __restrict__ dst, const T* src, int ncols) {
  const int per_row = ncols >> 3;
  for (int i = threadIdx.x; i < kChunk * per_row; i += blockDim.x) {
    const int r = i / per_row, c8 = i - r * per_row;
    *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(r) * ncols + c8 * 8) =
        *reinterpret_cast<const uint4*>(src + r * kLdX + c8 * 8);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) prep_fwd_kernel(const PrepParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  PrepSmem<T>& s = *reinterpret_cast<PrepSmem<T>*>(smem_raw);
  const int64_t c = blockIdx.x;
  const int hv = blockIdx.y;
  const int HV = p.value_heads, HK = p.key_heads, groups = HV / HK, hk = hv / groups;
  const int K = p.k_dim, V = p.v_dim;
  const int kb16 = (K + 15) >> 4, vb16 = (V + 15) >> 4;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t tile = c * HV + hv;  // (chunk, value head)

  if (tid < kChunk) {
    const int64_t t = p.gather[c * kChunk + tid];
    s.tok[tid] = t;
    s.graw[tid] = t >= 0 ? p.g[t * HV + hv] : 0.f;
    s.beta[tid] = t >= 0 ? p.beta[t * HV + hv] : 0.f;
  }
  __syncthreads();

  // 1. rows
  const bool writer = hv % groups == 0;
  load_rows_scaled<T>(s.k, kLdX, static_cast<const T*>(p.k), s.tok, HK, hk, K, p.use_qk_l2norm, 1.f,
                      writer ? p.rk : nullptr);
  if (writer) {
    // q is read here only for its norms (the out stage recomputes q^ itself)
    for (int r0 = warp * 2; r0 < kChunk; r0 += (kThreads / 32) * 2) {
      const int row = r0 + (lane >> 4), hl = lane & 15;
      const int64_t tok = s.tok[row];
      float ss = 0.f;
      if (p.use_qk_l2norm) {
        if (tok >= 0 && hl * 8 < K) {
          float f[8];
          unpack8<T>(*reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + (tok * HK + hk) * static_cast<int64_t>(K) + hl * 8), f);
#pragma unroll
          for (int i = 0; i < 8; ++i) ss = fmaf(f[i], f[i], ss);
        }
#pragma unroll
        for (int off = 8; off >= 1; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      }
      if (hl == 0 && tok >= 0) p.rq[tok * HK + hk] = p.use_qk_l2norm ? rsqrtf(ss + 1e-6f) : 1.f;
    }
  }
  // v rows (no scaling), 16-byte loads, zeros past V and for pad rows
  {
    const T* vp = static_cast<const T*>(p.v);
    for (int r0 = warp * 2; r0 < kChunk; r0 += (kThreads / 32) * 2) {
      const int row = r0 + (lane >> 4), hl = lane & 15;
      const int64_t tok = s.tok[row];
      uint4 raw = make_uint4(0u, 0u, 0u, 0u);
      if (tok >= 0 && hl * 8 < V) raw = *reinterpret_cast<const uint4*>(vp + (tok * HV + hv) * static_cast<int64_t>(V) + hl * 8);
      *reinterpret_cast<uint4*>(s.v + row * kLdX + hl * 8) = raw;
    }
  }
  // 2. the chunk-local cumsum (sequential: exactly non-increasing for g <= 0)
  if (tid == 0) {
    float acc = 0.f;
#pragma unroll 16
    for (int i = 0; i < kChunk; ++i) {
      acc += s.graw[i];
      s.G[i] = acc;
    }
    p.decay[tile] = exp_nonpos(acc);
  }
  __syncthreads();
  if (tid < kChunk) p.G[tile * kChunk + tid] = s.G[tid];

  // 3a. A = beta_i exp(G_i - G_j) (K K^T)_ij, strictly lower (rows of this warp; columns of blocks <= warp)
  {
    mm::FragC acc[8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) acc[nt].zero();
    for (int kt = 0; kt < kb16; ++kt) {
      const mm::FragA a = mm::load_a_row(s.k + warp * 16 * kLdX + kt * 16, kLdX);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np <= warp) {
          mm::FragB b0, b1;
          mm::load_b_nk(b0, b1, s.k + np * 16 * kLdX + kt * 16, kLdX);
          mm::mma<T>(acc[2 * np], a, b0);
          mm::mma<T>(acc[2 * np + 1], a, b1);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = warp * 16 + mm::c_row(lane, e), col = nt * 8 + mm::c_col(lane, e);
        const float val = col < r ? s.beta[r] * exp_nonpos(s.G[r] - s.G[col]) * acc[nt].x[e] : 0.f;
        s.A[r * kLdA + col] = val;
      }
  }
  // 3b. kd_j = exp(G_63 - G_j) k^_j (16-byte stores)
  {
    T* kd = static_cast<T*>(p.kd) + tile * kChunk * K;
    const int per_row = K >> 3;
    const float last = s.G[kChunk - 1];
    for (int i = tid; i < kChunk * per_row; i += kThreads) {
      const int r = i / per_row, c8 = i - r * per_row;
      float f[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(s.k + r * kLdX + c8 * 8), f);
      const float d = exp_nonpos(last - s.G[r]);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] *= d;
      *reinterpret_cast<uint4*>(kd + static_cast<int64_t>(r) * K + c8 * 8) = pack8<T>(f);
    }
  }
  __syncthreads();

  // 4. Ainv = (I + A)^-1: thread `col` solves (I + A) x = e_col top-down, x in registers.
  if (tid < kChunk) {
    const int col = tid;
    float x[kChunk];
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      float acc = i == col ? 1.f : 0.f;
      const float* Ai = s.A + i * kLdA;
#pragma unroll
      for (int j = 0; j + 3 < i; j += 4) {
        const float4 a4 = *reinterpret_cast<const float4*>(Ai + j);
        acc = fmaf(-a4.x, x[j], acc);
        acc = fmaf(-a4.y, x[j + 1], acc);
        acc = fmaf(-a4.z, x[j + 2], acc);
        acc = fmaf(-a4.w, x[j + 3], acc);
      }
#pragma unroll
      for (int j = i & ~3; j < i; ++j) acc = fmaf(-Ai[j], x[j], acc);
      x[i] = acc;
    }
    const float b = s.beta[col], bg = b * exp_nonpos(s.G[col]);
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      s.ainv[i * kLdI + col] = mm::Elem<T>::from_float(x[i]);
      s.ab[i * kLdI + col] = mm::Elem<T>::from_float(x[i] * b);
      s.abg[i * kLdI + col] = mm::Elem<T>::from_float(x[i] * bg);
    }
  }
  __syncthreads();

  // Ainv out (64 x 64)
  {
    T* dst = static_cast<T*>(p.Ainv) + tile * kChunk * kChunk;
    for (int i = tid; i < kChunk * 8; i += kThreads) {
      const int r = i >> 3, c8 = i & 7;
      *reinterpret_cast<uint4*>(dst + r * kChunk + c8 * 8) = *reinterpret_cast<const uint4*>(s.ainv + r * kLdI + c8 * 8);
    }
  }
  // 5. w, u
  mm::FragC acc[16];
  lower_times<T>(acc, s.abg, s.k, warp, kb16);
  __syncthreads();  // every warp is done reading k^
  stash<T>(s.k, acc, warp, kb16);
  lower_times<T>(acc, s.ab, s.v, warp, vb16);
  __syncthreads();  // every warp is done reading v
  stash<T>(s.v, acc, warp, vb16);
  __syncthreads();
  store_rows<T>(static_cast<T*>(p.w) + tile * kChunk * K, s.k, K);
  store_rows<T>(static_cast<T*>(p.u) + tile * kChunk * V, s.v, V);
}

template <typename T>
const char* launch(const PrepParams& p, cudaStream_t stream) {
  if (p.num_chunks == 0) return "";
  const int smem = static_cast<int>(sizeof(PrepSmem<T>));
  cudaError_t e = cudaFuncSetAttribute(prep_fwd_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  const dim3 grid(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.value_heads));
  prep_fwd_kernel<T><<<grid, kThreads, smem, stream>>>(p);
  return launch_error(cudaGetLastError());
}

}  // namespace

const char* launch_prep_fwd(const PrepParams& p, void* cuda_stream) {
  if (p.k_dim < 8 || p.k_dim > kMaxDim || p.k_dim % 8 || p.v_dim < 8 || p.v_dim > kMaxDim || p.v_dim % 8)
    return "gdn fused prep: K and V must be multiples of 8 in 8..128";
  if (p.num_chunks > 0x7fffffffLL || p.value_heads > 65535 || p.key_heads <= 0 || p.value_heads % p.key_heads)
    return "gdn fused prep: chunks must be < 2^31, value heads <= 65535 and a multiple of key heads";
  auto stream = static_cast<cudaStream_t>(cuda_stream);
  return p.in == InType::BFloat16 ? launch<__nv_bfloat16>(p, stream) : launch<__half>(p, stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
