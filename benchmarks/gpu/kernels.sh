#!/usr/bin/env bash
# One device run for the fused kernels: build, the standalone CUDA tests (SDK MMA helpers,
# tensor-core tree state pass) with compute-sanitizer, the fused GDN / SSD GPU tests against the
# float64 oracles, the model GPU tests, and the GDN / SSD benchmarks. Everything logs into $OUT.
#   PARTS="mma state gdn ssd models bench sanitize" (default all) picks the parts; opt-in parts
#   (not in the default, each wants most of a run of its own):
#     large        the 2^31-element rows (test_{gdn,ssd}_fused_large_gpu.py; TREE_RECURRENCE_LARGE_TESTS=1,
#                  GDN >= 80 GiB free, SSD >= 75), e.g. PARTS="large"
#     chunks       the SSD flat row at chunk 128 and 256 (CHUNKS), beside the bench's chunk 64
#     profile      torch.profiler per kernel (benchmarks/profile_kernels.py)
#     ncu          Nsight Compute speed-of-light of every kernel of ours; ncu_detail: --set full of a few
#     modelbench   the whole-model `python -m tree_recurrence bench --prompts 2048` for BENCH_MODELS
#                  (default "qwen3_5 nemotron_h"); MB_CKPT (default off) is its --checkpointing
#     memprobe     benchmarks/saved_memory_probe.py per model (BENCH_MODELS) at the GRPO shape
#     sanitize_py  compute-sanitizer memcheck (PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor its own
#                  allocation, so an access past a tensor's end is caught) and racecheck (our kernels
#                  only: --kernel-name kns=tree_recurrence) on a few small cases of the fused GPU
#                  test files, one sanitizer run per family and tool (SAN_S seconds each, default 150)
#   Order: fused tests, bench, chunks, large, profile, modelbench, memprobe, models, ncu, sanitize_py
#   (later parts get the time left).
#   BENCH_FAMILIES (default "gdn ssd") and BENCH_ARGS (extra arguments, e.g. "--peers off --cases tree,flat")
#   pick the benchmarks' rows.
#   "models" runs tests/python/test_gpu.py and the Mamba2-family GPU model tests (test_mamba2_models.py
#   -k test_gpu_: fp32 and bf16, the split seams and the fused seam); both model files need trl
#   (importorskip: carried as .whl/ wheels, see scripts/gpu-build.sh) or they skip.
#   Bitwise repeatability is in the fused tests themselves: no separate determinism part.
#   SKIP="ssd_fwd san_gdn_memcheck ..." skips the pytest / sanitizer parts of those names (see the logs' names).
#   BUDGET_S (default 540) bounds the whole run: later parts are skipped when time runs out.
source "$(dirname "$0")/common.sh"
export TREE_RECURRENCE_TEST_OPS=1  # the oracle and stage ops (tests only) for the scripts run here outside pytest
# $OUT takes at most 8 files: the run log there, everything else in $LOGS, packed into $OUT/logs.tgz.
LOGS=/tmp/kernel-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
PARTS=${PARTS:-"mma state gdn ssd models bench sanitize"}
BUDGET_S=${BUDGET_S:-540}
has() { [[ " $PARTS " == *" $1 "* ]]; }
left() { echo $(( BUDGET_S - ($(date +%s) - start) )); }
NVCC=(nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Isdk/include -Icore/include)
pytest_part() {  # name seconds test-file [pytest args...]: one file, -s (the per-stage tables), no -x
  local name=$1 secs=$2 file=$3; shift 3
  [[ " ${SKIP:-} " == *" $name "* ]] && { stamp "$name: skipped (SKIP)"; return; }
  [ -f "$file" ] || { stamp "$name: $file absent"; return; }
  local l; l=$(left); [ "$secs" -gt "$l" ] && secs=$l
  [ "$secs" -lt 20 ] && { stamp "$name: skipped (no time left)"; return; }
  stamp "$name (${secs}s max)"
  timeout "$secs" python3 -m pytest "$file" "$@" -q -s -p no:cacheprovider -rfE --tb=short >"$LOGS/$name.log" 2>&1
  echo "  pytest exit $?"; grep -E "passed|failed|FAILED|ERROR|Error" "$LOGS/$name.log" | tail -${TAIL:-12} | cut -c1-240
}
# compute-sanitizer over pytest (part sanitize_py): name tool seconds node-ids...
SAN_S=${SAN_S:-150}
SAN_GDN_MEM=("tests/python/test_gdn_fused_gpu.py::test_stages_against_float64[around_chunk_strong-bf16]"
             "tests/python/test_gdn_fused_gpu.py::test_stages_against_float64[odd_dims_none-bf16]"
             "tests/python/test_gdn_fused_bwd_gpu.py::test_stages[around_chunk]"
             "tests/python/test_gdn_fused_bwd_gpu.py::test_stages[grouped_no_l2]"
             "tests/python/test_gdn_fused_bwd_gpu.py::test_stages[grouped_l2]")
