#!/usr/bin/env bash
# Session 6's final H200 run (device tool, carry [".whl"]): the whole-model section with the session's defaults
# (our rows and parts; HF's rows kept from the stored run: HF's code did not change), then the attention, layer,
# GDN kernel and decode sections merged into a copy of benchmarks/results/h200.json, every anchor in this run.
# Everything lands in $OUT/w and is packed into $OUT/final.tgz (the tool brings back at most 8 files).
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-540} TAIL=8
source "$(dirname "$0")/steps.sh"
cp benchmarks/results/h200.json "$W/h200.json"
TAIL=14 step model 190 python benchmarks/gpu/model_bench.py --no-hf --no-compile --budget 165 --reps 3
step attention 80 python -m jax_gdn.bench --no-kernels --attention --merge --out "$W/h200.json"
step layers 55 python -m jax_gdn.bench --layers-only --layer-backends pallas,cudnn --out "$W/h200.json"
step kernels 170 python -m jax_gdn.bench --merge --out "$W/h200.json"
step decode 45 python -m jax_gdn.bench --no-kernels --decode --merge --out "$W/h200.json"
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/final.tgz" -C "$W" . && cp "$W/h200.json" "$R/h200.json" && cp "$W/model/model.json" "$R/model.json" 2>/dev/null
ls -la "$R"
