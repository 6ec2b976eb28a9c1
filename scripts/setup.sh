#!/usr/bin/env bash
# Installs everything tree-recurrence needs on a fresh Debian machine, then builds and installs the
# package (C++ core, plugins, bindings) into the project's virtual environment .venv (created here;
# PYTHON=/path/to/python installs into that interpreter's environment instead). Nothing is
# installed outside the checkout besides the Debian packages. Idempotent and incremental: packages
# already present are skipped, the build folder (build/py) is reused. Any failure stops the script
# with the failing tool's own message.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
apt_packages=(g++ cmake ninja-build ccache libboost1.81-dev libyaml-cpp-dev doctest-dev python3-venv)
missing=()
for p in "${apt_packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "== apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

source scripts/python-env.sh
echo "== python: $PY"

# pip's own output (what it downloads, with its progress bar on a terminal) shows it is alive;
# torch alone is a few GB on a fresh machine.
echo "== pip install -r scripts/requirements.txt"
"$PY" -m pip install -r scripts/requirements.txt

echo "== build and install tree-recurrence (build folder build/py; ninja's [step/total] counter follows)"
bash scripts/dev-install.sh --verbose-build
"$PY" -c "import tree_recurrence" || { echo "tree_recurrence failed to import after install" >&2; exit 1; }
echo "== set-up done: $PY"
