// (d) of the fused GDN backward: dq, dk at the tokens. One warp per (token, key head): the value
// heads of the key head summed in increasing order (no atomics), times scale for q, then
// l2norm's backward (y = x r: dx = r (dy - y <y, dy>), the dot a fixed butterfly).
#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

template <typename T>
__device__ __forceinline__ void finalize_one(const T* x, const float* r, const float* dhv, float* out, int64_t t, int64_t hk,
                                             int64_t flat, const GdnBwdParams& p, float scale) {
  const int K = static_cast<int>(p.k_dim), lane = threadIdx.x & 31;
  const int64_t HK = p.hk, HV = p.hv, groups = HV / HK, c = flat / C, pos = flat % C;
  float dy[kBwdMaxDim / 32], y[kBwdMaxDim / 32];
  const float rr = p.use_qk_l2norm ? r[t * HK + hk] : 1.f;
  float dot = 0.f;
#pragma unroll
  for (int m = 0; m < kBwdMaxDim / 32; ++m) {
    const int col = lane + 32 * m;
    dy[m] = 0.f;
    y[m] = 0.f;
    if (col < K) {
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int64_t hv = hk * groups + gi;
        dy[m] += dhv[((c * HV + hv) * C + pos) * K + col];
      }
      dy[m] *= scale;
      y[m] = mma::Elem<T>::to_float(x[(t * HK + hk) * K + col]) * rr;
      dot += y[m] * dy[m];
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
#pragma unroll
  for (int m = 0; m < kBwdMaxDim / 32; ++m) {
    const int col = lane + 32 * m;
    if (col < K) out[(t * HK + hk) * K + col] = p.use_qk_l2norm ? rr * (dy[m] - y[m] * dot) : dy[m];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) finalize_kernel(GdnBwdParams p) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (item >= p.tokens * p.hk) return;
  const int64_t t = item / p.hk, hk = item % p.hk, flat = p.scatter[t];
  finalize_one<T>(static_cast<const T*>(p.q), p.rq, p.dq_hv, p.dq, t, hk, flat, p, p.scale);
  finalize_one<T>(static_cast<const T*>(p.k), p.rk, p.dk_hv, p.dk, t, hk, flat, p, 1.f);
}

template <typename T>
const char* launch(const GdnBwdParams& p, void* stream) {
  const int64_t items = p.tokens * p.hk;
  if (items == 0) return "";
  const int64_t blocks = (items + kWarps - 1) / kWarps;
  if (blocks > 0x7fffffff) return "gdn_bwd_finalize: too many (token, key head) pairs for one grid";
  finalize_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  return launch_error();
}

}  // namespace
}  // namespace bwd

const char* gdn_bwd_finalize(const GdnBwdParams& p, void* stream) {
  return p.in == BwdDType::BFloat16 ? bwd::launch<__nv_bfloat16>(p, stream) : bwd::launch<__half>(p, stream);
}

}  // namespace tree_recurrence::gdn::fused::kernels
