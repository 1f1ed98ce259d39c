#!/usr/bin/env bash
# Session 7, device call 2 (carry [".whl"]): the decode-step GEMM split (attention decode layer, NS 2, split-K
# 2/4/8, and the same under XLA_FLAGS=--xla_gpu_enable_triton_gemm=false), helper R's short-sequence recurrent
# kernel, helper D's Mosaic decode kernel, and the GPU tests call 1 cut off (longer limits).
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-420} TAIL=14
source "$(dirname "$0")/steps.sh"
PT="python -m pytest -m gpu -v -p no:randomly -p no:cacheprovider --no-header -rfE"
step attn_layer 60 python benchmarks/gpu/attn_decode_s6.py --steps layer --budget 50
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false step attn_layer_cublas 50 python benchmarks/gpu/attn_decode_s6.py --steps layer --budget 40
step short_varlen 100 python benchmarks/gpu/gdn_short_varlen.py --budget 70
step decode_mosaic 90 python benchmarks/gpu/gdn_decode_mosaic.py --budget 60
step t_cudnn_q 40 $PT tests/pallas_kernels/test_paged_attention_cudnn.py -k q_prologue
step t_persistent 60 $PT tests/pallas_kernels/test_gated_delta_rule_persistent.py
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/s7b.tgz" -C "$W" .
