// fused::backward (ssd_fused.h): the fused SSD backward from the forward's saved buffers.
#include "ssd_fused.h"

#include <c10/util/Exception.h>

namespace tree_recurrence::ssd::fused {

Grads backward(const at::Tensor& grad_out, const Args& a, const Tables& t, const Saved& saved) {
  (void)grad_out; (void)a; (void)t; (void)saved;
  TORCH_CHECK(false, "fused SSD backward: not implemented yet");
}

}  // namespace tree_recurrence::ssd::fused
