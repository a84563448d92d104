"""CPU decode speed of the demo pair against max_model_len: the eager (portable) path's cost (issue 24).

The eager step's attention should cost what the live context costs, not `max_model_len`: this times
`Engine.generate` on the demo pair (the public API only) for each `--max-model-len` and each temperature,
tokens/s = generated tokens / wall time over the prompt set, median of `--repeats` runs, and the same over
the process's CPU time (`cpu_tokens_per_s`: with one thread, what the run costs whatever else shares the
machine; the wall figure counts time the process waited for a core). One thread by default
(`torch.set_num_threads`). `--repo DIR` imports `dscale_runtime` from another checkout first (a git
worktree of an older commit, say: the script uses only API that predates the step runner), so one script
times both side by side; the demo checkpoints come from this checkout unless `--target` / `--drafter` say.
The lengths' engines are built first and their runs interleaved (repeat by repeat), so drift in the
machine's load hits every length alike; run commits alternately for the same reason. Each row records a
digest of the generated token ids (greedy rows must agree across commits and lengths).
`--count-keys` also counts what the portable attention path computes (a wrapper around
`dscale_runtime.kernels.paged_attention_ref`, the one internal hook): keys gathered (N x max_kv per call) and
scores (N x max_q x max_kv) over one extra, untimed run; counts do not depend on the machine's load.

    python benchmarks/cpu_context_cost.py --max-model-len 1024,4096 --out /tmp/main.json
    python benchmarks/cpu_context_cost.py --repo /tmp/dscale_7368854 --max-model-len 1024,4096 --out /tmp/old.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=None, help="import dscale_runtime from this checkout")
    parser.add_argument("--target", default=str(HERE / "artifacts" / "demo" / "target"))
    parser.add_argument("--drafter", default=str(HERE / "artifacts" / "demo" / "drafter"))
    parser.add_argument("--mode", default="dflash", choices=("target", "dflash"))
    parser.add_argument("--max-model-len", default="1024,4096", help="comma-separated EngineConfig.max_model_len")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8, help="EngineConfig.max_running_requests")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--count-keys", action="store_true", help="count the portable path's keys and scores")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.repo:
        sys.path.insert(0, str(Path(args.repo).resolve()))

    import torch

    import dscale_runtime
    from dscale_runtime.config import EngineConfig, SamplingParams
    from dscale_runtime.demo.prompts import stdlib_prompts
    from dscale_runtime.engine import Engine

    torch.set_num_threads(args.threads)
    counts = {"calls": 0, "keys": 0, "scores": 0}
    if args.count_keys:
        import dscale_runtime.kernels as kernels

        attention = kernels.paged_attention_ref

        def counting(q, k_cache, v_cache, meta, *rest, **kw):
            counts["calls"] += 1
            counts["keys"] += meta.num_requests * meta.max_kv
            counts["scores"] += meta.num_requests * meta.max_q * meta.max_kv
            return attention(q, k_cache, v_cache, meta, *rest, **kw)

        kernels.paged_attention_ref = counting
    source = Path(dscale_runtime.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    if subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                      capture_output=True, text=True).stdout.strip():
        commit += "+changes"  # uncommitted edits to tracked files
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    lengths = [int(x) for x in args.max_model_len.split(",")]
    engines = {}
    for max_len in lengths:
        config = EngineConfig(mode=args.mode, max_running_requests=args.concurrency, max_model_len=max_len,
                              dtype=args.dtype)
        engines[max_len] = Engine.from_pretrained(args.target, args.drafter if args.mode != "target" else None,
                                                  config=config)
        engines[max_len].generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    rows = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        params = [SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                 seed=None if temperature == 0 else 1000 + i) for i in range(len(prompts))]
        rates = {n: [] for n in lengths}
        cpu_rates = {n: [] for n in lengths}
        digests = {}
        for _ in range(args.repeats):
            for max_len in lengths:  # NOTE: interleaved, so drift in the machine's load hits every length alike
                start, cpu_start = time.perf_counter(), time.process_time()
                outputs = engines[max_len].generate(prompts, params)
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                tokens = sum(len(o.token_ids) for o in outputs)
                rates[max_len].append(tokens / seconds)
                cpu_rates[max_len].append(tokens / cpu_seconds)
                digests[max_len] = hashlib.sha256(
                    json.dumps([list(o.token_ids) for o in outputs]).encode()).hexdigest()[:12]
        for max_len in lengths:
            if args.count_keys:
                counts.update(calls=0, keys=0, scores=0)
                engines[max_len].generate(prompts, params)
            row = {"max_model_len": max_len, "temperature": temperature,
                   "tokens_per_s": round(statistics.median(rates[max_len]), 1),
                   "runs": [round(r, 1) for r in rates[max_len]],
                   "cpu_tokens_per_s": round(statistics.median(cpu_rates[max_len]), 1),
                   "cpu_runs": [round(r, 1) for r in cpu_rates[max_len]], "outputs_sha256": digests[max_len],
                   **({"attention": dict(counts)} if args.count_keys else {})}
            rows.append(row)
            print(f"{commit} {args.mode} max_model_len={max_len} T={temperature:g}: {row['tokens_per_s']} tok/s "
                  f"(runs {row['runs']}), {row['cpu_tokens_per_s']} tok/CPU-s (runs {row['cpu_runs']}), "
                  f"outputs {row['outputs_sha256']}" + (f", attention {counts}" if args.count_keys else ""),
                  flush=True)
    result = {"commit": commit, "source": str(source), "mode": args.mode, "prompts": args.prompts,
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "dtype": args.dtype,
              "threads": args.threads, "repeats": args.repeats,
              "device": f"CPU ({platform.machine()}, {torch.backends.cpu.get_cpu_capability()})", "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
