// Inside the shared ops library (sdk/ops/): the schema definitions each op file contributes to the library's
// one TORCH_LIBRARY block (shared_ops.cpp).
#pragma once

#include <torch/library.h>

#include "tree_recurrence/sdk/shared_ops.h"

namespace tree_recurrence {

void define_chunk_state_ops(torch::Library& m);
void define_tree_conv_ops(torch::Library& m);

}  // namespace tree_recurrence
