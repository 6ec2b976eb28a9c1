#!/usr/bin/env bash
# Two-GPU FSDP2 run of benchmarks/fsdp2_tree.py on the device machine (nvidia-h200-x2):
# builds and installs (scripts/gpu-build.sh), then the tiny and the mid-size models, each under a
# wall-clock limit so one stuck run cannot eat the rest. Logs and JSON go to $OUT (default
# benchmarks/results). NVLink multicast stays off (the device's KINDS.md): exported here, and
# the script sets them again for its own processes.
# Usage: OUT=/some/dir bash benchmarks/fsdp2_tree_gpu.sh [seconds for the whole run, default 330]
# (SKIP_BUILD=1: use what is installed)
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-benchmarks/results}
BUDGET=${1:-330}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/fsdp2_gpus.txt" 2>&1
if [ -z "${SKIP_BUILD:-}" ] && ! bash scripts/gpu-build.sh > "$OUT/fsdp2_build.log" 2>&1; then
  tail -30 "$OUT/fsdp2_build.log"; exit 1
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
run() {  # name, seconds, args: one torchrun (one failing model cannot take the others down)
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/fsdp2_tree.py \
    --timeout 90 --out "$OUT/fsdp2_tree_gpu_$name.json" "$@" > "$OUT/fsdp2_tree_gpu_$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc at ${SECONDS}s"
  grep -E "^\[fsdp2_tree\]" "$OUT/fsdp2_tree_gpu_$name.log" || tail -20 "$OUT/fsdp2_tree_gpu_$name.log"
  return $rc
}
echo "== built at ${SECONDS}s"
status=0
if ! run tiny 100 --size tiny; then
  # a native kernel that fails on this GPU should not cost the timings: the mid runs then take the
  # bound kernels (fork / rescan); the JSON's "decisions" say what ran
  status=1; export TREE_RECURRENCE_PREFER_NATIVE=0; echo "== mid runs with TREE_RECURRENCE_PREFER_NATIVE=0"
fi
for model in qwen3_5_text nemotron_h; do
  left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 40 ]; then echo "== mid $model: skipped, ${left}s left"; status=1; continue; fi
  [ "$model" = qwen3_5_text ] && left=$(( left * 55 / 100 ))  # leave the Nemotron-H run its share
  run "mid_$model" "$left" --size mid --models "$model" || status=1
done
exit $status