SAN_GDN_RACE=("tests/python/test_gdn_fused_gpu.py::test_stages_against_float64[around_chunk_strong-bf16]"
              "tests/python/test_gdn_fused_bwd_gpu.py::test_stages[around_chunk]"
              "tests/python/test_gdn_fused_bwd_gpu.py::test_stages[grouped_l2]")
SAN_SSD_MEM=("tests/python/test_ssd_fused_gpu.py::test_stages_bf16[around_chunks-64]"
             "tests/python/test_ssd_fused_gpu.py::test_stages_dims[P64N128-dtype0]"
             "tests/python/test_ssd_fused_bwd_gpu.py::test_one_token_segments"
             "tests/python/test_ssd_post_bwd_gpu.py::test_post_pads_wide_shared_h0_fp16"
             "tests/python/test_ssd_fused_bwd_gpu.py::test_tensor_core_model_dims"
             "tests/python/test_ssd_fused_gpu.py::test_pipelined_pass_bitwise_three_kernel[around_chunks-H2P8G2N8-dtype0]"
             "tests/python/test_ssd_fused_gpu.py::test_pipelined_pass_bitwise_three_kernel[long_tree-H4P64G2N128-dtype0]"
             "tests/python/test_ssd_fused_bwd_gpu.py::test_long_segments_two_kernel_route[long_tree-PN256]"
             "tests/python/test_ssd_fused_bwd_gpu.py::test_dz_written_over_the_saved_y[mixed]")
SAN_SSD_RACE=("tests/python/test_ssd_fused_gpu.py::test_stages_bf16[around_chunks-64]"
              "tests/python/test_ssd_fused_bwd_gpu.py::test_tensor_core_model_dims"
              "tests/python/test_ssd_post_bwd_gpu.py::test_post_pads_wide_shared_h0_fp16"
              "tests/python/test_ssd_fused_gpu.py::test_pipelined_pass_bitwise_three_kernel[flat_129-H4P64G2N128-dtype0]"
              "tests/python/test_ssd_fused_gpu.py::test_pipelined_pass_bitwise_three_kernel[long_tree-H4P64G2N128-dtype0]"
              "tests/python/test_ssd_fused_bwd_gpu.py::test_long_segments_two_kernel_route[flat-PN2048]"
              "tests/python/test_ssd_fused_bwd_gpu.py::test_dz_written_over_the_saved_y[mixed]")
