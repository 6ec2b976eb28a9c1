#!/usr/bin/env bash
# One device run for the Mamba2 SSD tree scan: build, its CUDA tests (chunked op vs the
# float64 oracle, tiny models tree vs samples alone through the split and fused seams), and
# benchmarks/ssd_bench.py. Logs and JSON to $OUT and benchmarks/results/. Stays under ~290 s.
source "$(dirname "$0")/common.sh"
stamp build
build_step "$OUT/ssd_build.log"
stamp op-tests
timeout 60 python3 -m pytest tests/python/test_ssd_chunked.py -q -p no:cacheprovider -k Cuda >"$OUT/ssd_op_tests.log" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/ssd_op_tests.log" | tail -12
stamp bench
timeout 110 python3 benchmarks/ssd_bench.py --out benchmarks/results/ssd_bench.json >"$OUT/ssd_bench.txt" 2>&1
echo "bench exit $?"; cut -c1-400 "$OUT/ssd_bench.txt" | tail -8
cp benchmarks/results/ssd_bench.json "$OUT/" 2>/dev/null
stamp model-tests
left=$(( 285 - ($(date +%s) - start) ))
[ $left -gt 15 ] && timeout $left python3 -m pytest tests/python/test_mamba2_models.py -q -p no:cacheprovider \
  -k "gpu and (nemotron_h or mamba2 or bamba or granitemoehybrid)" >"$OUT/ssd_model_tests.log" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|Error|assert" "$OUT/ssd_model_tests.log" | tail -12
stamp done
