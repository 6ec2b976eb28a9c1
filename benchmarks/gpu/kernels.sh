#!/usr/bin/env bash
# One device run for the fused kernels (issues 19, 20): build, the standalone CUDA tests (SDK MMA
# helpers, tensor-core tree state pass) with compute-sanitizer, the fused GDN / SSD GPU tests against
# the float64 oracle, the model GPU tests, and the GDN / SSD benchmarks. Everything logs into $OUT.
#   PARTS="mma state gdn ssd models bench sanitize" (default all) picks the parts;
#   BUDGET_S (default 540) bounds the whole run: later parts are skipped when time runs out.
source "$(dirname "$0")/common.sh"
# $OUT takes at most 8 files: the run log there, everything else in $LOGS, packed into $OUT/logs.tgz.
LOGS=/tmp/kernel-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
PARTS=${PARTS:-"mma state gdn ssd models bench sanitize"}
BUDGET_S=${BUDGET_S:-540}
has() { [[ " $PARTS " == *" $1 "* ]]; }
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
NVCC=(nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isdk/include -Icore/include)
pytest_part() {  # name seconds test-file [pytest args...]: one file, -s (the per-stage tables), no -x
  local name=$1 secs=$2 file=$3; shift 3
  [ -f "$file" ] || { stamp "$name: $file absent"; return; }
  local l; l=$(left); [ "$secs" -gt "$l" ] && secs=$l
  [ "$secs" -lt 20 ] && { stamp "$name: skipped (no time left)"; return; }
  stamp "$name (${secs}s max)"
  timeout "$secs" python3 -m pytest "$file" "$@" -q -s -p no:cacheprovider -rfE --tb=short >"$LOGS/$name.log" 2>&1
  echo "  pytest exit $?"; grep -E "passed|failed|FAILED|ERROR|Error" "$LOGS/$name.log" | tail -${TAIL:-12} | cut -c1-240
}
{
stamp "build (parts: $PARTS)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
if has mma; then
  "${NVCC[@]}" tests/cuda/test_mma.cu -o /tmp/test_mma >"$LOGS/cuda_tests.log" 2>&1 && /tmp/test_mma 2>&1 | tee -a "$LOGS/cuda_tests.log"
fi
if has state && [ -f tests/cuda/test_chunk_state_pass_tc.cu ]; then
  stamp "state pass (tensor cores) test"
  if "${NVCC[@]}" -lineinfo tests/cuda/test_chunk_state_pass_tc.cu sdk/kernels/chunk_state_pass_tc.cu -o /tmp/test_cspt \
      >>"$LOGS/cuda_tests.log" 2>&1; then
    timeout 60 /tmp/test_cspt 2>&1 | tee -a "$LOGS/cuda_tests.log" | tail -30
    timeout 60 /tmp/test_cspt --bench 2>&1 | tee -a "$LOGS/cuda_tests.log" | tail -6
    if has sanitize; then
      timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 /tmp/test_cspt >"$LOGS/sanitizer.log" 2>&1; echo "  memcheck exit $?"
      timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 /tmp/test_cspt >>"$LOGS/sanitizer.log" 2>&1; echo "  racecheck exit $?"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$LOGS/sanitizer.log" | head
    fi
  else
    echo "  state pass test: compile FAILED"; tail -20 "$LOGS/cuda_tests.log"
  fi
fi
stamp "package build"
build_step "$LOGS/build.log"
has gdn && pytest_part gdn_fwd 100 tests/python/test_gdn_fused_gpu.py
has gdn && pytest_part gdn_bwd 120 tests/python/test_gdn_fused_bwd_gpu.py
has ssd && pytest_part ssd_fwd 100 tests/python/test_ssd_fused_gpu.py
has ssd && pytest_part ssd_bwd 120 tests/python/test_ssd_fused_bwd_gpu.py
has models && pytest_part gpu_models 150 tests/python/test_gpu.py
if has bench; then
  for b in gdn ssd; do
    l=$(left); [ "$l" -lt 40 ] && { stamp "$b bench skipped"; continue; }
    stamp "$b bench"
    timeout $(( l < 150 ? l : 150 )) python3 benchmarks/${b}_bench.py --out "$OUT/${b}_bench.json" >"$LOGS/${b}_bench.txt" 2>&1
    echo "  bench exit $?"; cut -c1-200 "$LOGS/${b}_bench.txt" | tail -${BENCH_TAIL:-24}
  done
fi
stamp done
} 2>&1 | tee "$LOGS/kernels_run.log"
tar -czf "$OUT/logs.tgz" -C "$LOGS" . && cp "$LOGS/kernels_run.log" "$OUT/"
