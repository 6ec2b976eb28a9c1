// The element types of the SDK kernels' buffers, and the one host-side argument check the kernels
// use: torch-free, like every header of kernels/ (the torch ops map at::ScalarType onto these in
// sdk/element_type.h).
#pragma once

#include <stdexcept>
#include <string>

namespace tree_recurrence::kernels {

// The element type of every SDK kernel's buffers (tree_conv; chunk_state_pass names it ChunkDType).
enum class DType { Float32, Float64, BFloat16, Float16 };

// "float32", "float64", "bfloat16", "float16" (or "unknown").
template <class E>
constexpr const char* element_type_name(E dtype) {
  switch (dtype) {
    case E::Float32: return "float32";
    case E::Float64: return "float64";
    case E::BFloat16: return "bfloat16";
    case E::Float16: return "float16";
  }
  return "unknown";
}

// Throws std::invalid_argument("<op>: <what>") unless `ok`: a kernel's refusal of bad parameters.
inline void require(bool ok, const char* op, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(op) + ": " + what);
}

}  // namespace tree_recurrence::kernels
