"""Where an in-process demo run's time goes on the GPU (issue 24 acceptance 2): one `Engine.generate` of the demo
pair per mode under torch.profiler, after a warm-up run and a timed run without the profiler.

Per mode: the run's wall time (unprofiled and profiled), the host functions with the most own time (a cProfile'd
run), the GPU's busy time (the union of its kernels' intervals) and so its idle share, kernel launches, the engine's
steps by bucket and mode, and the kernels that took the most device time, and the GPU's idle gaps by the CUDA
runtime call that ended each. Engines are built as `benchmarks/demo_gpu_e2e.py` builds them (bf16, graphs on,
overlap on).

    python benchmarks/e2e_profile_gpu.py --concurrency 32 --prompts 64 --max-tokens 128 --out profile.json
    python benchmarks/e2e_profile_gpu.py --concurrency 8 --modes target --sampling 0.7/0.8   # a filtered point
"""

from __future__ import annotations

import argparse
import bisect
import collections
import cProfile
import io
import pstats
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_gpu_e2e import build, parse_point  # noqa: E402

from dscale_runtime.config import SamplingParams  # noqa: E402
from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts  # noqa: E402


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Milliseconds covered by the union of (start_us, end_us) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1000.0


def idle_gaps(kernels: list, runtime: list, min_us: float = 5.0) -> dict:
    """GPU idle gaps (between the union of kernel intervals) of at least `min_us`, summed by the CUDA runtime call
    that started last before each gap ended (what the GPU waited for: a graph launch, a copy, a kernel launch)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    calls = sorted((e.time_range.start, e.name) for e in runtime)
    starts = [c[0] for c in calls]
    gaps, end = [], None
    for start, stop in spans:
        if end is not None and start - end >= min_us:
            gaps.append((end, start))
        end = stop if end is None else max(end, stop)
    by_call: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for gap_start, gap_end in gaps:
        i = bisect.bisect_right(starts, gap_end) - 1
        name = calls[i][1] if i >= 0 else "(none)"
        by_call[name][0] += (gap_end - gap_start) / 1000.0
        by_call[name][1] += 1
    lengths = sorted(g[1] - g[0] for g in gaps)
    return {"gaps": len(gaps), "idle_ms": round(sum(lengths) / 1000.0, 3),
            "median_us": round(lengths[len(lengths) // 2], 1) if lengths else 0.0,
            "by_next_call": {k: {"ms": round(v[0], 3), "gaps": v[1]}
                             for k, v in sorted(by_call.items(), key=lambda kv: -kv[1][0])[:12]}}


def profile_mode(engine, prompts: list[str], params: list[SamplingParams], top: int) -> dict:
    engine.generate(prompts, params)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    steps_before = dict(engine.counters.steps_by_mode)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        profiled_wall = time.perf_counter() - start
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    runtime = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda")]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in kernels:
        entry = by_name[e.name[:120]]
        entry[0] += (e.time_range.end - e.time_range.start) / 1000.0
        entry[1] += 1
    host = cProfile.Profile()
    host.enable()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    host.disable()
    stats = pstats.Stats(host, stream=io.StringIO())
    host_rows = sorted(((v[2], v[3], v[1], f"{Path(k[0]).name}:{k[1]}:{k[2]}") for k, v in stats.stats.items()),
                       reverse=True)[:top]
    span = (max(i[1] for i in intervals) - min(i[0] for i in intervals)) / 1000.0 if intervals else 0.0
    busy = busy_ms(intervals)
    tokens = sum(len(o.token_ids) for o in outputs)
    accepted = [a for o in outputs for a in o.stats.accepted_lens]
    return {
        "wall_s": round(wall, 4), "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
        "mean_acceptance_length": round(1 + sum(accepted) / len(accepted), 3) if accepted else 1.0,
        "profiled_wall_s": round(profiled_wall, 4), "kernel_span_ms": round(span, 3), "gpu_busy_ms": round(busy, 3),
        "gpu_idle_share": round(1 - busy / span, 3) if span else None, "kernel_launches": len(kernels),
        "steps_by_mode": {k: v - steps_before.get(k, 0) for k, v in engine.counters.steps_by_mode.items()},
        "idle": idle_gaps(kernels, runtime),
        "host_top_tottime": [{"function": name, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4), "calls": n}
                             for tt, ct, n, name in host_rows],
        "top_kernels": [{"kernel": name, "ms": round(ms, 3), "calls": calls}
                        for name, (ms, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["target", "dflash", "dscale"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sampling", default="0", help="T, T/top_p or T/top_p/top_k of every request (0 = greedy; "
                        "sampled requests carry seeds 0, 1, ...)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    temperature, top_p, top_k = parse_point(args.sampling)
    params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=args.max_tokens,
                             ignore_eos=True, seed=i if temperature > 0 else None) for i in range(len(prompts))]
    result = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "modes": {}}
    for mode in args.modes:
        engine = build(mode, args.concurrency, args.dtype, DEMO_DIR.parent / "demo.pt", graphs=True)
        r = result["modes"][mode] = profile_mode(engine, prompts, params, args.top)
        print(f"{mode}: {r['tokens_per_s']:.0f} tok/s, wall {r['wall_s'] * 1e3:.1f} ms (profiled "
              f"{r['profiled_wall_s'] * 1e3:.1f}), GPU busy {r['gpu_busy_ms']:.1f} ms of a {r['kernel_span_ms']:.1f} ms "
              f"span, {r['kernel_launches']} kernels, steps {r['steps_by_mode']}", flush=True)
        for k in r["top_kernels"][:12]:
            print(f"    {k['ms']:8.3f} ms {k['calls']:6d}  {k['kernel'][:90]}")
        idle = r["idle"]
        print(f"  GPU idle: {idle['idle_ms']:.1f} ms in {idle['gaps']} gaps (median {idle['median_us']} us), by the "
              f"call that ended them: {idle['by_next_call']}")
        print("  host (cProfile, tottime):")
        for h in r["host_top_tottime"][:20]:
            print(f"    {h['tottime_s'] * 1e3:8.2f} ms {h['calls']:7d}  cum {h['cumtime_s'] * 1e3:8.2f}  {h['function'][:80]}")
        del engine
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
