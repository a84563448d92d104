#!/usr/bin/env bash
# Issue 24's GPU checks besides the suite (`gpu_suite.sh`: acceptance 1 and 6), part by part, on one tree:
#   1. demo_e2e: the demo pair through the public Engine (64 prompts x 128 tokens, ignore_eos, every step captured),
#      target-only, DFlash and DScale at c = 32 and 8, each also with the overlap schedule off, 5 interleaved rounds
#      of >= 2 s (acceptance 2: DFlash and DScale >= 1.5x target-only; the overlap schedule >= without it).
#   2. ttft: Qwen3-8B shape, a repeated 2,048-token prompt's TTFT against the cold one's (acceptance 3: <= 0.3x).
#   3. engine_8b: Qwen3-8B shape, c = 32, engine wall per step over its captured replay in the three modes (acceptance
#      3: <= 1.05).
#   4. profile_demo: the demo pair's prefill buckets 64, 256 and 1,024, every request-slot variant, replay time, grid
#      and kernels (`prefill_profile_gpu.py`).
#   5. step_demo: the demo pair's captured target-only and DFlash steps at N = 32, replay and kernel profile
#      (`gpu_step.py`: launches per step).
#   6. gap: Qwen3-8B shape, the 16K prompt beside 31 decoders at the default stall ratio (acceptance 3: <= 2x).
#   7. bench: `dscale-bench --launch --device cuda` over the demo pair at c = 1, 8, 32 (acceptance 4), default servers
#      (the engine in a process of its own since 2026-12-07).
#   8. bench_ep: the same with `--serve-args "--engine-process true"` (the 2026-12-06 H200 run, before it was the
#      default); bench_thread: with `--serve-args "--engine-process false"` (the engine in a thread of the HTTP
#      process).
#   BENCH_MODES and BENCH_CONCURRENCY narrow the bench parts (defaults target,dflash,dscale and 1,8,32); TIMELINE=1
#   records each bench part's timeline (`benchmarks/serve_timeline/`) into $out/NAME_timeline.
# Usage: bash benchmarks/issue24_gpu.sh OUT_DIR   (each part has its own time bound; the default parts take under 10
# minutes, and the others need calls of their own: profile_demo + step_demo + gap ~7 minutes, bench ~5.5)
# PARTS (default "demo_e2e ttft engine_8b") picks parts (also: profile_demo step_demo gap bench bench_ep
# bench_thread).
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
part profile_demo && run profile_demo 60 python benchmarks/prefill_profile_gpu.py --buckets 64 256 1024 --reps 3 \
  --out "$out/profile_demo.json"
part step_demo && run step_demo 120 python benchmarks/gpu_step.py --shapes demo --ns 32 --context 256 \
  --sections step profile --profile-modes target dflash --time-budget 100 --out "$out/step_demo.json"
part gap && run gap 240 python benchmarks/capacity_gpu.py --parts gap --chunks 8192 --stall-ratios 0.8 "${pool[@]}" \
  --out "$out/gap.json"
bench() {  # NAME SECONDS [dscale-bench flags]
  local name=$1 limit=$2
  shift 2
  local cmd=(python -m dscale_runtime.bench)
  if [ -n "${TIMELINE:-}" ]; then  # NOTE: the clients' module imported by name, so the recorder can patch it
    cmd=(env DSCALE_TIMELINE="$out/${name}_timeline" PYTHONPATH="$PWD/benchmarks/serve_timeline:$PYTHONPATH"
         python -c "import sys; sys.argv[0] = 'dscale-bench'; from dscale_runtime.bench import main; main()")
  fi
  run "$name" "$limit" "${cmd[@]}" --launch --device cuda \
    --modes "${BENCH_MODES:-target,dflash,dscale}" --concurrency "${BENCH_CONCURRENCY:-1,8,32}" --num-requests 64 \
    --warmup 8 --client-processes 4 --output "$out/$name" "$@"
}
part bench && bench bench 330
part bench_ep && bench bench_ep 330 --serve-args "--engine-process true"
part bench_thread && bench bench_thread 330 --serve-args "--engine-process false"
exit $status
