// Warp-level tensor-core helpers shared by the fused chunk kernels (Gated DeltaNet, Mamba2 SSD):
// mma.sync m16n8k16 with bf16 / fp16 operands and fp32 accumulation (sm_80 and later, so also
// Hopper), ldmatrix loads from shared memory in either layout, cp.async copies, 8-element packs
// (16-byte words <-> 8 floats), and the register layouts written down once. CUDA only, no ATen;
// include from .cu files.
//
// Fragment layouts (lane = threadIdx.x % 32, g = lane / 4, t = lane % 4):
//   A 16x16 (rows r, cols k), 4 registers of 2 halves each:
//     a[0] = A(g,   2t..2t+1)   a[1] = A(g+8, 2t..2t+1)   a[2] = A(g, 2t+8..)   a[3] = A(g+8, 2t+8..)
//   B 16x8 (rows k, cols n), 2 registers:
//     b[0] = B(2t..2t+1, g)     b[1] = B(2t+8..2t+9, g)
//   C 16x8 fp32 accumulator, 4 floats:
//     c[0] = C(g, 2t)  c[1] = C(g, 2t+1)  c[2] = C(g+8, 2t)  c[3] = C(g+8, 2t+1)
//   (c_row / c_col below give the coordinates of c[e].)
//
// Shared-memory operand layouts for the ldmatrix loads (element type T = bf16 or half, `ld` the row
// pitch in elements, a multiple of 8; each addressed row must start 16-byte aligned; a pitch of
// width + 8 avoids bank conflicts):
//   load_a_row(A, ld):  A(r, k) at A[r * ld + k]            (k contiguous)
//   load_a_col(A, ld):  A(r, k) at A[k * ld + r]            (r contiguous: A is stored transposed)
//   load_b_kn(B, ld):   B(k, n) at B[k * ld + n]            (n contiguous: row-major K x N)
//   load_b_nk(B, ld):   B(k, n) at B[n * ld + k]            (k contiguous: B stored transposed)
// The B loads fetch two adjacent 8-column blocks (16 columns) at once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace tree_recurrence::kernels::mma {

struct FragA {
  uint32_t x[4];
};
struct FragB {
  uint32_t x[2];
};
struct FragC {
  float x[4];
  __device__ __forceinline__ void zero() { x[0] = x[1] = x[2] = x[3] = 0.f; }
};

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31); }
// Row / column (inside the 16x8 tile) of accumulator element e (0..3) held by this lane.
__device__ __forceinline__ int c_row(int lane, int e) { return (lane >> 2) + ((e >> 1) << 3); }
__device__ __forceinline__ int c_col(int lane, int e) { return ((lane & 3) << 1) + (e & 1); }

// --- element types -------------------------------------------------------------------------
// The 32 bits of a pair type (__nv_bfloat162, __half2).
template <typename T2>
__device__ __forceinline__ uint32_t bits32(const T2& v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <typename T>
struct Elem;
template <>
struct Elem<__nv_bfloat16> {
  __device__ __forceinline__ static __nv_bfloat16 from_float(float f) { return __float2bfloat16_rn(f); }
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) { return bits32(__floats2bfloat162_rn(lo, hi)); }
};
template <>
struct Elem<__half> {
  __device__ __forceinline__ static __half from_float(float f) { return __float2half_rn(f); }
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) { return bits32(__floats2half2_rn(lo, hi)); }
};

// 8 consecutive elements of type T (one 16-byte word) <-> 8 floats (pack8: pairs rounded by Elem<T>::pack).
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&f)[8]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = Elem<T>::to_float(e[i]);
}
template <typename T>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 r;
  r.x = Elem<T>::pack(f[0], f[1]);
  r.y = Elem<T>::pack(f[2], f[3]);
  r.z = Elem<T>::pack(f[4], f[5]);
  r.w = Elem<T>::pack(f[6], f[7]);
  return r;
}

// --- the MMA -------------------------------------------------------------------------------
// c += a * b (16x16 times 16x8, fp32 accumulate).
// T: __nv_bfloat16 or __half (the one asm statement of each, chosen at compile time).
template <typename T>
__device__ __forceinline__ void mma(FragC& c, const FragA& a, const FragB& b) {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>, "mma: bf16 or fp16 operands");
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
        : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
  else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
        : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
}

