#!/usr/bin/env bash
# Session 7, device call 1 (carry [".whl"]): the GPU tests that never ran on a GPU (one pytest per file, each
# under its own limit, -v so a hang names its test), the Mosaic plan-c measurements (exp2, per stage, the split
# at P = 1/2/4/8) and the paged decode split counts (the op at 64x4096 repeated, the decode layer at NS 2/3/4).
# Everything lands in $OUT/w and is packed into $OUT/s7a.tgz.
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-450} TAIL=16
source "$(dirname "$0")/steps.sh"
PT="python -m pytest -m gpu -v -p no:randomly -p no:cacheprovider -x --no-header -rfE"
step t_mosaic 75 $PT tests/pallas_kernels/test_gdn_mosaic_gpu.py
step t_cudnn 45 $PT tests/pallas_kernels/test_paged_attention_cudnn.py
step t_moe_routing 30 $PT tests/pallas_kernels/test_moe_routing.py
step t_decode 50 $PT tests/layers/test_gdn_decode_step.py tests/pallas_kernels/test_gdn_decode.py
step t_persistent 30 $PT tests/pallas_kernels/test_gated_delta_rule_persistent.py
step mosaic_c 110 python benchmarks/gpu/gdn_mosaic_s6.py --plan c --budget 100
step attn_decode 100 python benchmarks/gpu/attn_decode_s6.py --steps op,layer --budget 90
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s7a.tgz" -C "$W" .
