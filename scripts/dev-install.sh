#!/usr/bin/env bash
# Rebuilds and reinstalls the package from this checkout (incremental: build/ is kept).
# Serialized with a lock so parallel sessions never build into the same folder at once.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/tree-recurrence-build.lock \
  python3 -m pip install --no-build-isolation --no-deps -q . "$@"
