#!/usr/bin/env bash
# Issues 15 and 18 on the device (2026-12-01): GPU tests, then the timings, in parts that fit one 10-minute call.
# Usage: bash benchmarks/run_gpu_issue15.sh OUT_DIR tests|engine8b|e2e|steps|capacity|dp
# Wheels the GPU image lacks (sglang-router and its dependencies, jsonargparse) are installed from _wheels/ when
# that folder exists (pip download ... -d _wheels on a machine with the registry).
set -uo pipefail
out=${1:?usage: bash benchmarks/run_gpu_issue15.sh OUT_DIR tests|engine8b|e2e|steps|capacity|dp}
part=${2:?part: tests, engine8b, e2e, steps, capacity or dp}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d _wheels ]; then pip install -q --no-index --find-links _wheels sglang-router jsonargparse 2>&1 | tail -2; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
case "$part" in
  tests)
    for f in tests/test_sampling.py tests/test_runner.py tests/test_gpu.py tests/test_gpu_step.py tests/test_tensor_parallel.py; do
      timeout 170 python -m pytest -q -m gpu -p no:cacheprovider "$f" 2>&1 | tail -15 | tee -a "$out/gpu_tests.log"
    done
    timeout 120 python benchmarks/gpu_step.py --shapes demo --sections profile --ns 32 --profile-modes target dflash dscale \
      --profile-sampling greedy sampled --out "$out/profile_demo.json" 2>&1 | grep "profile N" | tee "$out/profile_demo.log"
    ;;
  e2e)
    timeout 450 python benchmarks/demo_gpu_e2e.py --prompts 96 --max-tokens 128 --concurrency 8 32 --step-graphs \
      --sampling 0 1 0.7/0.8 --repeats 3 --no-overlap-too --out "$out/demo_e2e.json" 2>&1 | tee "$out/demo_e2e.log" \
      | grep "^c="
    ;;
  capacity)
    timeout 500 python benchmarks/capacity_gpu.py --out "$out/capacity.json" 2>&1 | tail -12 | tee "$out/capacity.log"
    ;;
  dp)
    timeout 150 python benchmarks/dp_gpu_check.py --prompts 64 --max-tokens 64 --concurrency 16 --log-dir "$out/dp_logs" \
      --out "$out/dp_gpu.json" 2>&1 | tail -30
    ;;
  engine8b)
    timeout 400 python benchmarks/engine_8b.py --overlap on off --out "$out/engine_8b.json" 2>&1 | tail -3 \
      | tee "$out/engine_8b.log"
    ;;
  steps)
    timeout 330 python benchmarks/gpu_step.py --shapes qwen3-8b --sections buckets --max-n 64 --bucket-reps 5 \
      --time-budget 320 --out "$out/gpu_buckets.json" 2>&1 | tail -40 | tee "$out/gpu_buckets.log"
    timeout 200 python benchmarks/gpu_step.py --shapes qwen3-8b --sections step --ns 16 32 --time-budget 190 \
      --out "$out/gpu_step.json" 2>&1 | tail -8 | tee "$out/gpu_step.log"
    ;;
esac
