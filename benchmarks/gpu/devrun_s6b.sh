#!/usr/bin/env bash
# Session 6's development run on the H200 (device tool, carry [".whl"]): the runtime probe (decode launch options)
# and every helper's GPU script, each with its own time limit, outputs under $OUT/w/<name>/, packed into
# $OUT/run.tgz (the tool returns at most 8 files).
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-565} STEP_MIN_S=30 TAIL=${TAIL:-16}
source "$(dirname "$0")/steps.sh"
TAIL=20 step runtime 175 python benchmarks/gpu/runtime_s6.py --budget 160
step attn_layer 105 python benchmarks/gpu/attn_layer_s6.py --budget 90
step attn_decode 105 python benchmarks/gpu/attn_decode_s6.py --budget 90
step gdn_decode 95 python benchmarks/gpu/gdn_decode_s6.py --budget 80
TAIL=24 step gdn_mosaic 125 python benchmarks/gpu/gdn_mosaic_s6.py --budget 110
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/run.tgz" -C "$W" . ; ls -la "$R"
