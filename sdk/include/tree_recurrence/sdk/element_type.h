// The one mapping of torch's floating dtypes onto the kernels' element types (kernels/dtype.h), for
// the shared ops library's torch op wrappers (sdk/ops/tree_conv_op.cpp, sdk/ops/chunk_state_op.cpp).
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

namespace tree_recurrence::sdk {

// kernels::DType or kernels::ChunkDType of float32 / float64 / bfloat16 / float16; none for others.
template <class E>
constexpr std::optional<E> kernel_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return E::Float32;
    case c10::ScalarType::Double: return E::Float64;
    case c10::ScalarType::BFloat16: return E::BFloat16;
    case c10::ScalarType::Half: return E::Float16;
    default: return std::nullopt;
  }
}

}  // namespace tree_recurrence::sdk
