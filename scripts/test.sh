#!/usr/bin/env bash
# Runs every test: set-up (scripts/setup.sh), the C++ suites (ctest), the sanitizer job (the
# torch-free core and its C++ suites built with -fsanitize=address,undefined: scripts/asan.sh) and
# the Python suites (pytest, fuzzing and hostile plugin folders included), all with the interpreter
# scripts/python-env.sh picks (.venv, or PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python-env.sh
echo "== ctest"
ctest --test-dir build/py --output-on-failure --no-tests=error  # a build without the C++ suites fails here, never passes empty
echo "== sanitizers (address, undefined): core and C++ suites in build/asan"
bash scripts/asan.sh
echo "== pytest"
"$PY" -m pytest tests/python -q -p no:cacheprovider
