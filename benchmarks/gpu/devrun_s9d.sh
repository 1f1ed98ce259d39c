#!/usr/bin/env bash
# Session 9, call 4 (device tool, carry [".whl"]): the GPU tests of this session's new defaults before the final run:
# helper S9's split defaults (first piece from h0, the Triton piece scan in tf32 above P = 2) against float64, the
# layer's two prefill routes against XLA (small and 80B dims), the Mosaic dense slot route. Output in $OUT/tests.log.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
M=tests/pallas_kernels/test_gdn_mosaic_gpu.py
timeout ${LIMIT:-170} python -m pytest -q -rA --tb=short -s -p no:cacheprovider -m gpu \
  "$M::test_gpu_default_config_matches_f64[4000-2-4]" "$M::test_gpu_split_op_weak_decay_matches_f64[1000-4-True]" \
  "$M::test_gpu_split_op_weak_decay_matches_f64[1000-8-True]" "$M::test_gpu_split_op_weak_decay_matches_f64[1000-2-True]" \
  "$M::test_gpu_split_fast_scan_matches_f64[default]" "$M::test_gpu_split_variants_agree" \
  "tests/layers/test_gdn_backends.py::test_layer_prefill_kernel_gpu_matches_xla" \
  "tests/pallas_kernels/test_gdn_mosaic_varlen.py::test_gpu_slots_api_dense_beside_xla" > "${OUT:-/tmp/out}/tests.log" 2>&1
echo "rc=$?"; grep -E "FIGURE|passed|failed|^FAILED|^E  " "${OUT:-/tmp/out}/tests.log" | tail -40
