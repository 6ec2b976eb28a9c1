#!/usr/bin/env bash
# Runs every test: set-up (scripts/setup.sh), the C++ suites (ctest) and the Python suites (pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ctest"
ctest --test-dir build/py --output-on-failure
echo "== pytest"
python3 -m pytest tests/python -q -p no:cacheprovider
