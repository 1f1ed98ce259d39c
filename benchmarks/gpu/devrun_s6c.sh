#!/usr/bin/env bash
# Session 6's second development run on the H200 (device tool, carry [".whl"]): the decode calls under the
# profiler (host vs device time of a step), and the helpers' second runs (attention layer variants, the two-pass
# GDN decode kernel, the Mosaic GDN rows run 1 left out), one archive.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-330} STEP_MIN_S=30 TAIL=${TAIL:-16}
source "$(dirname "$0")/steps.sh"
TAIL=40 step runtime 80 python benchmarks/gpu/runtime_s6.py --budget 75 --trace-only
step attn_layer 90 python benchmarks/gpu/attn_layer_s6.py --budget 80 --variants current,all_cond,all_merge,all_cond_qp,all_merge_qp,fused_w --tag attn_layer_s6b
step gdn_decode 60 python benchmarks/gpu/gdn_decode_s6.py --budget 50 --two-pass-only --steps "numerics kernel,kernel N256,kernel N64"
TAIL=24 step gdn_mosaic 100 python benchmarks/gpu/gdn_mosaic_s6.py --budget 90 --plan b
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/run.tgz" -C "$W" . ; ls -la "$R"
