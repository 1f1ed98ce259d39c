#!/usr/bin/env bash
# Session 9's final H200 run (device tool, carry [".whl"]), from the committed code: the GDN kernel rows (pallas,
# mosaic_gpu, FLA, jla; the slow XLA reference column is left out) and the GDN decode rows, merged into a copy of
# benchmarks/results/h200.json, every column timed by jax_gdn.timing. The model rows come from call 3
# (model_prefill_s9.py); the attention section is unchanged since session 8. Last, if the deadline allows, the
# layer's prefill-route GPU test (call 4 ran it with a jit bug in the test itself). Everything lands in $OUT/w, packed into
# $OUT/final.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-590} TAIL=16
source "$(dirname "$0")/steps.sh"
cp benchmarks/results/h200.json "$W/h200.json"
step kernels 450 python -m jax_gdn.bench --merge --impls pallas,mosaic_gpu,fla,jla --out "$W/h200.json"
step decode 110 python -m jax_gdn.bench --no-kernels --decode --merge --out "$W/h200.json"
STEP_MIN_S=40 TAIL=8 step layer_tests 70 python -m pytest -q -rA --tb=short -s -p no:cacheprovider -m gpu \
  tests/layers/test_gdn_backends.py::test_layer_prefill_kernel_gpu_matches_xla
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/final.tgz" -C "$W" . && cp "$W/h200.json" "$R/h200.json"
