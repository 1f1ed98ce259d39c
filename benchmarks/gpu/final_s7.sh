#!/usr/bin/env bash
# Session 7's final H200 run (device tool, carry [".whl"]): the sections whose code changed this session, merged
# into a copy of benchmarks/results/h200.json (every anchor of a section in the same run): the whole model (our
# rows and parts; HF's rows kept from the stored run: HF's code did not change), the GDN kernel rows (every column
# but the slow XLA reference, FLA and jla included), the GDN decode rows, and (if the deadline allows) helper D's Mosaic
# decode kernel timed beside Triton (off by default; never timed before). The attention section is not re-run (its
# code did not change; 549 device-seconds were left). Everything lands in $OUT/w, packed into $OUT/final.tgz (the tool brings back at most 8 files).
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-470} TAIL=10
source "$(dirname "$0")/steps.sh"
cp benchmarks/results/h200.json "$W/h200.json"
TAIL=14 step model 200 python benchmarks/gpu/model_bench.py --no-hf --no-compile --budget 175 --reps 5
step kernels 180 python -m jax_gdn.bench --merge --impls pallas,mosaic_gpu,fla,jla --out "$W/h200.json"
step decode 50 python -m jax_gdn.bench --no-kernels --decode --merge --out "$W/h200.json"
STEP_MIN_S=40 step decode_mosaic 55 python benchmarks/gpu/gdn_decode_mosaic.py --budget 45
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/final.tgz" -C "$W" . && cp "$W/h200.json" "$R/h200.json" && cp "$W/model/model.json" "$R/model.json" 2>/dev/null
ls -la "$R"
