"""End-to-end generation throughput of the demo pair on the GPU: target-only vs DFlash vs DScale (issues 8, 15).

Same engine, same held-out stdlib prompts, all requests submitted at once with `max_running_requests = c`;
tokens/s = generated tokens / wall time, the best of `--repeats` timed runs after a warm-up run of the same
prompts (so every prefill shape and Triton kernel is compiled before timing). Every mode runs through the step runner;
`--step-graphs` captures its steps (target-only too, so the speedups are against a captured baseline). Each
`--sampling` point is `T` or `T/top_p` (0 = greedy); sampled requests carry per-request seeds. Greedy output
of every mode is compared with target-only output (bf16 may differ at near-ties; fp32 must not): for each
difference, the fp32 target's top-2 logit margin at the first differing token (`dscale_runtime.demo.ties`).
Issue 15's check per mode and sampled point: tokens/s >= 0.95 x greedy tokens/s x acceptance / greedy acceptance.

    python benchmarks/demo_gpu_e2e.py --prompts 96 --max-tokens 128 --concurrency 8 32 --step-graphs \
        --sampling 0 1 0.7/0.8 --out e2e.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
from dscale_runtime.demo.ties import near_ties
from dscale_runtime.engine import Engine


def run(mode: str, prompts: list[str], concurrency: int, max_tokens: int, dtype: str, predictor: Path, graphs: bool,
        temperature: float, top_p: float, repeats: int = 2) -> dict:
    config = EngineConfig(mode=mode, max_running_requests=concurrency, device="cuda", dtype=dtype, max_model_len=1024,
                          step_graphs=graphs)
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter" if mode != "target" else None,
                                    predictor if mode == "dscale" else None, config=config)
    params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True,
                             seed=i if temperature > 0 else None) for i in range(len(prompts))]
    engine.generate(prompts, params)  # warm-up
    seconds = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        seconds = min(seconds, time.perf_counter() - start)
    steps = sum(o.stats.num_steps for o in outputs)
    accepted = [a for o in outputs for a in o.stats.accepted_lens]
    return {
        "mode": mode + (" graphs" if graphs else ""), "concurrency": concurrency, "temperature": temperature,
        "top_p": top_p, "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(len(o.token_ids) for o in outputs) / seconds, 1),
        "mean_acceptance_length": round(1 + sum(accepted) / len(accepted), 3) if mode != "target" else 1.0,
        "request_steps": steps, "tokens": [o.token_ids for o in outputs],
        **({"step_policy": engine.step_policy} if mode == "dscale" else {}),
    }


def parse_point(text: str) -> tuple[float, float]:
    t, _, p = text.partition("/")
    return float(t), float(p) if p else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--sampling", nargs="+", default=["0"], help="T or T/top_p per point (0 = greedy)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--predictor", type=Path, default=DEMO_DIR.parent / "demo.pt")
    parser.add_argument("--step-graphs", action="store_true", help="capture every mode's steps (CUDA graphs)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per point (the best is kept)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    rows = []
    for c in args.concurrency:
        greedy: dict[str, dict] = {}
        for point in map(parse_point, args.sampling):
            by_mode = {mode: run(mode, prompts, c, args.max_tokens, args.dtype, args.predictor, args.step_graphs,
                                 *point, args.repeats) for mode in ("target", "dflash", "dscale")}
            reference = by_mode["target"]["tokens"]
            for mode, r in by_mode.items():
                tokens = r.pop("tokens")
                if point[0] == 0:
                    greedy[mode] = r
                    r["prompts_equal_to_target"] = sum(a == b for a, b in zip(tokens, reference))
                    r["differences"] = near_ties(DEMO_DIR / "target", prompts, tokens, reference, device="cuda")
                elif mode in greedy:
                    g = greedy[mode]
                    scaled = g["tokens_per_s"] * r["mean_acceptance_length"] / g["mean_acceptance_length"]
                    r["sampled_cost_ratio"] = round(r["tokens_per_s"] / scaled, 3)  # issue 15 asks >= 0.95
                r["speedup_vs_target"] = round(r["tokens_per_s"] / by_mode["target"]["tokens_per_s"], 2)
                rows.append(r)
                extra = (f"equal {r['prompts_equal_to_target']}/{len(prompts)} margins "
                         f"{[d['fp32_top2_margin'] for d in r['differences']]}" if point[0] == 0 else
                         f"vs greedy-scaled {r.get('sampled_cost_ratio')}")
                print(f"c={c:3d} T={point[0]} top_p={point[1]} {r['mode']:14s} {r['tokens_per_s']:9.1f} tok/s  "
                      f"x{r['speedup_vs_target']:.2f}  acc_len {r['mean_acceptance_length']:.3f}  {extra}", flush=True)
    result = {"command": "python benchmarks/demo_gpu_e2e.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if k not in ("out", "predictor")),
              "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "prompts": len(prompts), "max_tokens": args.max_tokens, "dtype": args.dtype, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
