// (d) of the fused GDN backward: dq, dk at the tokens. One warp per (token, key head): dk^ of the
// value heads of the key head summed in increasing order (no atomics; dq^ comes summed per key head
// from (b), in the same order: dy = 0 + that), times scale for q, then l2norm's backward (y = x r:
// dx = r (dy - y <y, dy>), the dot a fixed butterfly).
#include "common_bwd.cuh"

namespace tree_recurrence::gdn::fused::kernels {
namespace bwd {
namespace {

// One warp per (token, key head): q (index 0) and k (index 1) together, so all the group loads are
// in flight at once; in-type stores.
template <typename T>
__global__ void __launch_bounds__(kThreads) finalize_kernel(GdnBwdParams p) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (item >= p.tokens * p.hk) return;
  const int64_t t = item / p.hk, hk = item % p.hk, flat = p.scatter[t];
  const int K = static_cast<int>(p.k_dim), lane = threadIdx.x & 31;
  const int64_t HK = p.hk, HV = p.hv, groups = HV / HK, c = flat / C, pos = flat % C;
  const T* x[2] = {static_cast<const T*>(p.q), static_cast<const T*>(p.k)};
  const float* r[2] = {p.rq, p.rk};
  const float* dhv[2] = {p.dq_hv, p.dk_hv};
  T* out[2] = {static_cast<T*>(p.dq), static_cast<T*>(p.dk)};
  const float scale[2] = {p.scale, 1.f};
  float dy[2][kBwdMaxDim / 32], y[2][kBwdMaxDim / 32], rr[2], dot[2];
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    rr[a] = p.l2norm ? r[a][t * HK + hk] : 1.f;
#pragma unroll
    for (int m = 0; m < kBwdMaxDim / 32; ++m) {
      const int col = lane + 32 * m;
      dy[a][m] = 0.f;
      y[a][m] = col < K ? mma::Elem<T>::to_float(x[a][(t * HK + hk) * K + col]) : 0.f;
    }
  }
  for (int64_t gi = 0; gi < groups; ++gi) {  // dk^: value heads of the key head in increasing order
    const int64_t base = ((c * HV + hk * groups + gi) * C + pos) * K;
#pragma unroll
    for (int m = 0; m < kBwdMaxDim / 32; ++m) {
      const int col = lane + 32 * m;
      if (col < K) dy[1][m] += dhv[1][base + col];
    }
  }
  {  // dq^ of the key head: (NC, HK, C, K), the group sum (from 0, in order) of (b)
    const int64_t base = ((c * HK + hk) * C + pos) * K;
#pragma unroll
    for (int m = 0; m < kBwdMaxDim / 32; ++m) {
      const int col = lane + 32 * m;
      if (col < K) dy[0][m] += dhv[0][base + col];
    }
  }
#pragma unroll
  for (int a = 0; a < 2; ++a) {
    dot[a] = 0.f;
#pragma unroll
    for (int m = 0; m < kBwdMaxDim / 32; ++m) {
      dy[a][m] *= scale[a];
      y[a][m] *= rr[a];
      dot[a] += y[a][m] * dy[a][m];
    }
  }
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) dot[a] += __shfl_xor_sync(0xffffffffu, dot[a], o);
#pragma unroll
  for (int a = 0; a < 2; ++a)
#pragma unroll
    for (int m = 0; m < kBwdMaxDim / 32; ++m) {
      const int col = lane + 32 * m;
      if (col < K)
        out[a][(t * HK + hk) * K + col] =
            mma::Elem<T>::from_float(p.l2norm ? rr[a] * (dy[a][m] - y[a][m] * dot[a]) : dy[a][m]);
    }
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
