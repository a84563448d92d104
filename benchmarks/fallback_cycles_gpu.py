"""Every decode cycle of one `generate` pass, with what the live choice's cost tables took from it (issue 25).

On an H100 (2026-12-06) the target fallback's estimate of a target-only cycle's wall time read 0.41-0.42 ms at T = 1,
concurrency 1, at the end of some runs, while the engine ran ~0.29 ms per step with 95% of its steps target-only, and
a served fallback ran a quarter of its T = 1 steps as DFlash. This script shows which cycles feed `Engine.wall_ms` /
`host_ms` and what they measure: each `step` call's wall time, the step it launched, the steps it committed, its wait
for the device, its prefill flags, and whether `_time_cycle` took it as a sample; grouped by (launched, committed,
sampled) with count and medians, for the fallback engine and a target-only engine side by side (the same prompts, one
process). Its first run found the sampled cycles typical at concurrency 1 and, at concurrency 8, a bucket whose
target-only estimate rested on a warm-up probe's cycle or two (0.45 ms against 0.29): hence `COST_SAMPLES` and the
capped rise of `track_cost` (docs/benchmarks.md).

    python benchmarks/fallback_cycles_gpu.py --concurrency 1 --out cycles.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from demo_gpu_e2e import build

from dscale_runtime.config import SamplingParams
from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
from dscale_runtime.engine import Engine


def record_cycles(engine: Engine) -> list[dict]:
    """Wrap the engine's `_time_cycle`: each call appends the cycle that just ended (the state `_time_cycle` reads)."""
    cycles: list[dict] = []
    original = engine._time_cycle

    def time_cycle() -> None:
        now, last, samples = time.perf_counter(), engine._cycle, sum(engine.cost_samples.values())
        original()
        if last is not None:  # NOTE: sampled: whether the engine's own rule took the cycle (`Engine.cost_samples`)
            launched = last[3]
            cycles.append({"wall_ms": (now - last[0]) * 1e3, "waited_ms": last[2], "flags": last[1],
                           "launched": None if launched is None else f"{launched[1]}@{launched[0]}",
                           "committed": sorted(last[4]), "sampled": sum(engine.cost_samples.values()) > samples})

    engine._time_cycle = time_cycle
    return cycles


def summary(cycles: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for c in cycles:
        groups.setdefault((c["launched"], "+".join(c["committed"]), c["sampled"], c["flags"]), []).append(c)
    rows = []
    for (launched, committed, sampled, flags), items in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        rows.append({"launched": launched, "committed": committed, "sampled": sampled, "flags": flags,
                     "count": len(items), "wall_ms": round(statistics.median(i["wall_ms"] for i in items), 4),
                     "waited_ms": round(statistics.median(i["waited_ms"] for i in items), 4)})
    return rows


def tables(engine: Engine) -> dict:
    fmt = lambda d: {f"{k[1]}@{k[0]}": round(v, 4) for k, v in d.items()}  # noqa: E731
    return {"live_step_ms": fmt(engine.live_step_ms), "host_ms": fmt(engine.host_ms), "wall_ms": fmt(engine.wall_ms),
            "steps_by_mode": dict(engine.counters.steps_by_mode),
            "acceptance": {str(k): v for k, v in engine.acceptance_by_traffic.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--predictor", type=Path, default=DEMO_DIR.parent / "demo.pt")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    result = {"command": "python benchmarks/fallback_cycles_gpu.py " + " ".join(sys.argv[1:]),
              "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "engines": {}}
    engines = {"target": build("target", args.concurrency, args.dtype, args.predictor, True),
               "dscale-fb": build("dscale", args.concurrency, args.dtype, args.predictor, True, target_fallback=True)}
    for name, engine in engines.items():
        for t in args.temperatures:  # warm-up: every kind once
            engine.generate(prompts, SamplingParams(temperature=t, max_tokens=args.max_tokens, ignore_eos=True))
        passes = []
        for t in args.temperatures:
            params = SamplingParams(temperature=t, max_tokens=args.max_tokens, ignore_eos=True)
            engine.counters.steps_by_mode.clear()
            cycles = record_cycles(engine)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = engine.generate(prompts, params)
            seconds = time.perf_counter() - start
            del engine._time_cycle  # NOTE: back to the class's method
            tokens = sum(len(o.token_ids) for o in out)
            row = {"temperature": t, "tok_s": round(tokens / seconds, 1), "ms_per_step":
                   round(seconds * 1e3 / max(1, sum(engine.counters.steps_by_mode.values())), 4),
                   "tables": tables(engine), "groups": summary(cycles),
                   "first_cycles": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in c.items()}
                                    for c in cycles[:400]]}
            passes.append(row)
            print(f"{name} T={t}: {row['tok_s']} tok/s, {row['ms_per_step']} ms/step, tables {row['tables']}")
            for g in row["groups"][:12]:
                print("   ", g)
        result["engines"][name] = passes
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
