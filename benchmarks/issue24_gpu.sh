#!/usr/bin/env bash
# Issue 24's acceptance 2 and the rest of 3 on one tree, in one GPU call (after `gpu_suite.sh`, `prefill_gap_gpu.sh`
# and `dscale-bench --launch`, which give acceptance 1, 3's gap, 4 and 6):
#   1. demo_e2e: the demo pair through the public Engine (64 prompts x 128 tokens, ignore_eos, every step captured),
#      target-only, DFlash and DScale at c = 32 and 8, each also with the overlap schedule off, 5 interleaved rounds
#      of >= 2 s (acceptance 2: DFlash and DScale >= 1.5x target-only; the overlap schedule >= without it).
#   2. ttft: Qwen3-8B shape, a repeated 2,048-token prompt's TTFT against the cold one's (acceptance 3: <= 0.3x).
#   3. engine_8b: Qwen3-8B shape, c = 32, engine wall per step over its captured replay in the three modes (acceptance
#      3: <= 1.05).
# Usage: bash benchmarks/issue24_gpu.sh OUT_DIR   (each part has its own time bound; under 10 minutes in all)
# PARTS (default "demo_e2e ttft engine_8b") picks parts.
set -uo pipefail
source "$(dirname "$0")/gpu_parts.sh"  # gpu_call, run, part
gpu_call "${1:?usage: bash benchmarks/issue24_gpu.sh OUT_DIR}" issue24
PARTS=${PARTS:-demo_e2e ttft engine_8b}
part demo_e2e && run demo_e2e 300 python benchmarks/demo_gpu_e2e.py --prompts 64 --max-tokens 128 \
  --concurrency 32 8 --step-graphs --repeats 5 --min-seconds 2 --modes target dflash dscale --no-overlap-too \
  --out "$out/demo_e2e.json"
part ttft && run ttft 160 python benchmarks/capacity_gpu.py --parts ttft --chunks 8192 "${pool[@]}" \
  --out "$out/ttft.json"
part engine_8b && run engine_8b 170 python benchmarks/engine_8b.py --overlap on \
  --out "$out/engine_8b.json"
exit $status
