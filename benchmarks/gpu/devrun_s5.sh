#!/usr/bin/env bash
# Session 5's one development run on the H200: every helper's GPU script in one device call, each with its own
# time limit and its outputs under $OUT/<name>/ (device tool, carry [".whl"]). The tool returns at most 8 files
# from $OUT: this run lost most of its logs that way (final_s5.sh packs them into one archive).
STEPS_DIR=${OUT:-/tmp/out} DEADLINE=560 STEP_MIN_S=25
source "$(dirname "$0")/steps.sh"
step route_probe 60 python benchmarks/gpu/route_probe.py
step parts 125 python benchmarks/gpu/model_bench.py --check --no-hf --budget 100
step attn_cudnn 120 python benchmarks/gpu/attn_cudnn.py --budget 100
step attn_decode 95 python benchmarks/gpu/attn_decode.py --budget 75
step gdn_v5 95 python benchmarks/gpu/gdn_v5.py --budget 75
step jla_study 60 python benchmarks/gpu/jla_probe.py --budget 45
echo "total $(( $(date +%s) - T0 ))s"
