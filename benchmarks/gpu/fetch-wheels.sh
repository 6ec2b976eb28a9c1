#!/usr/bin/env bash
# Downloads (on the development machine) the wheels the GPU machine lacks for the model tests and the
# whole-model bench into .whl/ (ignored by git; carry it: `run` with carry [".whl", ...]; scripts/gpu-build.sh
# installs it into /tmp/site there). trl imports datasets, which imports multiprocess, dill and xxhash at
# import time: without them the model GPU tests fail with ModuleNotFoundError. Versions are the
# development environment's (.venv), so both machines run the same ones. pyarrow and pandas (datasets' other
# needs) are large: pass --with-arrow when the GPU machine lacks them.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pkgs=(trl datasets multiprocess dill xxhash)
[ "${1:-}" = "--with-arrow" ] && pkgs+=(pyarrow pandas)
specs=(); for p in "${pkgs[@]}"; do specs+=("$p==$(ver "$p")"); done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl "${specs[@]}"
ls -la .whl; du -sh .whl
