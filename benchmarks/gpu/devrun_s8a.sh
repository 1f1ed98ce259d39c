#!/usr/bin/env bash
# Session 8, call 1 (device tool, carry [".whl"]): the decode-attention op's combine forms under the one timing
# method (attn_decode_s8.py), then the bench's attention section (every column timed by jax_gdn.timing) into a copy
# of benchmarks/results/h200.json. Everything lands in $OUT/w, packed into $OUT/s8a.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-230} TAIL=16
source "$(dirname "$0")/steps.sh"
cp benchmarks/results/h200.json "$W/h200.json"
step attn_decode 75 python benchmarks/gpu/attn_decode_s8.py --budget 60
step attention 120 python -m jax_gdn.bench --no-kernels --attention --merge --out "$W/h200.json"
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s8a.tgz" -C "$W" . && cp "$W/h200.json" "$R/h200.json"
