#!/usr/bin/env bash
# The sanitizer job: builds the torch-free core and its C++ suites with
# -fsanitize=address,undefined in build/asan (tests/cpp/asan/CMakeLists.txt) and runs them; any
# memory error or undefined behaviour fails it. Incremental; about a minute from scratch on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
[ -f build/asan/CMakeCache.txt ] || cmake -S tests/cpp/asan -B build/asan "${generator[@]}" >/dev/null
cmake --build build/asan --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# LeakSanitizer: the registry leaks on purpose (plugins are never unloaded, the registry lives for
# the process); tests/cpp/asan/lsan.supp names exactly those allocations.
export LSAN_OPTIONS=suppressions=$PWD/tests/cpp/asan/lsan.supp:print_suppressions=0
build/asan/core_tests
build/asan/kernel_tests
