#!/usr/bin/env bash
# Issue 8 on the device: the GPU tests, then every timing. Usage: bash benchmarks/run_gpu.sh OUT_DIR [tests|bench|all]
# (all: both in one call, ~20 min; split into two calls where a call is limited to 10 minutes). Up to 15 files
# land in OUT_DIR: where a remote runner returns fewer files per call, pack OUT_DIR into one archive after it.
# The tests part is benchmarks/gpu_suite.sh: every GPU test file in one pytest process (GPU_SUITE_TIMEOUT, 560 s).
# Each section has its own time limit so one slow part cannot starve the others; logs and JSON go to OUT_DIR.
# Needs the repository's dependencies (jsonargparse too: carry its wheel where the GPU image lacks it).
set -uo pipefail
out=${1:?usage: bash benchmarks/run_gpu.sh OUT_DIR [tests|bench|all]}
part=${2:-all}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/device.txt"
if [ "$part" != bench ]; then
  # every GPU test file in one process (gpu_suite.log, gpu_suite.xml, gpu_suite_files.txt); the tail here
  bash benchmarks/gpu_suite.sh "$out" 2>&1 | tail -40
fi
if [ "$part" != tests ]; then
  python benchmarks/bench_features.py 2>&1 | tail -12 | tee "$out/features_bench.log"
  python benchmarks/bench_fused.py 2>&1 | tail -12 | tee "$out/fused_bench.log"
  timeout 60 python benchmarks/bench_attention.py --output "$out/attention.json" 2>&1 | tail -30 | tee "$out/attention.log"
  timeout 300 python benchmarks/gpu_step.py --shapes qwen3-8b --time-budget 260 --out "$out/gpu_step.json" 2>&1 \
    | tail -60 | tee "$out/gpu_step.log"
  timeout 300 python benchmarks/gpu_step.py --shapes qwen3-8b --sections buckets --time-budget 260 \
    --out "$out/gpu_buckets.json" 2>&1 | tail -90 | tee "$out/gpu_buckets.log"
  timeout 200 python benchmarks/demo_gpu_e2e.py --prompts 64 --max-tokens 128 --concurrency 8 16 32 --step-graphs \
    --out "$out/e2e.json" 2>&1 | tail -20 | tee "$out/e2e.log"
fi
