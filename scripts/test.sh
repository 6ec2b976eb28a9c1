#!/usr/bin/env bash
# Runs every test: set-up (scripts/setup.sh), the C++ suites (ctest)
# (placeholder) and the Python suites (pytest), all with the
# interpreter scripts/python-env.sh picks (.venv, or PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python-env.sh
echo "== ctest"
ctest --test-dir build/py --output-on-failure
echo "== pytest"
"$PY" -m pytest tests/python -q -p no:cacheprovider
