// Test-only ops: a family's float64 oracles (the token-by-token recurrences its chunked ops are
// checked against) and its kernels' stage ops are registered only when the process asks for them,
// so the installed library ships its seams' ops and nothing else by default.
//
//   TREE_RECURRENCE_TEST_OPS=1   register them (tests/python/conftest.py sets it before any plugin
//                                loads; a script calling an oracle sets it before importing
//                                tree_recurrence)
#pragma once

#include <cstdlib>
#include <cstring>

namespace tree_recurrence {

inline bool test_ops_enabled() {
  const char* value = std::getenv("TREE_RECURRENCE_TEST_OPS");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace tree_recurrence
