# Sourced by the one-call GPU scripts (step_kernels_gpu.sh, prefill_gap_gpu.sh, fallback_gpu.sh, issue24_gpu.sh):
# `run NAME SECONDS COMMAND...` runs one part under its own time bound, its output in $out/NAME.log and its tail
# (SUMMARY_TAIL lines, default 40) in $summary; a part that fails sets $status and does not stop the others. The
# caller sets `out`, `summary` and `status=0`, and ends with `exit "$status"`.
run() {
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$summary"
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -"${SUMMARY_TAIL:-40}" >> "$summary"
  local rc=${PIPESTATUS[0]}
  echo "== $name exit $rc" | tee -a "$summary"
  [ "$rc" -eq 0 ] || status=$rc
}
