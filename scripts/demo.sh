#!/usr/bin/env bash
# The main job: set-up, then a tiny real Qwen3.5 on a TRL tree-packed batch vs its samples alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >&2
python3 examples/demo.py "$@"
