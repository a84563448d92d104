"""Why the target fallback leaves speculation on greedy traffic (issue 25 acceptance 3), on the demo pair in-process.

At greedy concurrency 1 on an H100 (2026-12-06) an engine with the fallback served 0.87-0.92x the default DScale
engine while both ran DFlash's step almost always. Side by side in one process (`demo_gpu_e2e.run_points`, paired
rounds): the default, the fallback engine, and the fallback engine held to its static step (its graphs, timers and
catch-up machinery without the live choice); then, for the fallback engine, every switch of its choice into
target-only steps with what the choice read then (live acceptance, each step's cost, whether a probe or the rates
chose it).

    python benchmarks/fallback_switches_gpu.py --concurrency 1 --out switches.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo_gpu_e2e import build, run_points
from fallback_cost_gpu import generate_args

from dscale_runtime.demo.prompts import stdlib_prompts


def traced_switches(engine, log: list[dict]) -> None:
    """Record each step at which the engine's choice enters target-only steps, and what it read."""
    choose = engine._mode_for
    last = {"mode": None}

    def mode_for(n: int, probe: bool = True) -> str:
        run = engine._probe_run
        mode = choose(n, probe)
        if probe and mode == "target" and last["mode"] not in (None, "target"):
            bucket = engine.runner.bucket(n)
            modes = engine.runner.live_modes(n)
            log.append({"step": engine._live_steps, "bucket": bucket, "probe_run_before": run,
                        "acceptance": {m: round(a, 3) for m, a in engine.live_acceptance.items()},
                        "costs_ms": {m: round(c, 4) for m, c in engine.step_costs(bucket, modes).items()},
                        "device_ms": {m: round(engine.live_step_ms[bucket, m], 4) for m in modes
                                      if (bucket, m) in engine.live_step_ms},
                        "host_ms": {m: round(engine.host_ms[bucket, m], 4) for m in modes
                                    if (bucket, m) in engine.host_ms},
                        "wall_ms": {m: round(engine.wall_ms[bucket, m], 4) for m in modes
                                    if (bucket, m) in engine.wall_ms}})
        if probe:
            last["mode"] = mode
        return mode

    engine._mode_for = mode_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--temperature", type=float, default=0.0)
    generate_args(parser, repeats=5, min_seconds=1.0)
    args = parser.parse_args()
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    result = {"command": "python benchmarks/fallback_switches_gpu.py " + " ".join(sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "points": []}
    for c in args.concurrency:
        engines = {"dscale": build("dscale", c, args.dtype, args.predictor, True),
                   "dscale-fb": build("dscale", c, args.dtype, args.predictor, True, target_fallback=True),
                   "dscale-fb static": build("dscale", c, args.dtype, args.predictor, True, target_fallback=True)}
        static = engines["dscale-fb static"]
        static._mode_for = lambda n, probe=True, runner=static.runner: runner.mode_for(n)
        switches: list[dict] = []
        traced_switches(engines["dscale-fb"], switches)
        (by_mode,) = run_points(engines, prompts, [(args.temperature, 1.0, -1)], args.max_tokens, args.repeats,
                                args.min_seconds)
        base = by_mode["dscale"]["tokens_per_s_runs"]
        for name, r in by_mode.items():
            r.pop("tokens")
            ratio = sorted(a / b for a, b in zip(r["tokens_per_s_runs"], base))
            r.update(mode=name, concurrency=c, vs_default_paired=round(ratio[len(ratio) // 2], 3),
                     context_tokens=engines[name].counters.context_tokens)
            result["points"].append(r)
            print(f"c={c:3d} {name:18s} {r['tokens_per_s']:9.1f} tok/s runs {r['tokens_per_s_runs']} vs default "
                  f"(paired) {r['vs_default_paired']:.3f} steps {r['decode_steps_last_round']}", flush=True)
        result["points"].append({"concurrency": c, "switches_into_target": switches})
        print(f"c={c:3d} dscale-fb: {len(switches)} switches into target-only steps; the first 12:", flush=True)
        for s in switches[:12]:
            print("   ", json.dumps(s), flush=True)
        del engines
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
