// A family's kernels() list derived from what it registered, instead of typed a second time.
//
//   return registered_kernels({{"tree_conv", {}}, {"gdn_tree_scan", {"chunk_state_pass"}}});
//
// An op of the family's namespace runs on a device when it has a kernel for that device's dispatch key,
// or when it is a CompositeImplicitAutograd composite and every op it is built on (the second element,
// ops of the same namespace) runs there. Call it after the family registered its ops (its constructor).
// A name the family's namespace does not hold is looked up among the shared ops (torch.ops.tree_recurrence,
// sdk/shared_ops.h: tree_conv, chunk_state_pass), which a family lists as its own when it offers them.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <utility>
#include <vector>

#include "tree_recurrence/sdk/family.h"
#include "tree_recurrence/sdk/op_library.h"
#include "tree_recurrence/sdk/shared_ops.h"

namespace tree_recurrence {

inline bool op_runs_on(const std::string& op, c10::DispatchKey device_key, const std::vector<std::string>& built_on) {
  auto handle = c10::Dispatcher::singleton().findOp({qualified_op(op.c_str()), ""});
  if (!handle) handle = c10::Dispatcher::singleton().findOp({std::string(TREE_RECURRENCE_SHARED_OP_NAMESPACE "::") + op, ""});
  if (!handle) return false;
  if (handle->hasKernelForDispatchKey(device_key)) return true;
  if (!handle->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) return false;
  for (const auto& dependency : built_on)
    if (!op_runs_on(dependency, device_key, {})) return false;
  return true;
}

inline std::vector<KernelInfo> registered_kernels(
    const std::vector<std::pair<std::string, std::vector<std::string>>>& ops) {
  std::vector<KernelInfo> out;
  for (const auto& [op, built_on] : ops) {
    out.push_back({op, "cpu", op_runs_on(op, c10::DispatchKey::CPU, built_on)});
    out.push_back({op, "cuda", op_runs_on(op, c10::DispatchKey::CUDA, built_on)});
  }
  return out;
}

}  // namespace tree_recurrence
