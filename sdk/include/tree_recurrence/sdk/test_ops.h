// Test-only ops: a family's float64 oracles (the token-by-token recurrences its chunked ops are
// checked against) and its kernels' stage ops are registered only when the process asks for them
// (TREE_RECURRENCE_TEST_OPS, settings.h), so the installed library ships its seams' ops and nothing
// else by default. tests/python/conftest.py sets it before any plugin loads; a script calling an
// oracle sets it before importing tree_recurrence.
#pragma once

#include "tree_recurrence/sdk/settings.h"

namespace tree_recurrence {

// settings::test_ops() under the name the plugins' op registration uses.
inline bool test_ops_enabled() { return settings::test_ops(); }

}  // namespace tree_recurrence
