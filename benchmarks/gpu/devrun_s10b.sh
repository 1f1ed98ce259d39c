#!/bin/bash
# Session 10, call 2 (issue 14): the Mosaic GPU decode kernel's direct transfer (decode_mosaic, transfer="direct")
# timed beside the XLA copy, the Pallas copy and the Triton default (gdn_decode_s9.py --run 3, numerics and GPU tests
# included), then ncu's launch stats (registers, occupancy, DRAM throughput) of every kernel (decode_sass_s10.py).
export STEPS_DIR=$OUT/s10b DEADLINE=${DEADLINE:-480}
source benchmarks/gpu/steps.sh
D=$STEPS_DIR
TAIL=40 step decode_r3 260 python benchmarks/gpu/gdn_decode_s9.py --run 3 --budget 230 --test-timeout 60
step ptxas 60 env MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/gpu/decode_sass_s10.py --reps 1 \
  --only mosaic_rows64,mosaic_rows128,mosaic_wgmma64,mosaic_rows64_copy
step ncu 150 ncu --clock-control none --target-processes all --kernel-name regex:"gdn|multiply|fusion|decode|mosaic" \
  --launch-count 16 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis python benchmarks/gpu/decode_sass_s10.py --reps 1 \
  --only mosaic_rows64,mosaic_rows128,mosaic_wgmma64,mosaic_rows64_copy,pcopy_copy,tri_default
tar czf "$OUT/s10b.tgz" -C "$OUT" s10b
grep -E "^  [a-zA-Z_]+.*\(|Registers Per Thread|Theoretical Occupancy|DRAM Throughput|Duration" "$D/ncu/stdout.txt" | head -60
