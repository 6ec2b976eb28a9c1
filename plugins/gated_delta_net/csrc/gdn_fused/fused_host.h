// Host helpers of the fused GDN forward and backward (gdn_fused_fwd.cpp, gdn_fused_bwd.cpp; CUDA
// builds only): 16-byte aligned inputs, the shared checks, the op's scalars into the kernels'
// parameters, the launch check, and the SDK tensor-core tree state pass's parameters (the dims, the
// dtype and the plan's tables; each caller adds its direction's buffers).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <type_traits>

#include "gdn_fused.h"
#include "tree_recurrence/kernels/chunk_state_pass_tc.h"
#include "tree_recurrence/sdk/check.h"
#include "tree_recurrence/sdk/element_type.h"

namespace tree_recurrence::gdn::fused {

// Contiguous, 16-byte aligned (the kernels read 16-byte words).
inline at::Tensor aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone(at::MemoryFormat::Contiguous);
  return c;
}

// The checks the forward and the backward share, messages "<who>: ...": q, k (T, HK, K) alike and v
// (T, HV, V), bf16 or fp16 alike, on CUDA; the plan's chunk 64; K and V multiples of 8 in 8..128; HV
// a multiple of HK, at most 65535; fewer than 2^31 chunks.
inline void check_inputs(const GdnArgs& a, const char* who) {
  const at::Tensor &q = a.q, &k = a.k, &v = a.v;
  TR_CHECK_VALUE(q.is_cuda(), who, ": inputs must be on CUDA, got ", q.device());
  const auto dt = v.scalar_type();
  TR_CHECK_TYPE((dt == at::kBFloat16 || dt == at::kHalf) && q.scalar_type() == dt && k.scalar_type() == dt, who,
                ": q, k, v must be bfloat16 or float16 alike, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", dt);
  TR_CHECK_VALUE(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0), who,
                 ": q, k must be (T, HK, K) alike and v (T, HV, V), got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t HK = q.size(1), K = q.size(2), HV = v.size(1), V = v.size(2);
  const int64_t NC = a.tables.gather.size(0), C = a.tables.gather.size(1);
  TR_CHECK_VALUE(C == 64, who, ": chunk must be 64, got ", C);
  TR_CHECK_VALUE(K % 8 == 0 && K >= 8 && K <= 128 && V % 8 == 0 && V >= 8 && V <= 128, who,
                 ": key and value dims must be multiples of 8 in 8..128, got ", K, " and ", V);
  TR_CHECK_VALUE(HK > 0 && HV % HK == 0 && HV <= 65535, who, ": value heads ", HV, " must be a multiple of key heads ",
                 HK, " and at most 65535");
  TR_CHECK_VALUE(NC < (int64_t{1} << 31), who, ": ", NC, " chunks (at most 2^31 - 1)");
}

template <class P, class = void>
struct HasScale : std::false_type {};
template <class P>
struct HasScale<P, std::void_t<decltype(P::scale)>> : std::true_type {};

// The op's scalars into a kernel parameter block (kernels/params.h, kernels/params_bwd.h): the one place
// the kernels' l2norm flag and resolved scale are filled from the arguments.
template <class P>
void set_scalars(P& p, const GdnArgs& a) {
  p.l2norm = a.use_qk_l2norm;
  if constexpr (HasScale<P>::value) p.scale = static_cast<float>(a.resolved_scale());
}

// Throws "<where><stage>): <err>" unless the launcher returned "" (where: e.g. "fused GDN backward (").
inline void check_launch(const char* err, const char* where, const char* stage) {
  TR_CHECK(err == nullptr || err[0] == '\0', where, stage, "): ", err);
}

// The tables contiguous: what the pass's table pointers point into (alive until the pass ran).
struct PassTables {
  at::Tensor seg_chunk_offsets, parents, root_index, level_segments, child_offsets, children;
};

// NC chunks of HV heads, K x V states, R roots, q / k / v of type dt; the tables from `tables` (made
// contiguous into `keep`; level_offsets stays on the host, in `tables`).
inline tree_recurrence::kernels::ChunkStatePassTcParams state_pass_params(const Tables& tables, PassTables& keep, int64_t NC,
                                                                          int64_t HV, int64_t K, int64_t V, int64_t R,
                                                                          at::ScalarType dt) {
  keep = {tables.seg_chunk_offsets.contiguous(), tables.parents.contiguous(),       tables.root_index.contiguous(),
          tables.level_segments.contiguous(),    tables.child_offsets.contiguous(), tables.children.contiguous()};
  const int64_t levels = static_cast<int64_t>(tables.level_offsets.size()) - 1;
  tree_recurrence::kernels::ChunkStatePassTcParams sp;
  sp.num_chunks = NC;
  sp.heads = HV;
  sp.k_dim = K;
  sp.v_dim = V;
  sp.num_segments = keep.parents.size(0);
  sp.num_roots = R;
  sp.in = *tree_recurrence::sdk::kernel_dtype<tree_recurrence::kernels::ChunkDType>(dt);  // bf16 / fp16 (check_inputs)
  sp.seg_chunk_offsets = keep.seg_chunk_offsets.data_ptr<int64_t>();
  sp.parents = keep.parents.data_ptr<int64_t>();
  sp.root_index = keep.root_index.data_ptr<int64_t>();
  sp.level_segments = keep.level_segments.data_ptr<int64_t>();
  sp.level_offsets = tables.level_offsets.data();
  sp.num_levels = levels < 0 ? 0 : levels;
  sp.child_offsets = keep.child_offsets.data_ptr<int64_t>();
  sp.children = keep.children.numel() > 0 ? keep.children.data_ptr<int64_t>() : nullptr;
  return sp;
}

}  // namespace tree_recurrence::gdn::fused
