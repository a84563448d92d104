#!/usr/bin/env bash
# Issue 26 acceptance 3 on the device: the demo recipe's DFlash 2 drafter (configs/demo_build_dflash2.yaml, written to
# artifacts/demo/drafter2 with its greedy and T = 1 evaluation), then the shipped DFlash 1 drafter evaluated the same
# way (greedy and T = 1), so the two mean acceptance lengths come from one machine and one prompt set. What returns:
#   OUT/build_dflash2.log  OUT/eval_dflash1.log  OUT/build_report.json  OUT/README.md  OUT/drafter2/{config.json,
#   model.safetensors}
# Usage: bash benchmarks/demo_dflash2_gpu.sh OUT. BUILD_TIMEOUT (default 470 s) and EVAL_TIMEOUT (60 s) keep it inside
# a 10-minute call (the build took ~420 s on the H200: 113 s of greedy sequences, ~235 s of training).
# Needs jsonargparse (carry its wheel where the GPU image lacks it).
set -uo pipefail
out=${1:?usage: bash benchmarks/demo_dflash2_gpu.sh OUT}
mkdir -p "$out/drafter2" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
timeout -k 10 "${BUILD_TIMEOUT:-470}" python -m dscale_runtime.demo.build --config configs/demo_build_dflash2.yaml \
  > "$out/build_dflash2.log" 2>&1
echo "dflash2 build exit $? after $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout -k 10 "${EVAL_TIMEOUT:-60}" python -m dscale_runtime.demo.build --config configs/demo_build.yaml \
  --stages '[eval]' --eval_temperatures '[0.0, 1.0]' > "$out/eval_dflash1.log" 2>&1
echo "dflash1 eval exit $? after $(( $(date +%s) - start )) s"
cp artifacts/demo/build_report.json artifacts/demo/README.md "$out/"
cp artifacts/demo/drafter2/config.json artifacts/demo/drafter2/model.safetensors "$out/drafter2/" 2>/dev/null
grep -v "drafter step" "$out/build_dflash2.log" | tail -6
grep "eval" "$out/eval_dflash1.log" | tail -3
