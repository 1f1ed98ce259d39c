#!/usr/bin/env bash
# Session 9, call 2 (device tool, carry [".whl"]): the model's 8-layer logits with the GDN prefill on XLA, Triton and
# Mosaic (model_prefill_s9.py --logits-only), then the helpers' first scripts (gdn_dense_s9: the Hk2-Hv8 split;
# gdn_decode_s9: decode ceilings and kernel configs). Everything lands in $OUT/w, packed into $OUT/s9b.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-575} TAIL=30
source benchmarks/gpu/steps.sh
step model_logits 120 python benchmarks/gpu/model_prefill_s9.py --logits-only --no-tests --budget 110
step gdn_dense_s9 195 python benchmarks/gpu/gdn_dense_s9.py --budget 190
step gdn_decode_s9 245 python benchmarks/gpu/gdn_decode_s9.py --budget 240
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s9b.tgz" -C "$W" .