sanitize_pytest() {
  local name=$1 tool=$2 secs=$3; shift 3
  [[ " ${SKIP:-} " == *" $name "* ]] && { stamp "$name: skipped (SKIP)"; return; }
  local l; l=$(left); [ "$secs" -gt "$l" ] && secs=$l
  [ "$secs" -lt 30 ] && { stamp "$name: skipped (no time left)"; return; }
  local filt=()
  if [ "$tool" = racecheck ]; then
    local help; help=$(compute-sanitizer --help 2>&1)  # (not piped into grep -q: pipefail + SIGPIPE)
    if [[ $help == *--kernel-name* ]]; then filt=(--kernel-name kns=tree_recurrence)
    else echo "  (this compute-sanitizer has no --kernel-name: racecheck over every kernel)"; fi
  fi
  # only the node ids that exist (a renamed test is reported, not an error that stops the whole run)
  local files ids=() known
  files=$(printf '%s\n' "$@" | sed 's/::.*//' | sort -u | while read -r f; do [ -f "$f" ] && echo "$f"; done)
  known=$(timeout 120 python3 -m pytest --collect-only -q -p no:cacheprovider $files 2>/dev/null)
  for id in "$@"; do
    if grep -qxF -- "$id" <<<"$known"; then ids+=("$id"); else echo "  not collected, skipped: $id"; fi
  done
  [ ${#ids[@]} -eq 0 ] && { stamp "$name: no test left to run"; return; }
  stamp "$name: compute-sanitizer --tool $tool ${filt[*]:-} (${secs}s max), ${#ids[@]} tests"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$secs" compute-sanitizer --tool "$tool" --error-exitcode 9 ${filt[@]+"${filt[@]}"} \
    python3 -m pytest "${ids[@]}" -q -p no:cacheprovider -rfE --tb=short >"$LOGS/$name.log" 2>&1
  echo "  exit $? (0 clean, 9 sanitizer errors, 1 test failures, 124 timeout)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race reported|passed|failed|skipped|FAILED|ERROR|not found" "$LOGS/$name.log" \
    | sort | uniq -c | sort -rn | head -12 | cut -c1-240
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
has gdn && pytest_part gdn_fwd ${GDN_S:-130} tests/python/test_gdn_fused_gpu.py
has gdn && pytest_part gdn_bwd ${GDN_S:-130} tests/python/test_gdn_fused_bwd_gpu.py
has gdn && pytest_part gdn_bwd_shapes ${GDN_S:-130} tests/python/test_gdn_fused_bwd_shapes_gpu.py
has ssd && pytest_part ssd_fwd ${SSD_S:-130} tests/python/test_ssd_fused_gpu.py
has ssd && pytest_part ssd_bwd ${SSD_BWD_S:-200} tests/python/test_ssd_fused_bwd_gpu.py
has ssd && pytest_part ssd_post ${SSD_POST_S:-150} tests/python/test_ssd_post_bwd_gpu.py
if has bench; then
  for b in ${BENCH_FAMILIES:-gdn ssd}; do
    l=$(left); [ "$l" -lt 40 ] && { stamp "$b bench skipped"; continue; }
    stamp "$b bench"
    timeout $(( l < ${BENCH_S:-150} ? l : ${BENCH_S:-150} )) python3 benchmarks/${b}_bench.py --budget-s ${BENCH_BUDGET_S:-400} --out "$OUT/${b}_bench.json" ${BENCH_ARGS:-} >"$LOGS/${b}_bench.txt" 2>&1
    echo "  bench exit $?"; cut -c1-200 "$LOGS/${b}_bench.txt" | tail -${BENCH_TAIL:-24}
  done
fi
if has chunks; then  # the flat row at the other chunk sizes (why the adapters build chunk-64 tables)
  for c in ${CHUNKS:-128 256}; do
    l=$(left); [ "$l" -lt 40 ] && { stamp "ssd chunk $c skipped"; continue; }
    stamp "ssd bench, flat row, chunk $c"
    timeout $(( l < 120 ? l : 120 )) python3 benchmarks/ssd_bench.py --peers off --cases flat --chunk "$c" \
      --out "$OUT/ssd_bench_chunk$c.json" >"$LOGS/ssd_bench_chunk$c.txt" 2>&1
    echo "  bench exit $?"; cut -c1-200 "$LOGS/ssd_bench_chunk$c.txt" | tail -6
  done
fi
if has large; then
  export TREE_RECURRENCE_LARGE_TESTS=1
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
  for fam in gdn ssd; do
    pytest_part ${fam}_large ${LARGE_S:-150} tests/python/test_${fam}_fused_large_gpu.py
    grep -E "^  |big row|does not fit|skipped" "$LOGS/${fam}_large.log" | head -30 | cut -c1-200
  done
fi
if has profile; then
  stamp "profile (per kernel, torch.profiler)"
  timeout $(( $(left) < 90 ? $(left) : 90 )) python3 benchmarks/profile_kernels.py --repeats 3 --layout ${PROFILE_LAYOUT:-both} >"$LOGS/profile.txt" 2>&1
  echo "  profile exit $?"; grep -E "^==|^ +[0-9.]+ +[0-9]+ +[0-9.]+ " "$LOGS/profile.txt" | cut -c1-170 | head -40
fi
if has modelbench; then  # the whole-model bench: tree vs chains vs flat at prompt 2048
  for m in ${BENCH_MODELS:-qwen3_5 nemotron_h}; do
    l=$(left); [ "$l" -lt 60 ] && { stamp "model bench $m skipped"; continue; }
    stamp "model bench $m"
    timeout $(( l < ${MB_S:-180} ? l : ${MB_S:-180} )) python3 -m tree_recurrence bench --model "$m" --prompts 2048 \
      --checkpointing ${MB_CKPT:-off} --warmup 1 --repeat 2 --no-plot --out "$LOGS/modelbench_$m" >"$LOGS/modelbench_$m.txt" 2>&1
    echo "  exit $?"; tail -14 "$LOGS/modelbench_$m.txt" | cut -c1-200
    [ -f "$LOGS/modelbench_$m/bench.json" ] && cp "$LOGS/modelbench_$m/bench.json" "$OUT/modelbench_$m.json"
  done
fi
if has memprobe; then  # what the whole model keeps for backward per token (benchmarks/saved_memory_probe.py)
  for m in ${BENCH_MODELS:-qwen3_5 nemotron_h}; do
    l=$(left); [ "$l" -lt 40 ] && { stamp "memprobe $m skipped"; continue; }
    stamp "memprobe $m"
    timeout $(( l < 90 ? l : 90 )) python3 benchmarks/saved_memory_probe.py --model "$m" --groups 8 --rollouts 8 >"$LOGS/memprobe_$m.txt" 2>&1
    echo "  exit $?"; head -14 "$LOGS/memprobe_$m.txt" | cut -c1-160; tail -1 "$LOGS/memprobe_$m.txt" | cut -c1-160
  done
fi
has models && pytest_part gpu_models ${MODELS_S:-100} tests/python/test_gpu.py
has models && pytest_part mamba2_models_gpu ${MODELS_S:-100} tests/python/test_mamba2_models.py -k test_gpu_
if has ncu; then
  OURS='regex:tree_recurrence::'  # every kernel of ours (demangled names), none of ATen's
  for fam in gdn ssd; do
    l=$(left); [ "$l" -lt 40 ] && { stamp "ncu $fam skipped"; continue; }
    stamp "ncu $fam"
    timeout $(( l < ${NCU_S:-90} ? l : ${NCU_S:-90} )) ncu --clock-control none --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
      --kernel-name-base demangled -k "$OURS" -c ${NCU_COUNT:-16} \
      python3 benchmarks/profile_kernels.py --once --family $fam --layout ${NCU_LAYOUT:-trie} >"$LOGS/ncu_$fam.txt" 2>&1
    echo "  ncu exit $?"
  done
fi
if has ncu_detail; then  # every ncu section (--set full: stall reasons, memory workload, source counters) of a few kernels
  # NCU_DETAIL_K: a regex of demangled kernel names; NCU_DETAIL_FAMS (default "gdn ssd"); NCU_DETAIL_LAYOUT (flat)
  for fam in ${NCU_DETAIL_FAMS:-gdn ssd}; do
    l=$(left); [ "$l" -lt 60 ] && { stamp "ncu_detail $fam skipped"; continue; }
    stamp "ncu_detail $fam"
    timeout $(( l < ${NCU_S:-150} ? l : ${NCU_S:-150} )) ncu --clock-control none --set full --import-source no \
      --kernel-name-base demangled -k "regex:${NCU_DETAIL_K:-prep_fwd|out_fwd|post_bf16|dqk_kernel}" -c ${NCU_COUNT:-4} \
      -o "$LOGS/ncu_detail_$fam" \
      python3 benchmarks/profile_kernels.py --once --family $fam --layout ${NCU_DETAIL_LAYOUT:-flat} >"$LOGS/ncu_detail_run_$fam.txt" 2>&1
    echo "  ncu exit $?"
    if [ -f "$LOGS/ncu_detail_$fam.ncu-rep" ]; then
      ncu -i "$LOGS/ncu_detail_$fam.ncu-rep" --page details --print-details all >"$LOGS/ncu_detail_$fam.txt" 2>&1
      ncu -i "$LOGS/ncu_detail_$fam.ncu-rep" --page source --print-source sass --csv >"$LOGS/ncu_sass_$fam.csv" 2>&1
      wc -c "$LOGS/ncu_detail_$fam.txt" "$LOGS/ncu_sass_$fam.csv"
      grep -E "^  [a-z].*\(|Duration|Warp Cycles Per Issued|Stall|stalled|Theoretical Occ|Registers Per|Shared Memory Config|Bank" \
        "$LOGS/ncu_detail_$fam.txt" | cut -c1-200 | head -60
      rm -f "$LOGS/ncu_detail_$fam.ncu-rep"  # (logs.tgz must stay under 16 MiB)
    fi
  done
fi
if has sanitize_py; then
  if command -v compute-sanitizer >/dev/null; then
    sanitize_pytest san_gdn_memcheck memcheck "$SAN_S" "${SAN_GDN_MEM[@]}"
    sanitize_pytest san_ssd_memcheck memcheck "$SAN_S" "${SAN_SSD_MEM[@]}"
    sanitize_pytest san_gdn_racecheck racecheck "$SAN_S" "${SAN_GDN_RACE[@]}"
    sanitize_pytest san_ssd_racecheck racecheck "$SAN_S" "${SAN_SSD_RACE[@]}"
  else
    stamp "sanitize_py: compute-sanitizer not on PATH"
  fi
fi
stamp done
} 2>&1 | tee "$LOGS/kernels_run.log"
tar -czf "$OUT/logs.tgz" -C "$LOGS" . && cp "$LOGS/kernels_run.log" "$OUT/"
