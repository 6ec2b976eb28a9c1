#!/usr/bin/env bash
# One device run (issue 14): build, the tree conv GPU tests, the tree conv bandwidth benchmark
# (with one ncu-profiled launch of each kernel when ncu is there), and the whole-model benchmark
# at the GRPO shape for the three model kinds. Results into benchmarks/results/ and $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" benchmarks/results
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore TRL_EXPERIMENTAL_SILENCE=1
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
stamp build
bash scripts/gpu-build.sh >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
tail -1 "$OUT/build.log"
stamp tests
python3 -m pytest tests/python/test_gpu.py tests/python/test_tree_conv_op.py -q -x -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/tests.log"
stamp conv-bench
python3 benchmarks/tree_conv_bench.py --out "$OUT" 2>&1 | tee "$OUT/tree_conv_bench.txt"
if command -v ncu >/dev/null; then
  stamp ncu
  timeout 90 ncu --clock-control none --kernel-name regex:"vec_kernel|grad_x_kernel|forward_kernel" --launch-count 4 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/tree_conv_bench.py --once >"$OUT/ncu.txt" 2>&1; grep -E "vec_kernel|duration|dram__" "$OUT/ncu.txt" | head -24
fi
stamp whole-model
timeout ${BENCH_TIMEOUT:-200} python3 -m tree_recurrence bench --out "$OUT" --prompts ${PROMPTS:-0,2048,4096} \
  --checkpointing ${CKPT:-off} --warmup 1 --repeat 2 2>"$OUT/bench.stderr" | tee "$OUT/bench.txt"
tail -5 "$OUT/bench.stderr"
cp -f "$OUT"/bench.json "$OUT"/bench.png "$OUT"/tree_conv_bench.json benchmarks/results/ 2>/dev/null
stamp done
