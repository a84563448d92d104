#!/usr/bin/env bash
# Issue 27 acceptance 2 on the device: v3 traces of every demo prompt at T = 0 and T = 1 (c = 16), a predictor
# trained on them (prompt-disjoint split, budgets 0.5 and 0.25), and the shipped artifact judged on the same test
# split. The traces stay on the device (too large to bring back); what returns is small:
#   OUT/collect.log   the collector's summary line          OUT/manifest.json  the trace set's manifest
#   OUT/train.log     the trainer's tail                    OUT/report.json    the trained predictor's report
#   OUT/<name>.pt     the trained artifact                  OUT/shipped.json   predictor_report.py over both artifacts
# Usage: bash benchmarks/predictor_t01_gpu.sh OUT [MAX_PROMPTS (0 = all)] [NAME]
# DEVICE (default cuda) runs the collector elsewhere, for a smoke test. Each step has its own time limit
# (COLLECT_TIMEOUT 330 s, TRAIN_TIMEOUT 180 s) to end inside a 10-minute call.
set -uo pipefail
out=${1:?usage: bash benchmarks/predictor_t01_gpu.sh OUT [MAX_PROMPTS] [NAME]}
max_prompts=${2:-0}
name=${3:-demo_t01_v3}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
work=$(mktemp -d)
traces=$work/traces
limit=()
[ "$max_prompts" != 0 ] && limit=(--max-prompts "$max_prompts")
start=$(date +%s)
timeout -k 10 "${COLLECT_TIMEOUT:-330}" python -m trace_collection.collect --config configs/demo.yaml \
  --device "${DEVICE:-cuda}" --concurrency '[16]' --temperatures '[0.0, 1.0]' --chunk-prompts 16 "${limit[@]}" \
  --output "$traces" > "$work/collect.log" 2>&1
echo "collect exit $? after $(( $(date +%s) - start )) s" | tee "$out/collect.log"
tr '\r' '\n' < "$work/collect.log" | tail -4 >> "$out/collect.log"
cp "$traces/manifest.json" "$out/manifest.json" 2>/dev/null
start=$(date +%s)
timeout -k 10 "${TRAIN_TIMEOUT:-180}" python -m dscale_predictor.train --target demo --traces "$traces" \
  --run-dir "$work/run" --export-name "$name" --artifacts-dir "$work/art" --budget-ratios '[0.25, 0.5]' \
  --test-fraction 0.2 --val-fraction 0.1 --batch-size 256 > "$work/train.log" 2>&1
echo "train exit $? after $(( $(date +%s) - start )) s" | tee "$out/train.log"
tr '\r' '\n' < "$work/train.log" | grep -v "^Epoch\|it/s\]$" | tail -30 >> "$out/train.log"
cp "$work/run/report.json" "$out/report.json" 2>/dev/null
cp "$work/art/$name.pt" "$out/$name.pt" 2>/dev/null
if [ -f "$work/art/$name.pt" ]; then
  timeout -k 10 90 python benchmarks/predictor_report.py --traces "$traces" \
    --predictors "$work/art/$name.pt" artifacts/demo.pt --test-fraction 0.2 --val-fraction 0.1 \
    --budget-ratios 0.25 0.5 --out "$out/shipped.json" 2>&1 | tail -5
fi
echo "done"
