#!/usr/bin/env bash
# Session 7, device call 4 (carry [".whl"]): the helpers' second runs (Mosaic varlen, the Mosaic split's start
# states, the Mosaic decode kernel, the recurrent short-sequence kernel's plan b).
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-330} TAIL=30
source "$(dirname "$0")/steps.sh"
step mosaic_varlen 95 python benchmarks/gpu/gdn_mosaic_varlen.py --budget 70
step mosaic_split 95 python benchmarks/gpu/gdn_mosaic_split.py --budget 70
step decode_mosaic 80 python benchmarks/gpu/gdn_decode_mosaic.py --budget 60
step short_varlen 60 python benchmarks/gpu/gdn_short_varlen.py --budget 45 --plan b
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s7d.tgz" -C "$W" .
