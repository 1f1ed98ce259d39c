#!/usr/bin/env bash
# The GPU runner: the peers' wheels, their environment, then the GPU tests and / or benchmark sections, one process
# each, logs under $OUT and a short table last.
#
# usage (from the repository root, on the GPU machine, with the peers' wheels carried in .whl/):
#   bash benchmarks/gpu.sh [STEP ...]
#     STEP: tests (pytest -m gpu) or a section of python -m benchmarks (gdn backward decode attention moe layers model
#     model_35b serving serving_35b train sharding); hf_check (HF on FLA's kernels against HF's torch path at each
#     of HF_CHECK_DIMS, default both presets of benchmarks.configs.MODEL_DIMS); peers (gathers the FlashQLA / FlashInfer stack's parts from the carried .peers<i>/
#     folders, benchmarks/stage_peers.sh, and unpacks it once every part has come, one call each while the machine
#     is warm); qla, fi (the gdn section's FlashQLA / FlashInfer column, each in a process with that stack only and
#     not FLA's); default: tests
#   environment: OUT (default /tmp/out) gets run.log (the sections), tests.log, the results JSON and PNG each
#     step wrote; TESTS (the test files or node ids of the tests step, default tests: every GPU test, which
#     takes longer than one call: 7-56 s per test under 4 workers, compile and run);
#     COMMIT (the commit to stamp;
#     the tree on the GPU machine has no .git); BUDGET (seconds for all steps, default 570: a step gets what is left,
#     the next ones are skipped once less than 20 s remain); BENCH_ARGS (more options for every section, e.g.
#     "--cases B1-T8192-Hk16-Hv32").
# Each section merges into benchmarks/results/<device>.json of this tree (<device>x2.json for sharding) and the
# file is copied to $OUT: copy it back over the committed one before the next call, whose tree is sent afresh.
# Wall time of each step on one H200, from the code (compile + timing), first call of a fresh machine:
#   tests: 10 backward and model tests in 121 s (pytest-xdist's wheel carried in .whl/: 4 workers); gdn ~5 min (8 cases x pallas, mosaic_gpu, FLA (autotunes on its first call per shape), jla);
#   decode ~1.5 min; attention ~2 min; moe ~2 min; layers ~1.5 min; model ~5 min (our rows ~1.5 min, HF in a child
#   ~2 min, the 48-layer compile in a child ~0.5 min, the parts ~1.5 min); sharding (2 GPUs) ~8 min.
set -o pipefail
OUT=${OUT:-/tmp/out}
BUDGET=${BUDGET:-570}
mkdir -p "$OUT"
start=$SECONDS
touch "$OUT/.start"
export PYTHONUNBUFFERED=1
export FLA_FLASH_QLA=0                       # FLA's plain Triton kernels: the path every FLA figure was taken on
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # NVLink multicast stays off

