#!/usr/bin/env bash
# Session 8, call 2 (device tool, carry [".whl"]): the three helpers' first GPU scripts, one step each
# (gdn_decode_s8: the Mosaic decode ring sweep; gdn_dense_s8: dense Mosaic rows against jla; gdn_varlen_s8: the
# Mosaic varlen copies and kkt against Triton and FLA). Everything lands in $OUT/w, packed into $OUT/s8b.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-520} TAIL=30
source "$(dirname "$0")/steps.sh"
step gdn_decode_s8 150 python benchmarks/gpu/gdn_decode_s8.py
step gdn_dense_s8 180 python benchmarks/gpu/gdn_dense_s8.py
step gdn_varlen_s8 180 python benchmarks/gpu/gdn_varlen_s8.py
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s8b.tgz" -C "$W" .
