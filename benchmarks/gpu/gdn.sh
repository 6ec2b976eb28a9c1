#!/usr/bin/env bash
# One device run: build, the chunked GDN GPU tests against the float64 oracle, and the GDN
# tree scan benchmark (benchmarks/gdn_bench.py). Logs and JSON into $OUT (and benchmarks/results/).
source "$(dirname "$0")/common.sh"
{
stamp build
build_step "$OUT/build.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
stamp bench
timeout ${BENCH_S:-110} python3 benchmarks/gdn_bench.py --out "$OUT/gdn_bench.json" 2>&1 | tail -12
cp "$OUT/gdn_bench.json" benchmarks/results/gdn_bench.json 2>/dev/null
stamp tests
timeout ${TESTS_S:-100} python3 -m pytest tests/python/test_gdn_chunked.py -q -p no:cacheprovider -k CUDA -rA 2>&1 | tail -25
stamp done
} 2>&1 | tee "$OUT/gdn_run.log"
