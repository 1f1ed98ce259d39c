#!/usr/bin/env bash
# Session 7, device call 3 (carry [".whl"]): helpers S (the Mosaic split's start states) and V (Mosaic varlen)
# scripts, and the decode layer's q prologue A/B (default against the in-kernel prologue, interleaved x3, 5 batches).
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-330} TAIL=30
source "$(dirname "$0")/steps.sh"
step mosaic_split 110 python benchmarks/gpu/gdn_mosaic_split.py --budget 80
step mosaic_varlen 130 python benchmarks/gpu/gdn_mosaic_varlen.py --budget 100
ATTN_AB=1 ATTN_BATCHES=5 step attn_ab 60 python benchmarks/gpu/attn_decode_s6.py --steps layer --budget 50
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s7c.tgz" -C "$W" .
