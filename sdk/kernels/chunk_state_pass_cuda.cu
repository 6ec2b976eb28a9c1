#include "tree_recurrence/kernels/chunk_state_pass.h"

#include <stdexcept>

namespace tree_recurrence::kernels {

void chunk_state_pass_forward_cuda(const ChunkStatePassParams&, void*) {
  throw std::invalid_argument("chunk_state_pass: the CUDA kernel is not built yet");
}
void chunk_state_pass_backward_cuda(const ChunkStatePassParams&, void*) {
  throw std::invalid_argument("chunk_state_pass_backward: the CUDA kernel is not built yet");
}

}  // namespace tree_recurrence::kernels
