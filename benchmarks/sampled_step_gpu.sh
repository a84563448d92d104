#!/usr/bin/env bash
# The sampled step in one GPU call (issue 25 build 2): its fused launches checked, then timed against greedy.
#   tests:   the GPU sampling tests (kernels against their references, captured sampling's chi-square fits, top-1
#            sampling token for token against target-only)
#   demo:    `gpu_step.py --step-set sampling` on the demo pair, N = 1, 8, 32: sampled and mixed steps / greedy
#   base:    the same on the tree with BASE_TAR unpacked over a copy of it (a `git archive` of the files the change
#            touched, at the commit before it), side by side
#   qwen:    the same at Qwen3-8B shape, N = 8, 16, 32 (issue 25 acceptance 2: half-sampled / greedy <= 1.05)
#   profile: kernels per step of the demo pair's greedy and sampled DFlash steps, N = 1
#   qwen_profile (not in the default): kernels per step at Qwen3-8B shape, N = 8, DFlash and DScale, greedy and
#            half-sampled (where a sampled step's extra time goes at a 151,936-token vocabulary)
# Usage: [BASE_TAR=base.tar] [PARTS="tests demo base qwen profile"] bash benchmarks/sampled_step_gpu.sh OUT_DIR
set -uo pipefail
source "$(dirname "$0")/gpu_parts.sh"  # gpu_call, run, part
gpu_call "${1:?usage: bash benchmarks/sampled_step_gpu.sh OUT_DIR}" sampled_step
PARTS=${PARTS:-tests demo base qwen profile}
if part tests; then
  run tests 200 python -m pytest -q -m gpu -p no:cacheprovider -rfEs tests/test_sampling.py tests/test_runner.py \
    -k "sampl or row_tokens or acceptance or greedy_tokens or chunk_sums or keyed"
fi
demo=(--shapes demo --ns 1 8 32 --sections step --step-set sampling)
if part demo; then
  run demo 150 python benchmarks/gpu_step.py "${demo[@]}" --out "$out/demo_step.json"
fi
if part base && [ -n "${BASE_TAR:-}" ]; then
  base=$(mktemp -d) && cp -r dscale_runtime benchmarks "$base" && tar -xf "$BASE_TAR" -C "$base"
  (cd "$base" && PYTHONPATH="$base:${PYTHONPATH#*:}" run base 150 python benchmarks/gpu_step.py "${demo[@]}" \
    --out "$out/demo_step_base.json")
  [ -s "$out/demo_step_base.json" ] || status=1
fi
if part qwen; then
  run qwen 200 python benchmarks/gpu_step.py --shapes qwen3-8b --ns 8 16 32 --sections step --step-set sampling \
    --out "$out/qwen_step.json"
fi
if part profile; then
  run profile 100 python benchmarks/gpu_step.py --shapes demo --ns 1 --sections profile --profile-modes target dflash \
    --profile-sampling greedy sampled mixed_top_p --out "$out/demo_profile.json"
fi
if part qwen_profile; then
  run qwen_profile 150 python benchmarks/gpu_step.py --shapes qwen3-8b --ns 8 --sections profile \
    --profile-modes dflash dscale --profile-sampling greedy mixed --out "$out/qwen_profile.json"
fi
exit $status
