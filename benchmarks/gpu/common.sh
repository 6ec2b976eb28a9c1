# Preamble shared by the device-run scripts of benchmarks/gpu/ (sourced, never run): strict pipes,
# the repository root as the working folder, $OUT (default benchmarks/results) and benchmarks/results/
# created, the GPU build's site folder on PYTHONPATH, and stamp (seconds since start, then a label).
# build_step LOG: scripts/gpu-build.sh into LOG; on failure its tail and exit 1, else its last line.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" benchmarks/results
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
build_step() {
  bash scripts/gpu-build.sh >"$1" 2>&1 || { tail -40 "$1"; exit 1; }
  tail -1 "$1"
}
