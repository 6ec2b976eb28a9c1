#!/usr/bin/env bash
# The main job: set-up, then a tiny real Qwen3.5 on a TRL tree-packed batch vs its samples alone.
# Uses the interpreter scripts/python-env.sh picks (.venv, or PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
source scripts/python-env.sh
"$PY" examples/demo.py "$@"
