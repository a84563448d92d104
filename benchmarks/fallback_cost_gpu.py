"""Where the target fallback's cost goes (issue 25 acceptance 3), on the demo pair with captured steps, in-process.

The served fallback trailed target-only at T = 1, concurrency 1, even while it ran target-only steps (an H100,
2026-12-05: 3,232 vs 3,720 tok/s), and the default at greedy concurrency 8 by 5-9% while it ran DFlash's step.
Two parts, each side by side in one process:

1. Replays (CUDA events, median of `--reps`) of one bucket's captured greedy steps: target-only in a target-only
   engine; target-only in a DScale engine with the fallback (it leaves the drafter's context to the engine's
   catch-up, `StepRunner.defer_context`); that step capturing the drafter's layers and writing its context, as
   every target-only step of a speculative runner did before the catch-up; DFlash's step.
2. `engine.generate` rounds (`demo_gpu_e2e.run_points`: paired, each run >= `--min-seconds`) at greedy and T = 1:
   target-only, DScale, DScale with the fallback, that engine held to its target-only step (every decode step), one
   whose target-only steps write the drafter's context (`StepRunner.DEFER_CONTEXT` off: the fallback before the
   catch-up), and one whose choice ignores the cycles' wall time (`Engine.wall_ms` unfed: the choice before it).

    python benchmarks/fallback_cost_gpu.py --out fallback_cost.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo_gpu_e2e import build, run_points

from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
from dscale_runtime.runner import BucketStep, StepKind, StepRunner


class Unfed(dict):
    """A cost table that keeps nothing written to it: an engine whose `wall_ms` is one chooses its steps on their
    device time and host work alone (the live choice before `Engine.wall_ms`), for a paired run on one host."""

    def __setitem__(self, key, value) -> None:
        pass


def timed(step: BucketStep, context: int, reps: int) -> float:
    return round(step.timed_ms(context, reps, warmup=3), 4)


def replays(sizes: list[int], dtype: str, predictor: Path, reps: int, context: int) -> dict:
    target = build("target", max(sizes), dtype, predictor, True)
    fallback = build("dscale", max(sizes), dtype, predictor, True, target_fallback=True)
    runner = fallback.runner
    rows = {}
    for size in sizes:
        bucket = runner.bucket(size)
        row = {"target engine, target step": timed(target.runner.get(bucket, StepKind("target")), context, reps),
               "fallback engine, target step": timed(runner.get(bucket, StepKind("target")), context, reps)}
        runner.defer_context = False
        try:  # NOTE: timing only, never served (its engine would catch the context up again)
            writing = BucketStep(runner, runner._buffers(bucket), StepKind("target")).build(runner.use_graphs,
                                                                                          runner.pool)
        finally:
            runner.defer_context = True
        row["fallback engine, target step writing the drafter context"] = timed(writing, context, reps)
        row["fallback engine, dflash step"] = timed(runner.get(bucket, StepKind("dflash")), context, reps)
        rows[bucket] = row
        print(f"bucket {bucket:3d}: " + "  ".join(f"{k} {v:.4f}" for k, v in row.items()), flush=True)
    del target, fallback
    torch.cuda.empty_cache()
    return rows


def served(concurrency: list[int], args) -> list[dict]:
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    points = [(0.0, 1.0, -1), (1.0, 1.0, -1)]
    out = []
    for c in concurrency:
        engines = {"target": build("target", c, args.dtype, args.predictor, True),
                   "dscale": build("dscale", c, args.dtype, args.predictor, True),
                   "dscale-fb": build("dscale", c, args.dtype, args.predictor, True, target_fallback=True),
                   "dscale-fb held to target": build("dscale", c, args.dtype, args.predictor, True,
                                                     target_fallback=True)}
        engines["dscale-fb held to target"]._mode_for = lambda n, probe=True: "target"
        StepRunner.DEFER_CONTEXT = False
        try:  # NOTE: its target-only steps write the drafter's context (no catch-up): the fallback before it
            engines["dscale-fb writing context"] = build("dscale", c, args.dtype, args.predictor, True,
                                                         target_fallback=True)
        finally:
            StepRunner.DEFER_CONTEXT = True
        unwalled = build("dscale", c, args.dtype, args.predictor, True, target_fallback=True)
        unwalled.wall_ms = Unfed()
        engines["dscale-fb without wall_ms"] = unwalled  # NOTE: the choice on device time and host work alone
        for point, by_mode in zip(points, run_points(engines, prompts, points, args.max_tokens, args.repeats,
                                                     args.min_seconds)):
            for name, r in by_mode.items():
                r.pop("tokens")
                r["mode"] = name
                out.append(r)
                print(f"c={c:3d} T={point[0]} {name:26s} {r['tokens_per_s']:9.1f} tok/s runs {r['tokens_per_s_runs']} "
                      f"vs target (paired) {r.get('vs_target_paired', 1.0):.3f} acc_len {r['mean_acceptance_length']:.3f} "
                      f"steps {r['decode_steps_last_round']}", flush=True)
            for name, engine in engines.items():
                print(f"c={c:3d} T={point[0]} {name:26s} context catch-up tokens so far "
                      f"{engine.counters.context_tokens}", flush=True)
        if "dscale-fb" in engines:
            fb = engines["dscale-fb"]
            print(f"c={c:3d} dscale-fb live_step_ms {fb.live_step_ms} host_ms {fb.host_ms} wall_ms {fb.wall_ms}",
                  flush=True)
        del engines
        torch.cuda.empty_cache()
    return out


def generate_args(parser: argparse.ArgumentParser, repeats: int, min_seconds: float) -> None:
    """The `generate` rounds' options (`demo_gpu_e2e.run_points`), shared with fallback_switches_gpu.py."""
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--min-seconds", type=float, default=min_seconds)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--predictor", type=Path, default=DEMO_DIR.parent / "demo.pt")
    parser.add_argument("--out", type=Path, default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32], help="replayed buckets")
    parser.add_argument("--context", type=int, default=256, help="replayed rows' context length")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 8])
    generate_args(parser, repeats=3, min_seconds=1.5)
    args = parser.parse_args()
    result = {"command": "python benchmarks/fallback_cost_gpu.py " + " ".join(sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "replay_ms": replays(args.sizes, args.dtype, args.predictor, args.reps, args.context),
              "generate": served(args.concurrency, args)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("median of paired vs target:", statistics.median(
        r.get("vs_target_paired", 1.0) for r in result["generate"]))


if __name__ == "__main__":
    main()
