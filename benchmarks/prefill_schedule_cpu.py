"""What the prefill's chunk budget and slot variants make of the demo e2e's schedule, on the CPU (issue 24).

The engine's schedule beside decoding follows measured times: each prefill bucket's start-up timing and each decode
bucket's step (`Engine._prefill_chunks`, `PrefillRunner.budget`). A CPU engine measures none, so this gives it a GPU's
(by default the H100 start-up timings of 2026-12-06's sweep servers: one request's chunk on a bucket's one-slot and
its 32-slot variant, and the decode step per bucket; the variants between are interpolated linearly in their slots,
the attention's empty-slot programs) and runs the demo e2e's workload (64 held-out prompts x 128 tokens, c = 32,
`max_model_len` 1,024, ignore_eos) through the real scheduler. It counts the decode steps, their mean live requests
and the prefill replays by (bucket, request slots), and prices them with the same timings: an estimate of the GPU
work, not a measurement. `--passes 2` reports the second pass, whose prompts hit the prefix cache, as
`benchmarks/demo_gpu_e2e.py`'s repeated rounds do.

    python benchmarks/prefill_schedule_cpu.py --mode dflash --variants off on --passes 1 2
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dscale_runtime.config import EngineConfig, SamplingParams  # noqa: E402
from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts  # noqa: E402
from dscale_runtime.engine import Engine  # noqa: E402

# H100, 2026-12-06 18:37 UTC (docs/benchmarks.md, the served sweep's start-up logs): ms from position 0
TIMINGS = {
    "dflash": {"solo": {16: 0.291, 32: 0.314, 64: 0.321, 128: 0.346, 256: 0.382, 384: 0.458, 512: 0.52, 768: 0.55,
                        1024: 0.636},
               "full": {16: 0.349, 32: 0.482, 64: 0.504, 128: 0.803, 256: 1.311, 384: 1.815, 512: 2.35, 768: 1.925,
                        1024: 2.46},
               "decode": {1: 0.509, 2: 0.53, 4: 0.54, 8: 0.549, 12: 0.567, 16: 0.575, 20: 0.589, 24: 0.621,
                          28: 0.642, 32: 0.652}},
    "target": {"solo": {16: 0.275, 32: 0.273, 64: 0.283, 128: 0.311, 256: 0.368, 384: 0.422, 512: 0.49, 768: 0.517,
                        1024: 0.604},
               "full": {16: 0.308, 32: 0.438, 64: 0.464, 128: 0.779, 256: 1.299, 384: 1.785, 512: 2.306, 768: 1.886,
                        1024: 2.435},
               "decode": {1: 0.347, 2: 0.351, 4: 0.352, 8: 0.36, 12: 0.359, 16: 0.365, 20: 0.365, 24: 0.39,
                          28: 0.396, 32: 0.408}},
}
CONCURRENCY = 32


def variant_ms(t: dict, bucket: int, slots: int) -> float:
    full = min(bucket, CONCURRENCY)
    return t["solo"][bucket] + (t["full"][bucket] - t["solo"][bucket]) * (slots - 1) / max(1, full - 1)


def decode_ms(t: dict, live: int) -> float:
    return t["decode"][min((b for b in t["decode"] if b >= live), default=max(t["decode"]))]


def run(mode: str, variants: bool, passes: int, group: int, prompts: int) -> list[dict]:
    t = TIMINGS[mode]
    buckets = tuple(t["solo"])
    config = EngineConfig(mode=mode, max_running_requests=CONCURRENCY, device="cpu", dtype="float32",
                          max_model_len=1024, prefill_buckets=buckets, admission_group=group)
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter" if mode != "target" else None, None,
                                    config=config)
    pre = engine.prefiller
    if not variants:  # NOTE: as before 2026-12-06: one-request and full variants, the full times for several
        pre.slot_counts = (1, CONCURRENCY)
    pre.bucket_ms = {b: (t["solo"][b],) * 2 + (1000,) for b in buckets}
    pre.many_ms = {b: (t["full"][b],) * 2 + (1000,) for b in buckets}
    pre.group_ms = {r: {b: (variant_ms(t, b, min(b, r)),) * 2 + (1000,) for b in buckets}
                    for r in pre.slot_counts[1:-1]}
    engine.decode_ms = {b: decode_ms(t, b) for b in engine.runner.buckets}
    engine._time_cycle = lambda: None  # NOTE: the CPU's own cycles would stand in for the GPU's step
    replays, steps = [], []
    real_run, real_launch = pre.run, engine.runner.launch

    def counted_run(chunks):
        size = pre.bucket(sum(len(c.tokens) for c in chunks))
        replays.append((size, pre.slots_for(size, len(chunks)) if size else None))
        return real_run(chunks)

    def counted_launch(anchors, *args, **kwargs):
        steps.append(len(anchors))
        return real_launch(anchors, *args, **kwargs)

    pre.run, engine.runner.launch = counted_run, counted_launch
    texts = [p["prompt"] for p in stdlib_prompts()[:prompts]]
    params = [SamplingParams(temperature=0, max_tokens=128, ignore_eos=True) for _ in texts]
    rows = []
    for n in range(1, passes + 1):
        replays.clear()
        steps.clear()
        start = time.perf_counter()
        engine.generate(texts, params)
        decode = sum(decode_ms(t, live) for live in steps)
        prefill = sum(variant_ms(t, b, r) for b, r in replays if b)
        rows.append({"mode": mode, "variants": variants, "admission_group": group, "pass": n,
                     "decode_steps": len(steps), "mean_live": round(sum(steps) / len(steps), 1),
                     "prefills": len(replays), "eager_prefills": sum(1 for b, _ in replays if b is None),
                     "replays": {f"{b}x{r}": k for (b, r), k in sorted(collections.Counter(replays).items(),
                                                                         key=lambda kv: (kv[0][0] or 0, kv[0][1] or 0))},
                     "estimate_ms": {"decode": round(decode, 1), "prefill": round(prefill, 1),
                                     "total": round(decode + prefill, 1)},
                     "cpu_s": round(time.perf_counter() - start, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", nargs="+", default=["dflash", "target"], choices=sorted(TIMINGS))
    parser.add_argument("--variants", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--passes", type=int, default=2, help="report passes 1..N (2: the prefix cache's hits too)")
    parser.add_argument("--admission-group", type=int, default=0, help="EngineConfig.admission_group (0: default)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = [row for mode in args.mode for v in args.variants
            for row in run(mode, v == "on", args.passes, args.admission_group, args.prompts)]
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "timings": TIMINGS, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
