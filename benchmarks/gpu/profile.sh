#!/usr/bin/env bash
# One device run: build, then where the fused GDN / SSD cores spend their time (torch.profiler, per
# kernel, benchmarks/profile_kernels.py) and ncu's speed-of-light (achieved % of DRAM bandwidth and of
# SM / tensor throughput) of each of our kernels. Logs into $OUT.
source "$(dirname "$0")/common.sh"
OURS='regex:(cb|chunk_scan|chunk_state|dbdc|ddecay|dqk|dv_local|dyx|finalize|gate|local|out_fwd|prep_fwd|rows|state_pass|tc_backward|tc_forward|wy)_kernel'
{
stamp build
build_step /tmp/profile-build.log
stamp profile
TORCH_SHOW_CPP_STACKTRACES=1 timeout 120 python3 benchmarks/profile_kernels.py --repeats 3 2>&1
for fam in gdn ssd; do
  stamp "ncu $fam"
  timeout ${NCU_S:-100} ncu --clock-control none --section SpeedOfLight --section Occupancy -k "$OURS" -c ${NCU_COUNT:-14} \
    python3 benchmarks/profile_kernels.py --once --family $fam >"$OUT/ncu_$fam.txt" 2>&1
  echo "  ncu exit $?"
  grep -E "^  [a-z_]+_kernel|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Duration|Achieved Occupancy|Registers Per|Block Limit Shared" "$OUT/ncu_$fam.txt" | head -${NCU_LINES:-120} | cut -c1-150
done
stamp done
} 2>&1 | tee "$OUT/profile_run.log"
