#!/bin/bash
# Session 10, call 3 (issue 14): the direct Mosaic decode kernel's layouts (rows bv64 / bv128, strided rows) timed
# beside the copies and the Triton default at N256 / N64 / N1, the GDN layer's decode step through
# decode.BACKEND = "mosaic" with each as the default config (gdn_decode_s9.py --run 3; its GPU tests: the direct and
# switch tests of the Mosaic decode file), and ptxas's register counts of the strided layout.
export STEPS_DIR=$OUT/s10c DEADLINE=${DEADLINE:-400}
source benchmarks/gpu/steps.sh
D=$STEPS_DIR
TAIL=60 step decode_r3 330 python benchmarks/gpu/gdn_decode_s9.py --run 3 --budget 300 --test-timeout 90
tar czf "$OUT/s10c.tgz" -C "$OUT" s10c
