#!/usr/bin/env bash
# One device run for chunk_state_pass (the shared chunked tree state pass): build, its CUDA tests
# (against the CPU op and the float64 oracle), compute-sanitizer memcheck + racecheck on a small
# case, and the micro-benchmark at the GRPO shape. Logs and JSON to $OUT and benchmarks/results/.
source "$(dirname "$0")/common.sh"
stamp build
build_step "$OUT/csp_build.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
stamp tests
timeout 120 python3 -m pytest tests/python/test_chunk_state_pass.py -q -x -p no:cacheprovider -k "cuda" \
  >"$OUT/csp_tests.log" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/csp_tests.log" | tail -8
stamp sanitizer
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    timeout 45 compute-sanitizer --tool $tool \
      python3 benchmarks/chunk_state_pass_bench.py --small >"$OUT/csp_sanitizer_$tool.log" 2>&1
    echo "$tool exit $?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Error" "$OUT/csp_sanitizer_$tool.log" | head -5
  done
fi
stamp bench
timeout 60 python3 benchmarks/chunk_state_pass_bench.py --out benchmarks/results/chunk_state_pass_h200.json 2>&1
stamp done
