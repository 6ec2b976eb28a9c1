#!/usr/bin/env bash
# One short device run for the SSD backward (issue 20), its parts in priority order so that a run cut short
# (a small device budget) keeps the most important results: build; the GPU tests of the newest backward changes
# (NEW_K, a pytest -k expression); the tree / flat bench and the flat row with the previous kernels
# (BEFORE_ENV, variables set for that run only) and with one of them (ONE_ENV); memcheck and racecheck on NEW_SAN tests; the whole SSD
# backward and post test files; the chains / forest bench. Logs under /tmp/ssd-quick, packed into
# $OUT/logs.tgz after every part; bench JSONs in $OUT.
#   NEW_K="dz_written or ring" BEFORE_ENV="TREE_RECURRENCE_SSD_BWD_STATE_RING=0" bash benchmarks/gpu/ssd_bwd_quick.sh
source "$(dirname "$0")/common.sh"
export TREE_RECURRENCE_TEST_OPS=1
L=/tmp/ssd-quick; rm -rf "$L"; mkdir -p "$L"
pack() { tar czf "$OUT/logs.tgz" -C /tmp ssd-quick; }
T=tests/python/test_ssd_fused_bwd_gpu.py
NEW_K=${NEW_K:-"dz_written or ring"}
NEW_SAN=${NEW_SAN:-"$T::test_state_pass_ring_bitwise[long_tree-PN256] $T::test_dz_written_over_the_saved_y[mixed]"}
RACE_SAN=${RACE_SAN:-"$T::test_state_pass_ring_bitwise[flat-PN2048] $T::test_dz_written_over_the_saved_y[mixed]"}
BEFORE_ENV=${BEFORE_ENV:-"TREE_RECURRENCE_SSD_BWD_STATE_RING=0 TREE_RECURRENCE_SSD_BWD_LOCAL_TILE=64"}
bench() {  # out-json cases [env...]
  local out=$1 cases=$2; shift 2
  env "$@" timeout 120 python3 benchmarks/ssd_bench.py --peers off --cases "$cases" --out "$OUT/$out" >"$L/$out.txt" 2>&1
  echo "  bench exit $?"; grep -E "^(tree|flat|chains|forest) " "$L/$out.txt" | cut -c1-120
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
stamp "build"; build_step "$L/build.log"
stamp "new tests: -k '$NEW_K'"
timeout 150 python3 -m pytest "$T" -k "$NEW_K" -q -s -p no:cacheprovider -rfE --tb=short >"$L/new.log" 2>&1
echo "  pytest exit $?"; grep -E "passed|failed|FAILED|dz over y|state pass ring|Error" "$L/new.log" | cut -c1-240; pack
stamp "bench tree, flat"; bench ssd_bench.json tree,flat
stamp "bench flat with $BEFORE_ENV"; bench ssd_bench_before.json flat $BEFORE_ENV
[ -n "${ONE_ENV-TREE_RECURRENCE_SSD_BWD_LOCAL_TILE=64}" ] && { stamp "bench flat with ${ONE_ENV-TREE_RECURRENCE_SSD_BWD_LOCAL_TILE=64}"
  bench ssd_bench_one.json flat ${ONE_ENV-TREE_RECURRENCE_SSD_BWD_LOCAL_TILE=64}; }; pack
san() {  # tool seconds tests...
  local tool=$1 secs=$2; shift 2
  local filt=(); [ "$tool" = racecheck ] && filt=(--kernel-name kns=tree_recurrence)
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$secs" compute-sanitizer --tool "$tool" --error-exitcode 9 ${filt[@]+"${filt[@]}"} \
    python3 -m pytest "$@" -q -p no:cacheprovider -rfE --tb=short >"$L/san_$tool.log" 2>&1
  echo "  $tool exit $? (0 clean, 9 sanitizer errors, 1 test failures, 124 timeout)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$L/san_$tool.log" | sort | uniq -c | head -6
}
stamp "memcheck"; san memcheck 100 $NEW_SAN; pack
stamp "racecheck"; san racecheck 120 $RACE_SAN; pack
stamp "SSD backward + post test files"
timeout ${ALL_S:-200} python3 -m pytest "$T" tests/python/test_ssd_post_bwd_gpu.py -q -p no:cacheprovider -rfE --tb=short >"$L/all.log" 2>&1
echo "  pytest exit $?"; grep -E "passed|failed|FAILED" "$L/all.log" | tail -8 | cut -c1-240; pack
stamp "bench chains, forest"; bench ssd_bench_chains.json chains,forest; pack
stamp "done"
