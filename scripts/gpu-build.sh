#!/usr/bin/env bash
# On the GPU machine (device runs only): builds this checkout for Hopper (sm_90a) and installs it
# into that machine's python3, with 16 parallel compile jobs and a build folder outside the tree.
# Wheels carried in .whl/ (fla, trl, ...) are unpacked into /tmp/site: callers then
# `export PYTHONPATH=/tmp/site`.
# Like a user's package build it compiles no C++ test suites and no broken test plugins: no GPU script
# runs them (the test ops the GPU scripts use are switched on at run time by TREE_RECURRENCE_TEST_OPS=1).
# BUILD_TESTS=ON builds them too, e.g. for the CUDA cases of
# /tmp/tree-recurrence-build/tests/kernel_tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
python3 -m pip install --no-build-isolation --no-deps -q \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES=90a -Ccmake.define.TREE_RECURRENCE_TESTS="${BUILD_TESTS:-OFF}" \
  -Cbuild-dir=/tmp/tree-recurrence-build .
python3 -c "import tree_recurrence, torch; print('tree_recurrence built; torch', torch.__version__, 'cuda', torch.cuda.is_available())"
