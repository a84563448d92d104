# Sourced by the one-call GPU scripts (step_kernels_gpu.sh, prefill_gap_gpu.sh, fallback_gpu.sh, issue24_gpu.sh):
#   gpu_call OUT_DIR NAME   the caller's setup: $out (OUT_DIR, made and absolute), the repository root as the working
#                           directory and on PYTHONPATH, $summary = $out/NAME.log, status=0, and $pool: the Qwen3-8B
#                           engines' pool on an H100 (98,304 tokens: the default sizing fills an H200's 141 GB)
#   run NAME SECONDS CMD... one part under its own time bound, its output in $out/NAME.log and its tail (SUMMARY_TAIL
#                           lines, default 40) in $summary; a part that fails sets $status, the others still run
#   part NAME               whether NAME is one of the space-separated $PARTS (the caller sets their default)
# The caller ends with `exit "$status"`.
gpu_call() {
  out=$1
  mkdir -p "$out" && out=$(cd "$out" && pwd)
  cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
  export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  summary="$out/$2.log"
  status=0
  pool=()
  if nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H100; then
    pool=(--kv-cache-tokens 98304)
  fi
}

run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$summary"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -"${SUMMARY_TAIL:-40}" >> "$summary"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc" | tee -a "$summary"
  [ "$rc" -eq 0 ] || status=$rc
}

part() {
  [[ " $PARTS " == *" $1 "* ]]
}
