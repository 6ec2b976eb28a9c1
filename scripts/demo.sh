#!/usr/bin/env bash
# The main job: set-up, then a tiny real Qwen3.5 on a TRL tree-packed batch vs its samples alone.
# Uses the interpreter scripts/python-env.sh picks (.venv, or PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
source scripts/python-env.sh
# The demo packs its row with trl.experimental (pinned trl 1.16); its "experimental API" warning is
# explained in the README and silenced here.
TRL_EXPERIMENTAL_SILENCE=1 "$PY" examples/demo.py "$@"
