#!/usr/bin/env bash
# The GPU test suite in ONE pytest process (issue 24): every tests/test_*.py that has a `gpu`-marked test, found
# by grep (a new file with GPU tests joins by itself), run with `-m gpu`, so a test that leaves process-wide torch
# state changed (TF32, threads, default dtype; tests/conftest.py fails it) shows here, not only in a lone file.
# Usage: bash benchmarks/gpu_suite.sh OUT_DIR [extra pytest args, e.g. -x or -k name]
# Writes OUT_DIR/gpu_suite.log (the whole output), OUT_DIR/gpu_suite.xml (junit) and OUT_DIR/gpu_suite_files.txt.
# GPU_SUITE_TIMEOUT (seconds, default 560: under a 10-minute remote call) interrupts pytest with SIGINT, which
# still writes the summary and the junit file of the tests that ran. Exit status: pytest's (124 on timeout).
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_suite.sh OUT_DIR [pytest args]}
shift
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mapfile -t files < <(grep -lE '(^|[^A-Za-z_])pytest\.mark\.gpu\b' tests/test_*.py | sort)
if [ ${#files[@]} -eq 0 ]; then
  echo "no test file has a gpu-marked test" | tee "$out/gpu_suite.log"
  exit 2
fi
printf '%s\n' "${files[@]}" > "$out/gpu_suite_files.txt"
{
  echo "gpu suite: ${#files[@]} files in one process: ${files[*]}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: none"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$out/gpu_suite.log"
timeout -s INT -k 30 "${GPU_SUITE_TIMEOUT:-560}" \
  python -m pytest -q -m gpu -p no:cacheprovider --durations=25 -rfEs --junitxml="$out/gpu_suite.xml" "$@" \
  "${files[@]}" 2>&1 | tee -a "$out/gpu_suite.log"
status=${PIPESTATUS[0]}
echo "gpu suite exit status $status" | tee -a "$out/gpu_suite.log"
exit "$status"
