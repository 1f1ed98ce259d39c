#!/usr/bin/env bash
# One device-tool call: wheels, GPU tests, per-stage timing, benchmark. Logs and h200.json land in $OUT.
# usage (device tool, carry [".whl"]): bash benchmarks/gpu_session.sh [tests|stages|bench ...]
set -o pipefail
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python -c "import jax, fla, jla; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -2
steps=${*:-tests stages bench}   # "bench" includes the layer rows (--layers)
for s in $steps; do
  case $s in
    # kernel tests first (a command is cut at 600 s: the whole gpu set took ~5 min on 2026-11-30)
    tests)  timeout 540 python -m pytest -q -s -m gpu tests/pallas_kernels tests/layers tests/model tests/ops \
              -p no:randomly -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "FIGURE|passed|failed|Error|error" | head -40 ;;
    stages) timeout 300 python benchmarks/stages.py ${STAGE_CASES:-} 2>&1 | tee "$OUT/stages.log" | grep -v "^\s*$" | tail -60 ;;
    bench)  timeout 500 python -m jax_gdn.bench --layers --out "$OUT/h200.json" 2>&1 | tee "$OUT/bench.log" | tail -25 ;;
  esac
done
