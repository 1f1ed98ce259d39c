#!/usr/bin/env bash
# Session 6's first H200 call (device tool, carry [".whl"]): the per-kernel profiles (model decode / prefill,
# attention layer), the GPU-marked tests that had never run on a GPU, the persistent state pass on serve256.
# Everything under $OUT/w, packed into $OUT/run.tgz (the tool returns at most 8 files).
R=${OUT:-/tmp/out}; W=$R/w
STEPS_DIR=$W DEADLINE=${DEADLINE:-470} STEP_MIN_S=25 TAIL=${TAIL:-10}
source "$(dirname "$0")/steps.sh"
TAIL=70 step profile 230 python benchmarks/gpu/profile_s6.py --budget 200
TAIL=25 step gpu_tests 170 python -m pytest -q -m gpu -p no:randomly -p no:cacheprovider -rf \
  tests/pallas_kernels/test_gdn_mosaic_gpu.py tests/pallas_kernels/test_gated_delta_rule_persistent.py \
  tests/pallas_kernels/test_moe_routing.py tests/pallas_kernels/test_paged_attention_cudnn.py \
  "tests/pallas_kernels/test_paged_attention.py" -k "gpu"
TAIL=20 step gdn_v5 70 python benchmarks/gpu/gdn_v5.py --budget 55 --steps "prefill serve256,numerics serve256 bf16"
echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/run.tgz" -C "$W" . ; ls -la "$R"
