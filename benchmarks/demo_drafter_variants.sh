#!/usr/bin/env bash
# Drafter variants of the demo pair side by side on one GPU (issue 4): the greedy sequences are generated
# once (greedy_cache), then each variant trains a drafter beside the shipped target and runs the eval stage.
# Usage: bash benchmarks/demo_drafter_variants.sh OUT_DIR 'NAME:--flag value ...' ['NAME:...' ...]
# Each variant's drafter, build report and log land in OUT_DIR/NAME; the recipe's own `out` folder (the source
# of target/ and prompts.jsonl) is not touched. DEMO_CONFIG picks the recipe (default configs/demo_build.yaml).
# VARIANT_TIMEOUT (seconds, default none) bounds each variant.
set -uo pipefail
out=${1:?usage: bash benchmarks/demo_drafter_variants.sh OUT_DIR 'NAME:FLAGS' ...}; shift
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
config=${DEMO_CONFIG:-configs/demo_build.yaml}
src=$(python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['out'])" "$config")
work=$(mktemp -d)
cache="$work/greedy.pt"
python - "$config" "$cache" <<'PY' 2>&1 | tail -5 | tee "$out/greedy.log"
import sys, yaml
from pathlib import Path
from dscale_runtime.demo.build import DemoRecipe, cached_sequences
cfg = yaml.safe_load(open(sys.argv[1]))
recipe = DemoRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}, greedy_cache=sys.argv[2])
seqs, _ = cached_sequences(recipe, Path(recipe.out))
print("greedy sequences", tuple(seqs.shape))
PY
pids=()
for spec in "$@"; do
  name=${spec%%:*}; flags=${spec#*:}
  mkdir -p "$work/$name" "$out/$name"
  cp -r "$src/target" "$src/prompts.jsonl" "$work/$name/"
  # shellcheck disable=SC2086
  timeout "${VARIANT_TIMEOUT:-0}" python -m dscale_runtime.demo.build --config "$config" --out "$work/$name" \
    --stages '[drafter, eval]' --greedy_cache "$cache" $flags > "$out/$name/build.log" 2>&1 &
  pids+=("$!")
done
status=0
for i in "${!pids[@]}"; do
  spec=${@:i+1:1}; name=${spec%%:*}
  wait "${pids[$i]}"; rc=$?
  [ "$rc" -eq 0 ] || { status=1; echo "$name: exit $rc (124: VARIANT_TIMEOUT reached)"; }
  cp -r "$work/$name/drafter" "$work/$name/build_report.json" "$out/$name/" 2>/dev/null
  echo "$name: $(grep -E 'held-out greedy|eval:' "$out/$name/build.log" | tr '\n' ' ')"
done
exit $status
