// Fused SSD forward, stage c of the three-kernel path (params.h: FwdPlan; ssd_fused.h): the tree
// state pass. SSD's chunk states do not depend on the incoming state, so the pass is an elementwise
// fp32 scan over each segment's chunks:
//   states[c] = s (stored in the in-type);  s = exp(Lam_last[c]) s + S_c
// starting from the parent's final state (fp32 workspace (S, H, P, N), written by the previous
// level's launch), a root's initial state (shared or per root by root_index) or zeros.
// One launch per trie level (host loop over level_offsets); grid (segments of the level, H,
// ceil(P N / 1024)), 256 threads, 4 consecutive state elements per thread. No atomics.
// Software-pipelined: a thread keeps the chunk states and Lam_last of its next kAhead chunks in
// registers (loaded kAhead steps before their use, through the read-only path), so a long segment
// (one 49k-token row: 768 chunks in a row) has kAhead loads in flight per thread instead of one
// dependent DRAM round trip per chunk; the fmaf chain stays one per chunk in order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "params.h"
#include "tree_recurrence/kernels/mma.cuh"

namespace tree_recurrence::ssd::fused::kernels {
namespace {
namespace mma = tree_recurrence::kernels::mma;

constexpr int kThreads = 256;
constexpr int kPer = 4;
constexpr int kAhead = 4;  // chunks in flight per thread

template <typename T>
__global__ void __launch_bounds__(kThreads) state_pass_kernel(FwdParams p, int64_t level_begin) {
  const int64_t s = p.level_segments[level_begin + blockIdx.x];
  const int64_t h = blockIdx.y, H = p.heads, L = p.chunk;
  const int64_t PN = p.head_dim * p.state_dim;
  const int64_t e = (int64_t(blockIdx.z) * kThreads + threadIdx.x) * kPer;
  if (e >= PN) return;  // PN is a multiple of 64: a thread's 4 elements are all in or all out

  float4 st = make_float4(0.f, 0.f, 0.f, 0.f);
  const int64_t parent = p.parents[s];
  if (parent >= 0) {
    st = *reinterpret_cast<const float4*>(p.workspace + (parent * H + h) * PN + e);
  } else if (p.initial_state) {
    const int64_t row = p.initial_per_root ? p.root_index[s] : 0;
    st = *reinterpret_cast<const float4*>(p.initial_state + (row * H + h) * PN + e);
  }
  T* states = static_cast<T*>(p.states);
  const int64_t c_begin = p.seg_chunk_offsets[s], c_end = p.seg_chunk_offsets[s + 1];
  float4 cs[kAhead];
  float lam[kAhead];
#pragma unroll
  for (int k = 0; k < kAhead; ++k) {
    const int64_t c = c_begin + k;
    if (c < c_end) {
      cs[k] = __ldg(reinterpret_cast<const float4*>(p.chunk_states + (c * H + h) * PN + e));
      lam[k] = __ldg(p.Lam + (c * H + h) * L + L - 1);
    }
  }
  for (int64_t c0 = c_begin; c0 < c_end; c0 += kAhead) {
#pragma unroll
    for (int k = 0; k < kAhead; ++k) {
      const int64_t c = c0 + k;
      if (c < c_end) {
        const float decay = expf(fminf(lam[k], 0.f));
        uint2 packed;
        packed.x = mma::Elem<T>::pack(st.x, st.y);
        packed.y = mma::Elem<T>::pack(st.z, st.w);
        *reinterpret_cast<uint2*>(states + (c * H + h) * PN + e) = packed;
        st.x = fmaf(decay, st.x, cs[k].x);
        st.y = fmaf(decay, st.y, cs[k].y);
        st.z = fmaf(decay, st.z, cs[k].z);
        st.w = fmaf(decay, st.w, cs[k].w);
        const int64_t cn = c + kAhead;
        if (cn < c_end) {
          cs[k] = __ldg(reinterpret_cast<const float4*>(p.chunk_states + (cn * H + h) * PN + e));
          lam[k] = __ldg(p.Lam + (cn * H + h) * L + L - 1);
        }
      }
    }
  }
  if (p.child_offsets[s + 1] > p.child_offsets[s])
    *reinterpret_cast<float4*>(p.workspace + (s * H + h) * PN + e) = st;
}

template <typename T>
int launch_levels(const FwdParams& p, cudaStream_t stream) {
  const int64_t PN = p.head_dim * p.state_dim;
  const unsigned zblocks = static_cast<unsigned>((PN + kThreads * kPer - 1) / (kThreads * kPer));
  for (int64_t level = 0; level < p.num_levels; ++level) {
    const int64_t begin = p.level_offsets[level], count = p.level_offsets[level + 1] - begin;
    if (count <= 0) continue;
    const dim3 grid(static_cast<unsigned>(count), static_cast<unsigned>(p.heads), zblocks);
    state_pass_kernel<T><<<grid, kThreads, 0, stream>>>(p, begin);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return 0;
}

}  // namespace

int ssd_state_pass_fwd(const FwdParams& p, void* stream) {
  if ((p.head_dim * p.state_dim) % 64 != 0) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  return p.in == InType::BFloat16 ? launch_levels<__nv_bfloat16>(p, s) : launch_levels<__half>(p, s);
}

}  // namespace tree_recurrence::ssd::fused::kernels
