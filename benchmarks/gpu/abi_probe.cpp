// Device diagnosis (benchmarks/gpu/diag_abi.sh): does formatting a number through an ostream crash in a
// shared library built on that machine and loaded into a python that has imported torch? Two probes,
// each returning its text through a caller buffer: the plain ostream, and c10's TORCH_CHECK (c10::str)
// thrown and caught inside the library. Not part of the library.
#include <cstdio>
#include <sstream>
#include <string>
#ifdef WITH_C10
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#endif

extern "C" __attribute__((visibility("default"))) int probe_ostream(long n, char* out, int cap) {
  std::ostringstream ss;
  ss << "n=" << n << " x=" << 0.5;
  std::snprintf(out, cap, "%s", ss.str().c_str());
  return 0;
}

#ifdef WITH_C10
extern "C" __attribute__((visibility("default"))) int probe_c10(long n, char* out, int cap) {
  try {
    const int64_t dims[2] = {n, n + 1};
    TORCH_CHECK_VALUE(n < 0, "probe: n=", n, " sizes ", c10::ArrayRef<int64_t>(dims, 2));
  } catch (const c10::Error& e) {
    std::snprintf(out, cap, "%s", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
#endif
