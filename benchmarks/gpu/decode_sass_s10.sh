#!/bin/bash
# Session 10, call 1 (issue 14): the decode kernels' machine code and, where ncu reads the counters (Firecracker),
# their launch stats, occupancy, warp stalls and memory throughput. Writes $OUT/s10a.tgz.
export STEPS_DIR=$OUT/s10a DEADLINE=${DEADLINE:-420}
source benchmarks/gpu/steps.sh
D=$STEPS_DIR
{ which ptxas nvcc cuobjdump nvdisasm ncu; nvcc --version | tail -2; cat /proc/version; } >"$D/tools.txt" 2>&1
cat "$D/tools.txt"
step dump 150 env XLA_FLAGS="--xla_dump_to=$D/dump" python benchmarks/gpu/decode_sass_s10.py --reps 3
mkdir -p "$D/sass"
ls "$D/dump" | grep -v -E "\.(pb|txt)$" | head -50 >"$D/dump_files.txt"; wc -l "$D/dump_files.txt"
for f in "$D"/dump/*.ptx; do
  [ -e "$f" ] || continue
  b=$(basename "$f" .ptx)
  ptxas -arch=sm_90a -v "$f" -o "$D/sass/$b.cubin" >"$D/sass/$b.ptxas.txt" 2>&1
  cuobjdump -sass "$D/sass/$b.cubin" >"$D/sass/$b.sass" 2>&1
  rm -f "$D/sass/$b.cubin"
done
grep -h -E "Compiling entry|Used" "$D"/sass/*.ptxas.txt | head -60
step ncu 200 ncu --clock-control none --target-processes all --kernel-name regex:"gdn|multiply|fusion|decode" \
  --launch-count 12 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
  --section MemoryWorkloadAnalysis --section SchedulerStats python benchmarks/gpu/decode_sass_s10.py --reps 1
tar czf "$OUT/s10a.tgz" --exclude='*.pb' --exclude='*.pbtxt' -C "$OUT" s10a
rm -rf "$D/dump"
grep -E "Registers Per Thread|Achieved Occupancy|DRAM Throughput|Duration|^  [a-z_]+.*\(|Block Size|Grid Size|Waves Per SM|Theoretical Occupancy" "$D/ncu/stdout.txt" | head -80
