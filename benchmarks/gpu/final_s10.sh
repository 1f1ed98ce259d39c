#!/usr/bin/env bash
# Session 10's final H200 run (device tool, carry [".whl"]), from the committed code: the GDN decode section of the
# bench (pallas = the op as shipped: the Mosaic direct kernel on Hopper; triton; xla; FLA; the XLA copy) merged into a
# copy of benchmarks/results/h200.json (the table of record); a second sweep of the decode kernels and the layer's
# decode step at 80B dims (gdn_decode_s9.py --run 3, no tests); the GPU tests of everything the decode route touches;
# last, if the deadline allows, the model rows at Qwen3-Next-80B dims (8 layers) with the shipped defaults. Everything
# lands in $OUT/w, packed into $OUT/final.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-590} TAIL=16
source "$(dirname "$0")/steps.sh"
cp benchmarks/results/h200.json "$W/h200.json"
step decode 120 python -m jax_gdn.bench --no-kernels --decode --merge --out "$W/h200.json"
TAIL=40 step decode_r3 170 python benchmarks/gpu/gdn_decode_s9.py --run 3 --budget 150 --no-tests
TAIL=30 step gpu_tests 170 python -m pytest -q -rA --tb=short -s -p no:cacheprovider -m gpu \
  tests/pallas_kernels/test_gdn_decode_mosaic.py tests/pallas_kernels/test_gdn_decode.py \
  tests/layers/test_gdn_decode_step.py
STEP_MIN_S=100 TAIL=30 step model 150 python benchmarks/gpu/model_prefill_s9.py --rows-for auto --budget 140 --no-tests
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/final.tgz" -C "$W" . && cp "$W/h200.json" "$R/h200.json"