// --- ldmatrix loads from shared memory -------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// A 16x16 tile whose element (r, k) is A[r * ld + k].
template <typename T>
__device__ __forceinline__ FragA load_a_row(const T* A, int ld) {
  const int l = lane_id();
  FragA f;
  uint32_t r[4];
  ldsm_x4(r, A + (l & 15) * ld + ((l >> 4) << 3));
  f.x[0] = r[0]; f.x[1] = r[1]; f.x[2] = r[2]; f.x[3] = r[3];
  return f;
}
// A 16x16 tile whose element (r, k) is A[k * ld + r] (the stored matrix is A transposed).
template <typename T>
__device__ __forceinline__ FragA load_a_col(const T* A, int ld) {
  const int l = lane_id(), m = l >> 3, i = l & 7;
  FragA f;
  uint32_t r[4];
  ldsm_x4_trans(r, A + (i + ((m >> 1) << 3)) * ld + ((m & 1) << 3));
  f.x[0] = r[0]; f.x[1] = r[1]; f.x[2] = r[2]; f.x[3] = r[3];
  return f;
}
// Two B tiles 16x8 (columns n0..n0+7 -> b0, n0+8..n0+15 -> b1) with B(k, n) at B[k * ld + n].
template <typename T>
__device__ __forceinline__ void load_b_kn(FragB& b0, FragB& b1, const T* B, int ld) {
  const int l = lane_id(), m = l >> 3, i = l & 7;
  uint32_t r[4];
  ldsm_x4_trans(r, B + (i + ((m & 1) << 3)) * ld + ((m >> 1) << 3));
  b0.x[0] = r[0]; b0.x[1] = r[1]; b1.x[0] = r[2]; b1.x[1] = r[3];
}
// Two B tiles 16x8 with B(k, n) at B[n * ld + k].
template <typename T>
__device__ __forceinline__ void load_b_nk(FragB& b0, FragB& b1, const T* B, int ld) {
  const int l = lane_id(), m = l >> 3, i = l & 7;
  uint32_t r[4];
  ldsm_x4(r, B + (i + ((m >> 1) << 3)) * ld + ((m & 1) << 3));
  b0.x[0] = r[0]; b0.x[1] = r[1]; b1.x[0] = r[2]; b1.x[1] = r[3];
}

// Two accumulator tiles (16x8 each, columns 0..7 and 8..15) rounded into the A operand of a
// following MMA whose k runs over those 16 columns (FlashAttention's register reuse).
template <typename T>
__device__ __forceinline__ FragA c_to_a(const FragC& c0, const FragC& c1) {
  FragA f;
  f.x[0] = Elem<T>::pack(c0.x[0], c0.x[1]);
  f.x[1] = Elem<T>::pack(c0.x[2], c0.x[3]);
  f.x[2] = Elem<T>::pack(c1.x[0], c1.x[1]);
  f.x[3] = Elem<T>::pack(c1.x[2], c1.x[3]);
  return f;
}

// --- a warp's tile product ------------------------------------------------------------------
// acc[MT][NT] += A (16*MT x 16*KT) * B (16*KT x 8*NT) with both operands in shared memory.
// A_ROW: A(r, k) at A[r * lda + k], else at A[k * lda + r]. B_KN: B(k, n) at B[k * ldb + n], else
// at B[n * ldb + k]. NT must be even. The pointers address the tile's (0, 0) element.
template <typename T, int MT, int NT, int KT, bool A_ROW, bool B_KN>
__device__ __forceinline__ void warp_gemm(FragC (&acc)[MT][NT], const T* A, int lda, const T* B, int ldb) {
  static_assert(NT % 2 == 0, "warp_gemm: NT (8-column blocks) must be even");
#pragma unroll
  for (int kt = 0; kt < KT; ++kt) {
    FragA a[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      a[mt] = A_ROW ? load_a_row(A + mt * 16 * lda + kt * 16, lda) : load_a_col(A + kt * 16 * lda + mt * 16, lda);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      FragB b0, b1;
      if (B_KN)
        load_b_kn(b0, b1, B + kt * 16 * ldb + np * 16, ldb);
      else
        load_b_nk(b0, b1, B + np * 16 * ldb + kt * 16, ldb);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma<T>(acc[mt][2 * np], a[mt], b0);
        mma<T>(acc[mt][2 * np + 1], a[mt], b1);
      }
    }
  }
}

// Stores a warp's accumulator tiles (16*MT x 8*NT, origin at `out`) into shared or global memory,
// element (r, c) at out[r * ld + c], converted by `conv` (e.g. Elem<T>::from_float, or identity).
template <int MT, int NT, typename Out, typename Conv>
__device__ __forceinline__ void store_c(const FragC (&acc)[MT][NT], Out* out, int ld, Conv conv) {
  const int l = lane_id();
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        out[(mt * 16 + c_row(l, e)) * ld + nt * 8 + c_col(l, e)] = conv(acc[mt][nt].x[e]);
}

// --- cp.async (16-byte copies global -> shared; src_bytes < 16 zero-fills the rest) --------------
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes = 16) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "r"(src_bytes));
}
// 4- or 8-byte copies (through L1: cp.async.ca, the sizes .cg does not take), for per-thread prefetch rings
template <int Bytes>
__device__ __forceinline__ void cp_async_ca(void* smem, const void* gmem) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(smem_addr(smem)), "l"(gmem), "n"(Bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

}  // namespace tree_recurrence::kernels::mma
