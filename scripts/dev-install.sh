#!/usr/bin/env bash
# Rebuilds and reinstalls the package from this checkout into the interpreter scripts/python-env.sh
# picks (.venv, or PYTHON) (incremental: build/py is kept). Serialized by a lock file inside the
# build folder, so parallel sessions on one checkout never build into it at once, while other
# checkouts and other users of the machine are not held up. This developer build also compiles the
# C++ test suites and the deliberately broken test plugins into build/py (TREE_RECURRENCE_TESTS=ON:
# `ctest --test-dir build/py` and the Python tests load them from there); a plain `pip install .`
# skips them (pyproject.toml).
#   --verbose-build   show the CMake configure and the build's [step/total] lines (setup.sh uses it)
# Other arguments go to pip.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python-env.sh
quiet=(-q)
if [ "${1:-}" = "--verbose-build" ]; then
  quiet=(-v)
  shift
fi
mkdir -p build/py
# No build isolation: the plugins must be built against the very torch they run with.
exec flock build/py/.install.lock "$PY" -m pip install --no-build-isolation --no-deps "${quiet[@]}" \
  -Ccmake.define.TREE_RECURRENCE_TESTS=ON . "$@"
