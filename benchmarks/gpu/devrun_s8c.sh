#!/usr/bin/env bash
# Session 8, call 3 (device tool, carry [".whl"]): the helpers' second scripts (gdn_dense_s8 --plan b: the new
# dense Mosaic defaults together and their GPU tests; gdn_varlen_s8 --plan b: varlen16 / tiny64 for the
# AUTO_VARLEN decision; gdn_decode_s8 --run 2: deferred scalars and the plain-box ring). $OUT/w -> $OUT/s8c.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-370} TAIL=30
source "$(dirname "$0")/steps.sh"
step gdn_dense_s8b 130 python benchmarks/gpu/gdn_dense_s8.py --plan b --budget 120
step gdn_varlen_s8b 120 python benchmarks/gpu/gdn_varlen_s8.py --plan b --no-tests --no-fla --budget 110
step gdn_decode_s8b 120 python benchmarks/gpu/gdn_decode_s8.py --run 2 --budget 110
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s8c.tgz" -C "$W" .
