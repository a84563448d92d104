"""The live choice at concurrency 1 on a cost model: `Engine._mode_for` itself, fed simulated steps.

A check of the live choice's logic apart from a GPU: one request at a time (`--tokens` each), its per-draft
acceptance rate drawn uniformly from `--alpha LO HI` (accepted drafts: consecutive successes, at most 15); a
target-only step costs `--target-ms` of device time and `--target-host-ms` of host work, a DFlash step
`--dflash-ms` and `--dflash-host-ms`. The first `--probe-steps` target-only steps of a run that follows DFlash
steps read `--probe-device-extra` / `--probe-host-extra` ms more (the H100 trace of 2026-12-06: target-only probes
between DFlash steps read up to 0.35 / 0.52 ms against 0.26 / 0.28 in runs of their own). Each step's sample goes
through the engine's estimators (`track_cost`, `Engine.observe_acceptance`) as `Engine._commit_step` and
`Engine._time_cycle` feed them (host work and the cycle's wall time from a run's second cycle on). A cycle's wall time
is max(device, host) plus `--dflash-gap-ms` / `--target-gap-ms` (what neither estimate sees: on an H100 at T = 1 the
demo pair's DFlash steps cost the loop ~0.64 ms a step against a device floor of 0.49 and host work of 0.28;
`--no-wall` leaves `Engine.wall_ms` unfed, the choice before 2026-12-06's second session). Prints tokens per ms against target-only
steps throughout, with the cost estimators' weights as built and, for comparison, symmetric at 0.1 (the
estimator before 2026-12-06). A model, not a measurement: its numbers say which way a change moves the choice.

    python benchmarks/live_choice_sim.py --alpha 0.25 0.6     # T = 1-like drafts: break-even needs ~0.56
    python benchmarks/live_choice_sim.py --alpha 0.6 0.85     # greedy-like drafts
"""

from __future__ import annotations

import argparse
import random
import types

import dscale_runtime.engine as engine_module
from dscale_runtime.engine import Engine, track_cost


def simulate(args: argparse.Namespace, seed: int = 0) -> dict:
    rng = random.Random(seed)
    engine = Engine.__new__(Engine)  # NOTE: only the live choice's state: no models, no runner
    buckets = [1]
    runner = types.SimpleNamespace(buckets=buckets, policy_ms={1: {"dflash": args.dflash_ms, "target": args.target_ms}},
                                   bucket=lambda n: 1, mode_for=lambda n: "dflash",
                                   live_modes=lambda n: ["dflash", "target"])
    engine.runner, engine.step_observers, engine._probe_run, engine._live_steps, engine._last_run = \
        runner, [], None, 0, {}
    engine.acceptance_by_traffic, engine._traffic = {}, (False, False)  # NOTE: one kind of batch throughout
    engine.live_step_ms, engine.host_ms, engine.time_live_steps = {}, {}, True
    engine.wall_ms, engine._target_period, engine._best, engine._admitted = {}, {}, {}, 0
    engine.time_host, engine.cost_samples, engine._target_probes = True, {}, {}
    wall_fed = getattr(args, "wall", True)
    gaps = {"dflash": getattr(args, "dflash_gap_ms", 0.0), "target": getattr(args, "target_gap_ms", 0.0)}
    time_ms = tokens = 0.0
    steps = {"dflash": 0, "target": 0}
    run, previous = 0, None
    for _ in range(args.requests):
        alpha, left = rng.uniform(*args.alpha), args.tokens
        engine._admitted += 1
        while left > 0:
            mode = engine._mode_for(1)
            steps[mode] += 1
            run = run + 1 if mode == previous else 1
            probed = mode == "target" and run <= args.probe_steps and steps["dflash"] > 0
            if mode == "target":
                device, host, got = args.target_ms, args.target_host_ms, 1
            else:
                accepted = 0
                while accepted < 15 and rng.random() < alpha:
                    accepted += 1
                device, host, got = args.dflash_ms, args.dflash_host_ms, 1 + accepted
                engine.observe_acceptance("dflash", [accepted], engine.acceptance_weight(1, "dflash"))
            wall = max(device, host) + gaps[mode]
            time_ms += wall
            track_cost(engine.live_step_ms, (1, mode), device + (args.probe_device_extra if probed else 0.0))
            if run >= 2:  # NOTE: a run's first cycle commits the step before it (`Engine._time_cycle`)
                track_cost(engine.host_ms, (1, mode), host + (args.probe_host_extra if probed else 0.0))
                if wall_fed:
                    track_cost(engine.wall_ms, (1, mode), wall + (args.probe_host_extra if probed else 0.0))
                engine.cost_samples[1, mode] = engine.cost_samples.get((1, mode), 0) + 1
            got = min(got, left)
            left -= got
            tokens += got
            previous = mode
    target_rate = 1.0 / (max(args.target_ms, args.target_host_ms) + gaps["target"])
    return {"tokens_per_ms": tokens / time_ms, "x_target": tokens / time_ms / target_rate, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--alpha", type=float, nargs=2, default=[0.25, 0.6], metavar=("LO", "HI"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--target-ms", type=float, default=0.26)
    parser.add_argument("--target-host-ms", type=float, default=0.28)
    parser.add_argument("--dflash-ms", type=float, default=0.63)
    parser.add_argument("--dflash-host-ms", type=float, default=0.31)
    parser.add_argument("--dflash-gap-ms", type=float, default=0.0)
    parser.add_argument("--target-gap-ms", type=float, default=0.0)
    parser.add_argument("--no-wall", dest="wall", action="store_false",
                        help="leave Engine.wall_ms unfed (the live choice on device time and host work alone)")
    parser.add_argument("--probe-steps", type=int, default=3)
    parser.add_argument("--probe-device-extra", type=float, default=0.08)
    parser.add_argument("--probe-host-extra", type=float, default=0.2)
    args = parser.parse_args()
    built = (engine_module.COST_DOWN_WEIGHT, engine_module.COST_UP_WEIGHT)
    for name, weights in (("floor estimators (as built)", built), ("symmetric 0.1", (0.1, 0.1))):
        engine_module.COST_DOWN_WEIGHT, engine_module.COST_UP_WEIGHT = weights
        out = simulate(args)
        print(f"{name}: {out['tokens_per_ms']:.3f} tokens/ms = {out['x_target']:.3f}x target-only; steps {out['steps']}")
    engine_module.COST_DOWN_WEIGHT, engine_module.COST_UP_WEIGHT = built


if __name__ == "__main__":
    main()
