#!/usr/bin/env bash
# Session 8's final H200 run (device tool, carry [".whl"]), from the committed code: the GDN kernel rows (pallas,
# mosaic_gpu, FLA, jla; the slow XLA reference column is left out) and the GDN decode rows (with the Mosaic decode
# kernel as its own column), merged into a copy of
# benchmarks/results/h200.json, every column timed by jax_gdn.timing. The attention section was measured in call 1
# (devrun_s8a.sh) on unchanged attention code. Everything lands in $OUT/w, packed into $OUT/final.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-560} TAIL=16
source "$(dirname "$0")/steps.sh"
cp benchmarks/results/h200.json "$W/h200.json"
step kernels 440 python -m jax_gdn.bench --merge --impls pallas,mosaic_gpu,fla,jla --out "$W/h200.json"
step decode 110 python -m jax_gdn.bench --no-kernels --decode --merge --out "$W/h200.json"
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/final.tgz" -C "$W" . && cp "$W/h200.json" "$R/h200.json"
