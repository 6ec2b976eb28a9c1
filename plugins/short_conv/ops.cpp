// Torch ops of the short_conv family: the shared tree conv, registered when the family is created.
#include "ops.h"

#include "tree_recurrence/sdk/tree_conv_op.h"

namespace tree_recurrence::short_conv {

void register_ops() { register_tree_conv_op(); }

}  // namespace tree_recurrence::short_conv
