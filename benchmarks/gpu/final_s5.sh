#!/usr/bin/env bash
# Session 5's final H200 run (device tool, carry [".whl"]): the whole-model section with the new defaults (our
# rows and parts; HF's rows are kept from the stored run: HF's code did not change), the attention and layer
# sections merged into a copy of benchmarks/results/h200.json, then GPU tests of kernels never run on a GPU.
# Everything lands in $OUT/w and is packed into $OUT/final.tgz (the tool brings back at most 8 files).
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
R=${OUT:-/tmp/out}; W=$R/w; mkdir -p "$W"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$W/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
DEADLINE=${DEADLINE:-290}
T0=$(date +%s)
step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - T0) ))
  if [ "$left" -lt 20 ]; then echo "== $name skipped (${left}s left)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  mkdir -p "$W/$name"
  local s=$(date +%s)
  OUT="$W/$name" timeout "$limit" "$@" >"$W/$name/stdout.txt" 2>"$W/$name/stderr.txt"
  echo "== $name rc=$? $(( $(date +%s) - s ))s (limit ${limit}s)"
  tail -n ${TAIL:-8} "$W/$name/stdout.txt"
}
cp benchmarks/results/h200.json "$W/h200.json"
TAIL=14 step model 185 python benchmarks/gpu/model_bench.py --no-hf --no-compile --budget 160 --reps 3
step attention 75 python -m jax_gdn.bench --no-kernels --attention --merge --out "$W/h200.json"
step layers 60 python -m jax_gdn.bench --layers-only --layer-backends pallas,cudnn --out "$W/h200.json"

echo "total $(( $(date +%s) - T0 ))s"
tar czf "$R/final.tgz" -C "$W" . && cp "$W/h200.json" "$R/h200.json" && cp "$W/model/model.json" "$R/model.json" 2>/dev/null
ls -la "$R"
