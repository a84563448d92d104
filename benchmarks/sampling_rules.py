"""Mean acceptance length of the two exact sampling rules on held-out demo prompts (issue 15, criterion 2).

The top-1 rule (the paper's: top-1 drafts accepted with probability p(x)) against the sampled-drafts rule
(z-lab's reference: drafts drawn from the drafter's q, accepted with min(1, p/q)), DFlash full width, the demo
pair, per-request seeds, at a grid of temperatures (top_p 1) and at T = 0.7 / top_p 0.8. The crossing point
sets `EngineConfig.sampled_drafts_min_temperature`, the default rule's switch.

    python benchmarks/sampling_rules.py --prompts 48 --max-tokens 96 --out rules.json          # CPU, minutes
    python benchmarks/sampling_rules.py --device cuda --prompts 128 --max-tokens 128 --out rules.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
from dscale_runtime.engine import Engine

POINTS = [(0.3, 1.0), (0.5, 1.0), (0.7, 1.0), (0.85, 1.0), (1.0, 1.0), (0.5, 0.8), (0.7, 0.8), (0.7, 0.9), (1.0, 0.8),
          (1.0, 0.9), (1.0, 0.95)]


def acceptance(engine: Engine, prompts: list[str], temperature: float, top_p: float, max_tokens: int) -> float:
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True,
                             seed=7919 * i + 1) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    accepted = [a for o in outputs for a in o.stats.accepted_lens]
    return 1 + sum(accepted) / len(accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # NOTE: the tail of the held-out set (the test suite uses its head)
    prompts = [p["prompt"] for p in stdlib_prompts()[-args.prompts:]]
    engines = {rule: Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter", config=EngineConfig(
        mode="dflash", device=args.device, dtype=args.dtype, max_running_requests=args.concurrency,
        max_model_len=1024, sampling_rule=rule, step_graphs=args.device.startswith("cuda"))) for rule in ("top1", "sampled")}
    rows = []
    start = time.time()
    for temperature, top_p in POINTS:
        row = {"temperature": temperature, "top_p": top_p}
        for rule, engine in engines.items():
            row[rule] = round(acceptance(engine, prompts, temperature, top_p, args.max_tokens), 3)
        row["better"] = "top1" if row["top1"] >= row["sampled"] else "sampled"
        rows.append(row)
        print(f"T={temperature:<5} top_p={top_p:<4} top1 {row['top1']:.3f}  sampled {row['sampled']:.3f}  "
              f"-> {row['better']}", flush=True)
    result = {"command": "python benchmarks/sampling_rules.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
              "prompts": len(prompts), "max_tokens": args.max_tokens, "seconds": round(time.time() - start, 1),
              "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
