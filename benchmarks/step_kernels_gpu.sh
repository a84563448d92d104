#!/usr/bin/env bash
# The step's Triton kernels (`KernelChoice.decision`: kernels/triton_step.py, triton_state.py, triton_pack.py,
# triton_agreement.py) timed against the torch reference on the GPU in one call (issues 24, 25, 26):
#   1. Qwen3-8B shape, DFlash 1 and DFlash 2, N = 8 / 16 / 32: every step with and without the kernels, checked
#      (captured == eager, kernels == reference), in interleaved rounds, profiled (`dflash2_step.py`).
#   2. The demo shape (launch-bound), N = 8 / 32: the same steps, interleaved, and profiled (launches per step).
#   3. The demo pair through the public Engine (64 prompts x 128 tokens, ignore_eos, graphs on), c = 8 and 32:
#      target / DFlash / DScale with the kernels (the default) and on the reference (`-ref` modes), same rounds,
#      and DFlash / DScale admitting at once (`group1`) beside the default admission groups (4 at c = 32).
# Usage: bash benchmarks/step_kernels_gpu.sh OUT_DIR   (under 10 minutes on an H200: each part has its own time bound)
set -uo pipefail
SUMMARY_TAIL=60
source "$(dirname "$0")/gpu_parts.sh"  # gpu_call, run, part
gpu_call "${1:?usage: bash benchmarks/step_kernels_gpu.sh OUT_DIR}" step_kernels
run step_8b 170 python benchmarks/dflash2_step.py --ns 8 16 32 --reps 20 --rounds 5 --decision-kernels \
  --profile --out "$out/step_8b.json"
run step_demo 85 python benchmarks/dflash2_step.py --shape demo --ns 8 32 --context 256 --reps 30 --rounds 5 \
  --decision-kernels --profile --out "$out/step_demo.json"
for c in 32 8; do  # NOTE: one run per concurrency, c = 32 first (issue 24 acceptance 2 is open there)
  run "e2e_demo_c$c" 155 python benchmarks/demo_gpu_e2e.py --prompts 64 --max-tokens 128 --concurrency "$c" \
    --step-graphs --repeats 4 --min-seconds 1 --modes target-ref target dflash-ref dflash dscale-ref dscale \
    --admission-groups 1 --out "$out/e2e_demo_c$c.json"
done
exit "$status"
