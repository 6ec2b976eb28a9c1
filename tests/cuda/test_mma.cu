// GPU test of the SDK's tensor-core helpers (sdk/include/tree_recurrence/kernels/mma.cuh): every
// operand layout of warp_gemm, bf16 and fp16, against a host fp32 product of the same rounded
// operands, plus c_to_a chaining. Built and run on the GPU machine by benchmarks/gpu/kernels.sh
// (nvcc -gencode=arch=compute_90a,code=sm_90a); exits non-zero on any mismatch.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "tree_recurrence/kernels/mma.cuh"

namespace m = tree_recurrence::kernels::mma;

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      return 2;                                                                     \
    }                                                                               \
  } while (0)

constexpr int M = 32, N = 32, K = 48, LD = 56;  // MT=2, NT=4, KT=3; pitch padded by 8

template <typename T, bool A_ROW, bool B_KN>
__global__ void gemm_kernel(const T* a, const T* b, float* c, float* chain) {
  __shared__ __align__(16) T sa[64 * LD];
  __shared__ __align__(16) T sb[64 * LD];
  // a is M x K row-major in global; stored in smem per layout. b is K x N row-major.
  for (int i = threadIdx.x; i < M * K; i += 32) {
    const int r = i / K, k = i % K;
    sa[A_ROW ? r * LD + k : k * LD + r] = a[i];
  }
  for (int i = threadIdx.x; i < K * N; i += 32) {
    const int k = i / N, n = i % N;
    sb[B_KN ? k * LD + n : n * LD + k] = b[i];
  }
  __syncthreads();
  m::FragC acc[2][4];
  for (auto& row : acc)
    for (auto& f : row) f.zero();
  m::warp_gemm<T, 2, 4, 3, A_ROW, B_KN>(acc, sa, LD, sb, LD);
  m::store_c(acc, c, N, [](float v) { return v; });
  // chain: (first 16 rows of C, columns 0..15) as an A operand times b's first 16 rows.
  m::FragA a2 = m::c_to_a<T>(acc[0][0], acc[0][1]);
  m::FragC out[4];
  for (auto& f : out) f.zero();
  for (int np = 0; np < 2; ++np) {
    m::FragB b0, b1;
    if (B_KN) m::load_b_kn(b0, b1, sb + np * 16, LD);
    else m::load_b_nk(b0, b1, sb + np * 16 * LD, LD);
    m::mma<T>(out[2 * np], a2, b0);
    m::mma<T>(out[2 * np + 1], a2, b1);
  }
  const int l = m::lane_id();
  for (int nt = 0; nt < 4; ++nt)
    for (int e = 0; e < 4; ++e) chain[m::c_row(l, e) * N + nt * 8 + m::c_col(l, e)] = out[nt].x[e];
}

template <typename T, typename ToF, typename FromF, bool A_ROW, bool B_KN>
int run(const char* name, ToF to_f, FromF from_f) {
  std::mt19937 rng(1234);
  std::normal_distribution<float> nd;
  std::vector<T> ha(M * K), hb(K * N);
  std::vector<float> fa(M * K), fb(K * N);
  for (int i = 0; i < M * K; ++i) { ha[i] = from_f(nd(rng)); fa[i] = to_f(ha[i]); }
  for (int i = 0; i < K * N; ++i) { hb[i] = from_f(nd(rng)); fb[i] = to_f(hb[i]); }
  T *da, *db;
  float *dc, *dch;
  CHECK(cudaMalloc(&da, sizeof(T) * M * K));
  CHECK(cudaMalloc(&db, sizeof(T) * K * N));
  CHECK(cudaMalloc(&dc, sizeof(float) * M * N));
  CHECK(cudaMalloc(&dch, sizeof(float) * 16 * N));
  CHECK(cudaMemcpy(da, ha.data(), sizeof(T) * M * K, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(db, hb.data(), sizeof(T) * K * N, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dc, 0xff, sizeof(float) * M * N));  // NaN poison
  CHECK(cudaMemset(dch, 0xff, sizeof(float) * 16 * N));
  gemm_kernel<T, A_ROW, B_KN><<<1, 32>>>(da, db, dc, dch);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> c(M * N), ch(16 * N);
  CHECK(cudaMemcpy(c.data(), dc, sizeof(float) * M * N, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(ch.data(), dch, sizeof(float) * 16 * N, cudaMemcpyDeviceToHost));
  double err = 0, err2 = 0;
  std::vector<float> ref(M * N);
  for (int r = 0; r < M; ++r)
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int k = 0; k < K; ++k) s += double(fa[r * K + k]) * fb[k * N + n];
      ref[r * N + n] = float(s);
      const double e = std::fabs(s - c[r * N + n]);
      err = (e > err || std::isnan(c[r * N + n])) ? (std::isnan(c[r * N + n]) ? 1e30 : e) : err;
    }
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < N; ++n) {
      double s = 0;
      for (int k = 0; k < 16; ++k) s += double(to_f(from_f(c[r * N + k]))) * fb[k * N + n];
      const double e = std::fabs(s - ch[r * N + n]);
      err2 = (e > err2 || std::isnan(ch[r * N + n])) ? (std::isnan(ch[r * N + n]) ? 1e30 : e) : err2;
    }
  const bool ok = err < 1e-3 && err2 < 2e-2;
  std::printf("%-28s max|err| gemm %.3g chain %.3g  %s\n", name, err, err2, ok ? "ok" : "FAIL");
  cudaFree(da); cudaFree(db); cudaFree(dc); cudaFree(dch);
  return ok ? 0 : 1;
}

int main() {
  auto bf2f = [](__nv_bfloat16 v) { return __bfloat162float(v); };
  auto f2bf = [](float f) { return __float2bfloat16(f); };
  auto h2f = [](__half v) { return __half2float(v); };
  auto f2h = [](float f) { return __float2half(f); };
  int bad = 0;
  bad += run<__nv_bfloat16, decltype(bf2f), decltype(f2bf), true, true>("bf16 A row, B kn", bf2f, f2bf);
  bad += run<__nv_bfloat16, decltype(bf2f), decltype(f2bf), true, false>("bf16 A row, B nk", bf2f, f2bf);
  bad += run<__nv_bfloat16, decltype(bf2f), decltype(f2bf), false, true>("bf16 A col, B kn", bf2f, f2bf);
  bad += run<__nv_bfloat16, decltype(bf2f), decltype(f2bf), false, false>("bf16 A col, B nk", bf2f, f2bf);
  bad += run<__half, decltype(h2f), decltype(f2h), true, true>("fp16 A row, B kn", h2f, f2h);
  bad += run<__half, decltype(h2f), decltype(f2h), false, false>("fp16 A col, B nk", h2f, f2h);
  std::printf(bad ? "test_mma: %d FAILED\n" : "test_mma: all passed\n", bad);
  return bad ? 1 : 0;
}
