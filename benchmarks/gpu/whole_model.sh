#!/usr/bin/env bash
# One device run: build, the tree conv / tree_flex GPU tests, the tree conv bandwidth
# benchmark (with one ncu-profiled launch of each kernel when ncu is there), and the whole-model
# benchmark at the GRPO shape for the three model kinds, cut at DEADLINE_S seconds after start
# (bench.json is written after every point). Results into $OUT (<= 8 files) and benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT" benchmarks/results
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONWARNINGS=ignore TRL_EXPERIMENTAL_SILENCE=1
start=$(date +%s)
DEADLINE_S=${DEADLINE_S:-265}
stamp() { echo "[$(( $(date +%s) - start ))s] $*"; }
{
stamp build
bash scripts/gpu-build.sh >/tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
tail -1 /tmp/build.log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
stamp tests
timeout 60 python3 -m pytest tests/python/test_gpu.py tests/python/test_tree_conv_op.py -q -p no:cacheprovider \
  -k "conv" 2>&1 | tail -6
stamp conv-bench
python3 benchmarks/tree_conv_bench.py --out "$OUT" 2>&1 | tail -8
if [ -n "${NCU:-}" ] && command -v ncu >/dev/null; then
  stamp ncu
  timeout 45 ncu --clock-control none --kernel-name regex:"vec_kernel" --launch-count 2 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/tree_conv_bench.py --once >"$OUT/ncu.txt" 2>&1
  grep -E "vec_kernel|duration|dram__" "$OUT/ncu.txt" | head -24
fi
left=$(( DEADLINE_S - 35 - ($(date +%s) - start) ))
stamp "whole-model (${left}s left)"
timeout $left python3 -m tree_recurrence bench --out "$OUT" --prompts ${PROMPTS:-2048,0,4096} \
  --checkpointing ${CKPT:-off} --warmup 1 --repeat ${REPEAT:-2} 2>/tmp/bench.stderr | tee "$OUT/bench.txt"
tail -c 1500 /tmp/bench.stderr
stamp "flex GPU test (compiled kernel warm from the benchmark)"
timeout 35 python3 -m pytest tests/python/test_gpu.py -q -p no:cacheprovider -k flex 2>&1 | tail -4
cp -f "$OUT"/bench.json "$OUT"/bench.png "$OUT"/tree_conv_bench.json benchmarks/results/ 2>/dev/null
stamp done
} 2>&1 | tee "$OUT/log.txt"
