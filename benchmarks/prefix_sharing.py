"""Prefill work with prefix caching when requests sharing a prompt arrive together (issue 17).

Counts, on the demo pair through the public Engine, the prompt tokens the engine prefills (what prefix
caching did not supply) for two arrival patterns submitted all at once:
- `drawn`: R requests drawn with replacement from D distinct held-out prompts (the paper's protocol, IV-A);
- `copies`: D prompts x C identical copies each (best-of-n style traffic).
Each pattern runs with prefix caching off and on; the greedy outputs of the two must be equal.
The figures are token counts, not times: they do not depend on the machine.

    python benchmarks/prefix_sharing.py --concurrency 32 --out docs/data/prefix_sharing_cpu_2026-12-01.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path


def patterns(requests: int, distinct: int, copies: int, seed: int) -> dict[str, list[str]]:
    from dscale_runtime.demo.prompts import stdlib_prompts

    pool = [p["prompt"] for p in stdlib_prompts()]
    if len(pool) < distinct:
        raise SystemExit(f"--distinct {distinct}: the held-out demo set has {len(pool)} prompts")
    rng = random.Random(seed)
    chosen = rng.sample(pool, distinct)
    return {"drawn": [chosen[rng.randrange(distinct)] for _ in range(requests)],
            "copies": [p for p in chosen[: max(1, requests // copies)] for _ in range(copies)]}


def run(prompts: list[str], caching: bool, args) -> dict:
    from dscale_runtime.config import EngineConfig, SamplingParams
    from dscale_runtime.engine import Engine
    from dscale_runtime.server.config import DEMO_DRAFTER, DEMO_TARGET

    config = EngineConfig(mode=args.mode, max_running_requests=args.concurrency, max_model_len=2048,
                          prefix_caching=caching, device=args.device)
    engine = Engine.from_pretrained(DEMO_TARGET, DEMO_DRAFTER if args.mode != "target" else None, config=config)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    tokens = [o.token_ids for o in outputs]
    return {"prompt_tokens": sum(len(engine.tokenizer.encode(p, add_special_tokens=False)) for p in prompts),
            "prefill_tokens": engine.counters.prefill_tokens, "cache": engine.prefix_cache_stats,
            "seconds": round(time.perf_counter() - start, 2),
            "outputs_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--distinct", type=int, default=96)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--mode", default="dflash", choices=["target", "dflash"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    for name, prompts in patterns(args.requests, args.distinct, args.copies, args.seed).items():
        off, on = run(prompts, False, args), run(prompts, True, args)
        if off["outputs_sha256"] != on["outputs_sha256"]:
            raise SystemExit(f"{name}: greedy outputs differ with prefix caching on")
        report[name] = {"requests": len(prompts), "off": off, "on": on,
                        "prefilled_share": round(on["prefill_tokens"] / off["prefill_tokens"], 4)}
        print(f"{name}: {len(prompts)} requests, prefill tokens {off['prefill_tokens']} -> {on['prefill_tokens']} "
              f"({report[name]['prefilled_share']:.3f}), hit rate {on['cache']['hit_rate']:.3f}, outputs equal")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
