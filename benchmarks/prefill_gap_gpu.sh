#!/usr/bin/env bash
# Prefill buckets and the decode gap beside a long prompt, in one GPU call (issue 24 acceptance 3):
#   1. The demo pair's prefill buckets, both variants (one request slot, all slots), timed and profiled kernel by
#      kernel (`prefill_profile_gpu.py`).
#   2. The same at Qwen3-8B shape (random bf16 weights), buckets 16-128.
#   3. Qwen3-8B shape: 31 requests decoding, a 16,384-token prompt arrives; the longest gap between their steps
#      against their median step, and the long prompt's time to first token, at `prefill_stall_ratio` 0.8 (the
#      default) and 1.0 (`capacity_gpu.py --parts gap`).
# The 8B gap engines' pool is 98,304 tokens on an H100 (80 GB; the default sizing fills an H200's 141 GB); the
# profile's always.
# Usage: bash benchmarks/prefill_gap_gpu.sh OUT_DIR   (each part has its own time bound; under 10 minutes in all)
# PARTS (default "profile_demo profile_8b gap") picks parts; STALL_RATIOS (default "0.8 1.0") the gap's ratios.
set -uo pipefail
source "$(dirname "$0")/gpu_parts.sh"  # gpu_call, run, part
gpu_call "${1:?usage: bash benchmarks/prefill_gap_gpu.sh OUT_DIR}" prefill_gap
PARTS=${PARTS:-profile_demo profile_8b gap}
read -ra ratios <<< "${STALL_RATIOS:-0.8 1.0}"
part profile_demo && run profile_demo 50 python benchmarks/prefill_profile_gpu.py \
  --buckets 16 32 64 512 768 1536 --reps 3 --out "$out/profile_demo.json"
part profile_8b && run profile_8b 120 python benchmarks/prefill_profile_gpu.py --shape qwen3-8b \
  --buckets 16 32 64 128 --reps 3 --max-model-len 17408 --kv-cache-tokens 98304 --out "$out/profile_8b.json"
part gap && run gap 360 python benchmarks/capacity_gpu.py --parts gap --chunks 8192 \
  --stall-ratios "${ratios[@]}" "${pool[@]}" --out "$out/gap.json"
exit $status
