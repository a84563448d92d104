#!/usr/bin/env bash
# Issue 8 in one device call: the GPU tests, then every timing. Usage: bash benchmarks/run_gpu.sh OUT_DIR
# Each section has its own time limit so one slow part cannot starve the others; logs and JSON go to OUT_DIR.
# Needs the repository's dependencies (jsonargparse too: carry its wheel where the GPU image lacks it).
set -uo pipefail
out=${1:?usage: bash benchmarks/run_gpu.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
for f in tests/test_kernels.py tests/test_fastpath.py tests/test_gpu.py tests/test_dvl.py; do
  timeout 150 python -m pytest -q -m gpu -p no:cacheprovider "$f" 2>&1 | tail -25 | tee -a "$out/gpu_tests.log"
done
timeout 60 python -m dscale_runtime.kernels.bench_attention --output "$out/attention.json" 2>&1 | tail -30 | tee "$out/attention.log"
timeout 240 python benchmarks/gpu_step.py --time-budget 190 --out "$out/gpu_step.json" 2>&1 | tail -60 | tee "$out/gpu_step.log"
timeout 110 python benchmarks/demo_gpu_e2e.py --prompts 64 --max-tokens 128 --concurrency 8 16 32 --out "$out/e2e.json" 2>&1 | tail -12 | tee "$out/e2e.log"
