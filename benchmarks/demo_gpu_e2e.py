"""End-to-end generation throughput of the demo pair on the GPU: target-only vs DFlash vs DScale (issue 8).

Same engine, same held-out stdlib prompts, greedy, all requests submitted at once with
`max_running_requests = c`; tokens/s = generated tokens / wall time (after a warm-up generate). Also checks
that every mode's greedy output equals target-only output and counts the prompts that differ (bf16 may
differ at near-ties; fp32 must not); for each difference, the fp32 target's top-2 logit margin at the first
differing token (`dscale_runtime.demo.ties`).

    python benchmarks/demo_gpu_e2e.py --prompts 128 --max-tokens 128 --concurrency 8 16 32 --out e2e.json
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


def run(variant: str, prompts: list[str], concurrency: int, max_tokens: int, dtype: str, predictor: Path) -> dict:
    mode, graphs = variant.split()[0], variant.endswith(" graphs")
    config = EngineConfig(mode=mode, max_running_requests=concurrency, device="cuda", dtype=dtype, max_model_len=1024,
                          step_graphs=graphs)
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter" if mode != "target" else None,
                                    predictor if mode == "dscale" else None, config=config)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:concurrency], SamplingParams(temperature=0, max_tokens=16))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    steps = sum(o.stats.num_steps for o in outputs)
    accepted = [a for o in outputs for a in o.stats.accepted_lens]
    return {
        "mode": variant, "concurrency": concurrency, "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(len(o.token_ids) for o in outputs) / seconds, 1),
        "mean_acceptance_length": round(1 + sum(accepted) / len(accepted), 3) if mode != "target" else 1.0,
        "request_steps": steps, "tokens": [o.token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--predictor", type=Path, default=DEMO_DIR.parent / "demo.pt")
    parser.add_argument("--step-graphs", action="store_true",
                        help="also run dflash and dscale with EngineConfig.step_graphs (CUDA graphs per bucket)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    rows = []
    for c in args.concurrency:
        by_mode = {mode: run(mode, prompts, c, args.max_tokens, args.dtype, args.predictor)
                   for mode in ("target", "dflash", "dscale") + (("dflash graphs", "dscale graphs")
                                                                 if args.step_graphs else ())}
        reference = by_mode["target"]["tokens"]
        for mode, r in by_mode.items():
            tokens = r.pop("tokens")
            r["prompts_equal_to_target"] = sum(a == b for a, b in zip(tokens, reference))
            r["differences"] = near_ties(DEMO_DIR / "target", prompts, tokens, reference, device="cuda")
            r["speedup_vs_target"] = round(r["tokens_per_s"] / by_mode["target"]["tokens_per_s"], 2)
            rows.append(r)
            print(f"c={c:3d} {mode:14s} {r['tokens_per_s']:9.1f} tok/s  x{r['speedup_vs_target']:.2f}  "
                  f"acc_len {r['mean_acceptance_length']:.3f}  equal {r['prompts_equal_to_target']}/{len(prompts)}  "
                  f"fp32 margins at differences {[d['fp32_top2_margin'] for d in r['differences']]}",
                  flush=True)
    result = {"command": "python benchmarks/demo_gpu_e2e.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if k not in ("out", "predictor")),
              "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
              "prompts": len(prompts), "max_tokens": args.max_tokens, "dtype": args.dtype, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
