#!/usr/bin/env bash
# The target fallback served, in one GPU call (issue 25 acceptance 3):
#   1. live_choice: one `dscale-serve --mode dscale --target-fallback true` driven through greedy, T = 1, greedy again
#      and T = 0.7 / top_p 0.8 at c = 1 and 8, its live choice's inputs scraped from /metrics during every pass
#      (`serve_live_choice.py`): does it keep DFlash for greedy traffic at c = 1 and take target-only steps at T = 1?
#   2. sweep: the servers of CONFIGS pass by pass (default: target, DFlash, the default DScale (fallback off since
#      2026-12-06) and DScale with the fallback), c = 1, 8, 32, the three sampling points, ROUNDS rounds, the client in
#      4 processes (`serve_sweep_gpu.sh` with PAIRED=1): the default's place against the best of target / DFlash /
#      DScale, and against DScale with the fallback.
# Usage: [PARTS="live_choice sweep"] [ROUNDS=4] [CONFIGS=...] bash benchmarks/fallback_gpu.sh OUT_DIR
#   (each part has its own time bound; under 10 minutes in all)
set -uo pipefail
source "$(dirname "$0")/gpu_parts.sh"  # gpu_call, run, part
gpu_call "${1:?usage: bash benchmarks/fallback_gpu.sh OUT_DIR}" fallback
PARTS=${PARTS:-live_choice sweep}
part live_choice && run live_choice 100 python benchmarks/serve_live_choice.py \
  --server-flags="--mode dscale --target-fallback true" \
  --points greedy:0 t1:1 greedy:0 t07p08:0.7/0.8 --concurrency 1 8 --duration 3 --every-s 0.2 \
  --client-processes 4 --device cuda --out "$out/live_choice.json"
CONFIGS=${CONFIGS:-"target:--mode target;dflash:--mode dflash;dscale:--mode dscale;dscale-fb:--mode dscale --target-fallback true"}
part sweep && PAIRED=1 PIN=1 ROUNDS=${ROUNDS:-4} MIN_S=2 CLIENT_PROCESSES=4 CONFIGS=$CONFIGS \
  run sweep 440 bash benchmarks/serve_sweep_gpu.sh "$out/sweep" cuda
exit $status
