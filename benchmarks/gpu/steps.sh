# Sourced by the one-call GPU run scripts of this folder (devrun_s5.sh, final_s5.sh): the environment, the peers'
# wheels, and `step NAME LIMIT_S COMMAND...`, which runs COMMAND with OUT=$STEPS_DIR/NAME under
# min(LIMIT_S, what is left of $DEADLINE s since sourcing), keeps its stdout / stderr there and prints its rc,
# seconds and last ${TAIL:-12} lines; a step with under ${STEP_MIN_S:-20} s left is skipped.
# Set STEPS_DIR and DEADLINE before sourcing.
export PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p "$STEPS_DIR"
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$STEPS_DIR/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
T0=$(date +%s)
step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - ($(date +%s) - T0) ))
  if [ "$left" -lt "${STEP_MIN_S:-20}" ]; then echo "== $name skipped (${left}s left)"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  mkdir -p "$STEPS_DIR/$name"
  local s=$(date +%s)
  OUT="$STEPS_DIR/$name" timeout "$limit" "$@" >"$STEPS_DIR/$name/stdout.txt" 2>"$STEPS_DIR/$name/stderr.txt"
  local rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - s ))s (limit ${limit}s)"
  tail -n "${TAIL:-12}" "$STEPS_DIR/$name/stdout.txt"
}
