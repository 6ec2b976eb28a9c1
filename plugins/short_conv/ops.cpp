// Torch ops of the short_conv family: none of its own. Its one kernel, the tree conv, is the shared ops
// library's (torch.ops.tree_recurrence.tree_conv, sdk/shared_ops.h), registered once for every family.
#include "ops.h"

namespace tree_recurrence::short_conv {

void register_ops() {}

}  // namespace tree_recurrence::short_conv
