#!/usr/bin/env bash
# Device run: an earlier revision and this checkout, built one after the other on the same card, our GDN /
# SSD core rows timed in one call (the check that a change keeps the default paths' speed). The device copy
# has no git history, so the earlier sources travel as an untracked folder made on this machine first:
#   rm -rf .baseline && mkdir .baseline && git archive <REV> | tar -x -C .baseline
# (not ignored by git, so the device tool carries it; delete it afterwards). Then on the device:
#   OUT=$OUT bash benchmarks/gpu/bench_pair.sh       CASES (default tree,flat,chains,forest), BENCH_S
# writes $OUT/{gdn,ssd}_{base,new}.json and prints each bench's table.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/bench-pair}; mkdir -p "$OUT"
CASES=${CASES:-tree,flat,chains,forest}
[ -d .baseline/scripts ] || { echo ".baseline/ is missing: see the header of this script" >&2; exit 2; }
nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
for side in base new; do
  if [ $side = base ]; then
    cd "$ROOT/.baseline"
    sed -i 's#/tmp/tree-recurrence-build#/tmp/tree-recurrence-build-base#' scripts/gpu-build.sh  # its own build folder
  else
    cd "$ROOT"
  fi
  t0=$(date +%s)
  bash scripts/gpu-build.sh >"/tmp/build_$side.log" 2>&1 || { tail -30 "/tmp/build_$side.log"; exit 1; }
  echo "[$side] built in $(( $(date +%s) - t0 )) s"
  for b in gdn ssd; do
    timeout "${BENCH_S:-150}" python3 benchmarks/${b}_bench.py --peers off --cases "$CASES" --budget-s 140 \
      --out "$OUT/${b}_$side.json" >"/tmp/${b}_$side.txt" 2>&1
    echo "[$side] $b exit $?"; tail -"${TAIL:-8}" "/tmp/${b}_$side.txt" | cut -c1-160
  done
done
