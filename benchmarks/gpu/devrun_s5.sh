#!/usr/bin/env bash
# Session 5's one development run on the H200: every helper's GPU script in one device call, each with its own
# time limit and its outputs under $OUT/<name>/ (device tool, carry [".whl"]).
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
ROOT_OUT=${OUT:-/tmp/out}; mkdir -p "$ROOT_OUT"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$ROOT_OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
step() {  # name timeout_s command...
  local name=$1 limit=$2; shift 2
  local left=$(( 560 - ($(date +%s) - T0) ))
  if [ "$left" -lt 25 ]; then echo "== $name skipped (${left}s left)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  mkdir -p "$ROOT_OUT/$name"
  local s=$(date +%s)
  OUT="$ROOT_OUT/$name" timeout "$limit" "$@" >"$ROOT_OUT/$name/stdout.txt" 2>"$ROOT_OUT/$name/stderr.txt"
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - s ))s (limit ${limit}s)"
  tail -n 12 "$ROOT_OUT/$name/stdout.txt"
}
step route_probe 60 python benchmarks/gpu/route_probe.py
step parts 125 python benchmarks/gpu/model_bench.py --check --no-hf --budget 100
step attn_cudnn 120 python benchmarks/gpu/attn_cudnn.py --budget 100
step attn_decode 95 python benchmarks/gpu/attn_decode.py --budget 75
step gdn_v5 95 python benchmarks/gpu/gdn_v5.py --budget 75
step jla_study 60 python benchmarks/gpu/jla_probe.py --budget 45
echo "total $(( $(date +%s) - T0 ))s"
