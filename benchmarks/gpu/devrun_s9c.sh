#!/usr/bin/env bash
# Session 9, call 3 (device tool, carry [".whl"]): the model at 80B dims with the GDN prefill through the op's own
# pick (model_prefill_s9.py: phase 2 alone per route, logits of the XLA / Triton / Mosaic routes, the Mosaic route's
# rows, the layer and slot-route GPU tests), then the helpers' second scripts (gdn_dense_s9 --plan 2: the new split
# defaults on all five dense rows; gdn_decode_s9 --run 2: the decode kernel's gap to its own-shape copy). Everything
# lands in $OUT/w, packed into $OUT/s9c.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-560} TAIL=24
source "$(dirname "$0")/steps.sh"
step model 250 python benchmarks/gpu/model_prefill_s9.py --rows-for auto --budget 245 --test-timeout 80
step gdn_dense_s9_2 155 python benchmarks/gpu/gdn_dense_s9.py --plan 2 --budget 150 --test-timeout 75
step gdn_decode_s9_2 145 python benchmarks/gpu/gdn_decode_s9.py --run 2 --budget 140
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s9c.tgz" -C "$W" .
