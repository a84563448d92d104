"""DFlash vs target-only decoding speed of the demo pair on the CPU at batch 1 (issue 4, criterion 3).

Same engine, same prompts, greedy; tokens/s = generated tokens / wall time over the prompt set, median of
`--repeats` runs. Writes artifacts/demo/cpu_speed.json (read by the artifacts README) and prints a table.

    python benchmarks/demo_cpu_speed.py --prompts 8 --max-tokens 128 --repeats 3
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
from dscale_runtime.engine import Engine


def run(mode: str, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter" if mode != "target" else None,
                                    config=EngineConfig(mode=mode, max_running_requests=1, max_model_len=1024))
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
    args = parser.parse_args()
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    rates: dict[str, list[float]] = {"target": [], "dflash": []}
    outputs = {}
    for _ in range(args.repeats):
        for mode in rates:  # interleaved, so drift in machine load hits both modes alike
            rate, outputs[mode] = run(mode, prompts, args.max_tokens)
            rates[mode].append(rate)
    assert outputs["dflash"] == outputs["target"], "DFlash greedy output differs from target-only greedy output"
    target, dflash = statistics.median(rates["target"]), statistics.median(rates["dflash"])
    result = {
        "command": f"python benchmarks/demo_cpu_speed.py --prompts {args.prompts} --max-tokens {args.max_tokens} "
                   f"--repeats {args.repeats}",
        "date": datetime.date.today().isoformat(),
        "device": f"CPU, {torch.get_num_threads()} threads ({platform.machine()})",
        "repeats": args.repeats, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "target_tokens_per_s": round(target, 1), "dflash_tokens_per_s": round(dflash, 1),
        "speedup": round(dflash / target, 2), "runs": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
    }
    (Path(DEMO_DIR) / "cpu_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"| mode | tokens/s (median of {args.repeats}) |\n|---|---|\n| target | {target:.1f} |\n"
          f"| dflash | {dflash:.1f} |\nspeedup {dflash / target:.2f}x")


if __name__ == "__main__":
    main()