# the peers (FLA, jax-linear-attention) as wheels, once per machine
if ls .whl/*.whl >/dev/null 2>&1; then
  stamp=/tmp/site/.installed-$(ls .whl/*.whl | md5sum | cut -c1-12)
  if [ ! -e "$stamp" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >"$OUT/pip.log" 2>&1 && touch "$stamp" || { echo "pip install failed: $OUT/pip.log"; tail -5 "$OUT/pip.log"; }
  fi
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/ carried: the FLA and jla columns will be null"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,memory.used --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1
python3 -c "import fla, jla, torch, transformers; print('fla', fla.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" 2>&1 | tail -1

# the FlashQLA and FlashInfer stacks (benchmarks/stage_peers.sh): parts carried over several calls, unpacked once all
# have come, into /tmp/peers (fi/: the unpacked FlashInfer tree) and /tmp/qla (FlashQLA's wheels installed)
gather_peers() {
  local parts=/tmp/peer-parts want have sum
  mkdir -p "$parts"
  for d in .peers[0-9]*; do [ -d "$d" ] && cp -n "$d"/* "$parts"/; done
  [ -e /tmp/peers/.ready ] && { echo "peers: unpacked already"; return 0; }
  [ -e "$parts/manifest" ] || { echo "peers: no .peers<i>/ part carried (benchmarks/stage_peers.sh)"; return 1; }
  want=$(awk '/^parts/ {print $2}' "$parts/manifest"); have=$(ls "$parts"/peers.tar.xz.part* 2>/dev/null | wc -l)
  if [ "$have" -lt "$want" ]; then echo "peers: $have of $want parts here; carry the others next"; return 0; fi
  cat "$parts"/peers.tar.xz.part* > /tmp/peers.tar.xz
  sum=$(sha256sum /tmp/peers.tar.xz | cut -d' ' -f1)
  [ "$sum" = "$(awk '/^sha256/ {print $2}' "$parts/manifest")" ] || { echo "peers: checksum mismatch"; return 1; }
  mkdir -p /tmp/peers && tar -C /tmp/peers -xJf /tmp/peers.tar.xz && rm -f /tmp/peers.tar.xz
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/qla /tmp/peers/qla/*.whl \
    >"$OUT/pip-qla.log" 2>&1 || { echo "peers: FlashQLA's install failed: $OUT/pip-qla.log"; return 1; }
  touch /tmp/peers/.ready && echo "peers: FlashQLA in /tmp/qla, FlashInfer in /tmp/peers/fi"
}
peer_path() {         # the PYTHONPATH of a peer's own process: its stack and this tree, not FLA's wheels
  case $1 in
    qla) echo "/tmp/qla:$PWD" ;;
    fi)  echo "/tmp/peers/fi:/tmp/peers/fi/nvidia_cutlass_dsl/dsl_packages:$PWD" ;;
  esac
}

commit=()
[ -n "$COMMIT" ] && commit=(--commit "$COMMIT")
summary=()
for step in ${*:-tests}; do
  left=$((BUDGET - (SECONDS - start)))
  if [ "$left" -lt 20 ]; then summary+=("$step skipped (${left} s of the budget left)"); continue; fi
  t0=$SECONDS
  echo "== $step (${left} s left)" | tee -a "$OUT/run.log"
  case $step in
    tests)      # -v: each test's name and outcome reach the log as it ends (a cut run still says what passed)
      # 4 workers, 4 host threads each: with 8 workers and torch / XLA taking every core each, a test took 5-10x
      # longer (4 tests in 300 s; 4 x 4 on 16 cores: 10 in 121 s)
      workers=()
      python3 -c "import xdist" 2>/dev/null && workers=(-n 4)
      # no preallocation: each worker would take 75% of the GPU's memory and the others then run out
      XLA_PYTHON_CLIENT_PREALLOCATE=false OMP_NUM_THREADS=4 timeout "$left" python3 -m pytest -v -m gpu ${TESTS:-tests} --ignore=tests/test_notebooks.py -p no:randomly \
        -p no:cacheprovider "${workers[@]}" --durations=10 >"$OUT/tests.log" 2>&1   # the notebooks need jupyter
      rc=$?
      grep -oE "(PASSED|FAILED|ERROR|SKIPPED) tests" "$OUT/tests.log" | sort | uniq -c      # outcomes, counted
      grep -oE "(FAILED|ERROR) \S+" "$OUT/tests.log" | head -20
      res=$(tail -1 "$OUT/tests.log") ;;
    model|model_35b)   # HF runs in a child process beside JAX: JAX takes its memory as it goes
      # with the peers' stack unpacked, HF runs a second time on FLA's default path with FlashQLA (column hf_qla)
      [ -e /tmp/peers/.ready ] && export QLA_SITE=/tmp/qla CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
      XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "$left" python3 -m benchmarks "$step" --budget $((left - 15)) \
        "${commit[@]}" $BENCH_ARGS 2>&1 | tee -a "$OUT/run.log"
      rc=${PIPESTATUS[0]} ;;
    hf_check)     # HF on FLA's kernels against HF's own torch path, 2 layers of each of HF_CHECK_DIMS
      rc=0
      for dims in ${HF_CHECK_DIMS:-qwen3_next_80b qwen3_5_35b_a3b}; do
        timeout "$left" python3 -m benchmarks.model --hf-check --dims "$dims" 2>"$OUT/hf_check_$dims.err" \
          | tail -1 >"$OUT/hf_check_$dims.json"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[2], {k: {m: round(r[k][m], 5)
          for m in ('cos_min', 'cos_median', 'top1_agree', 'rel')} for k in ('prefill', 'decode')})" \
          "$OUT/hf_check_$dims.json" "$dims" 2>&1 | tee -a "$OUT/run.log"
      done
      res="see hf_check_<dims>.json" ;;
    peers)
      gather_peers 2>&1 | tee -a "$OUT/run.log"
      rc=${PIPESTATUS[0]}; res=$(tail -1 "$OUT/run.log") ;;
    qla|fi)       # TileLang (FlashQLA) calls nvcc and compiles each new shape on its first call (30-40 s)
      if [ ! -e /tmp/peers/.ready ]; then
        rc=1; res="the peers' stack is not unpacked: run the peers step first"
      else
        cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
        PYTHONPATH=$(peer_path "$step") CUDA_HOME=$cuda_home timeout "$left" python3 -m benchmarks gdn \
          --impls "$step" "${commit[@]}" $BENCH_ARGS 2>&1 | tee "$OUT/$step.log" | tee -a "$OUT/run.log"
        rc=${PIPESTATUS[0]}; res=$(grep -E "^gdn +[0-9]+ +(ok|FAILED)" "$OUT/$step.log" | tail -1)   # this step's
      fi ;;
    sharding)
      timeout "$left" python3 -m benchmarks sharding --budget $((left - 15)) "${commit[@]}" $BENCH_ARGS 2>&1 \
        | tee -a "$OUT/run.log"
      rc=${PIPESTATUS[0]} ;;
    *)
      timeout "$left" python3 -m benchmarks "$step" "${commit[@]}" $BENCH_ARGS 2>&1 | tee -a "$OUT/run.log"
      rc=${PIPESTATUS[0]} ;;
  esac
  case $step in tests|peers|qla|fi|hf_check) ;; *) res=$(grep -E "^$step +[0-9]+ +(ok|FAILED)" "$OUT/run.log" | tail -1) ;; esac
  [ "$rc" = 124 ] && res="cut at the budget ($left s)"
  summary+=("$step rc=$rc $((SECONDS - t0)) s: $res")
done
find benchmarks/results -newer "$OUT/.start" -type f \( -name "*.json" -o -name "*.png" \) -exec cp {} "$OUT"/ \;
rm -f "$OUT/.start"
echo
echo "== gpu.sh: $((SECONDS - start)) s; results copied to \$OUT: $(cd "$OUT" && ls *.json *.png 2>/dev/null | tr '\n' ' ')"
for line in "${summary[@]}"; do echo "  $line"; done
