"""DFlash vs target-only decoding speed of the demo pair on the CPU at batch 1 (issue 4, criterion 3).

Same engine, same prompts, greedy; tokens/s = generated tokens / wall time over the prompt set, median of
`--repeats` runs (the modes interleaved so drift in machine load hits both alike), once per `--dtypes`
entry TARGET[/DRAFTER]: float32 (the engine's CPU default), bfloat16 (the checkpoint's dtype; CPUs with
AVX512-BF16 or AMX run it natively), or float32/bfloat16 (an fp32 target, whose greedy output is the
reference, beside a bf16 drafter: `EngineConfig.draft_dtype`; a CPU decode step is bound by memory
bandwidth, and the drafter's precision never changes the output). Also counts the prompts whose DFlash
output equals target-only output and, where they differ, the target's top-2 logit margin at the first
differing token (recomputed in float32 over the shared prefix): lossless greedy allows differences only at
such near-ties of reduced precision.
Writes artifacts/demo/cpu_speed.json (read by the artifacts README) and prints a table.

    python benchmarks/demo_cpu_speed.py --prompts 8 --max-tokens 128 --repeats 3 --dtypes float32/bfloat16,float32
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
from dscale_runtime.demo.ties import near_ties
from dscale_runtime.engine import Engine


def run(mode: str, dtypes: str, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    dtype, _, draft_dtype = dtypes.partition("/")
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter" if mode != "target" else None,
                                    config=EngineConfig(mode=mode, max_running_requests=1, max_model_len=1024,
                                                        dtype=dtype, draft_dtype=draft_dtype or None))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / seconds, [o.token_ids for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32/bfloat16,float32,bfloat16",
                        help="comma-separated TARGET[/DRAFTER] dtypes; the first is the headline")
    args = parser.parse_args()
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    results = {}
    for dtype in args.dtypes.split(","):
        rates: dict[str, list[float]] = {"target": [], "dflash": []}
        outputs = {}
        for _ in range(args.repeats):
            for mode in rates:
                rate, outputs[mode] = run(mode, dtype, prompts, args.max_tokens)
                rates[mode].append(rate)
        target, dflash = statistics.median(rates["target"]), statistics.median(rates["dflash"])
        equal = sum(x == y for x, y in zip(outputs["dflash"], outputs["target"]))
        results[dtype] = {
            "target_tokens_per_s": round(target, 1), "dflash_tokens_per_s": round(dflash, 1),
            "speedup": round(dflash / target, 2), "runs": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
            "prompts_equal_to_target_only": equal,
            "differences": near_ties(DEMO_DIR / "target", prompts, outputs["dflash"], outputs["target"]),
        }
        if dtype.startswith("float32") and equal != len(prompts):
            raise AssertionError("float32 DFlash greedy output differs from target-only greedy output")
    head = results[args.dtypes.split(",")[0]]
    result = {
        "command": f"python benchmarks/demo_cpu_speed.py --prompts {args.prompts} --max-tokens {args.max_tokens} "
                   f"--repeats {args.repeats} --dtypes {args.dtypes}",
        "date": datetime.date.today().isoformat(),
        "device": f"CPU, {torch.get_num_threads()} threads ({platform.machine()}, "
                  f"{torch.backends.cpu.get_cpu_capability()})",
        "repeats": args.repeats, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "headline_dtype": args.dtypes.split(",")[0],
        "target_tokens_per_s": head["target_tokens_per_s"], "dflash_tokens_per_s": head["dflash_tokens_per_s"],
        "speedup": head["speedup"], "dtypes": results,
    }
    (Path(DEMO_DIR) / "cpu_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print("| dtype | target tok/s | DFlash tok/s | speedup | prompts equal | differences (fp32 margin) |\n"
          "|---|---|---|---|---|---|")
    for dtype, r in results.items():
        diffs = "; ".join(f"#{d['prompt']} at {d['first_difference']}: {d['fp32_top2_margin']}" for d in r["differences"])
        print(f"| {dtype} | {r['target_tokens_per_s']} | {r['dflash_tokens_per_s']} | {r['speedup']}x | "
              f"{r['prompts_equal_to_target_only']}/{len(prompts)} | {diffs or '-'} |")


if __name__ == "__main__":
    main()
