#!/usr/bin/env bash
# Installs everything tree-recurrence needs on a fresh Debian machine, then builds and installs
# the package (C++ core, plugins, bindings) into the current Python. Idempotent and incremental:
# packages already present are skipped, the build folder (build/py) is reused.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
apt_packages=(g++ cmake ninja-build ccache libboost1.81-dev libyaml-cpp-dev doctest-dev)
missing=()
for p in "${apt_packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
# Pinned to what the GPU machine runs (torch 2.11, transformers 5.17) and the TRL release served.
echo "== pip install dependencies"
$PY -m pip install -q --disable-pip-version-check \
  "torch==2.11.0" "transformers==5.17.0" "trl==1.16.0" \
  "pybind11>=2.12" "scikit-build-core>=0.10" pytest pyyaml 2>&1 | grep -v "Running pip as the 'root' user" || true

echo "== build and install tree-recurrence (build folder build/py)"
# No build isolation: the plugins must be built against the very torch they run with.
flock /tmp/tree-recurrence-build.lock \
  $PY -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps . 2>&1 \
  | grep -v "Running pip as the 'root' user" || true
$PY -c "import tree_recurrence" || { echo "tree_recurrence failed to import after install" >&2; exit 1; }
