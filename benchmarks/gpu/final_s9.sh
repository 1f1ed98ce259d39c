#!/usr/bin/env bash
# Session 9's final H200 run (device tool, carry [".whl"]), from the committed code: the GDN kernel rows (pallas,
# mosaic_gpu, FLA, jla; the slow XLA reference column is left out) and the GDN decode rows, merged into a copy of
# benchmarks/results/h200.json, every column timed by jax_gdn.timing. The model rows come from call 3
# (model_prefill_s9.py); the attention section is unchanged since session 8. Everything lands in $OUT/w, packed into
# $OUT/final.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-570} TAIL=16
source "$(dirname "$0")/steps.sh"
cp benchmarks/results/h200.json "$W/h200.json"
step kernels 450 python -m jax_gdn.bench --merge --impls pallas,mosaic_gpu,fla,jla --out "$W/h200.json"
step decode 110 python -m jax_gdn.bench --no-kernels --decode --merge --out "$W/h200.json"
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/final.tgz" -C "$W" . && cp "$W/h200.json" "$R/h200.json"
