// Torch op registration for family plugins, done when the family is created, not when its
// library is loaded.
//
// TORCH_LIBRARY blocks run in static initializers: a bad schema there throws while the library
// loads and terminates the process. A family registers its ops from its constructor instead,
// through op_library(): an error then reaches the family factory, which reports it, and the
// registry refuses that plugin while the others load. Libraries are leaked on purpose: plugins
// are never unloaded and their ops must outlive every caller.
#pragma once

#include <torch/library.h>

#include <optional>

#ifndef TREE_RECURRENCE_OP_NAMESPACE
#error "TREE_RECURRENCE_OP_NAMESPACE must come from the build (tree_recurrence_add_family sets it)"
#endif
#define TREE_RECURRENCE_STR2(x) #x
#define TREE_RECURRENCE_STR(x) TREE_RECURRENCE_STR2(x)
#define TREE_RECURRENCE_OP_NAMESPACE_STR TREE_RECURRENCE_STR(TREE_RECURRENCE_OP_NAMESPACE)

namespace tree_recurrence {

inline torch::Library& op_library(torch::Library::Kind kind, std::optional<c10::DispatchKey> key = std::nullopt) {
  return *new torch::Library(kind, TREE_RECURRENCE_OP_NAMESPACE_STR, key, __FILE__, __LINE__);
}

// "<namespace>::<op>", for calls below the autograd key.
inline std::string qualified_op(const char* op) { return std::string(TREE_RECURRENCE_OP_NAMESPACE_STR) + "::" + op; }

}  // namespace tree_recurrence
