#!/bin/bash
# Session 10, call 5 (issue 14): after the final run, two things it got wrong or left out. (1) The layer's decode
# step against the Triton kernel: in the final run decode.BACKEND was already "auto", so the script's "tri default"
# layer label ran the Mosaic kernel too (fixed in gdn_decode_s9.py: Triton labels pin BACKEND "triton"). (2) The model
# rows at Qwen3-Next-80B dims (8 layers) with the shipped defaults (Mosaic prefill and decode): the final run's model
# step ran out of its deadline before them.
export STEPS_DIR=$OUT/s10e DEADLINE=${DEADLINE:-420}
source benchmarks/gpu/steps.sh
TAIL=30 step decode_r3 130 python benchmarks/gpu/gdn_decode_s9.py --run 3 --budget 110 --no-tests
TAIL=30 step model 260 python benchmarks/gpu/model_prefill_s9.py --rows-for auto --budget 240 --no-tests
tar czf "$OUT/s10e.tgz" -C "$OUT" s10e
