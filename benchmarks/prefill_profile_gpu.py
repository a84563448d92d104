"""Where a captured prefill bucket's time goes, kernel by kernel (issue 24): one chunk of one request, as the
chunk budget beside decoding cuts it, in each of `--buckets`. Per bucket: its replay time from position 0 and
after `--ctx` keys (distinct pool pages, as `PrefillRunner.measure` times it), the bucket's request slots and
attention grid, and a `torch.profiler` breakdown of its eager forward (same buffers, same kernels) by kernel name.

Why: start-up times on the H100 (2026-12-05) did not grow with the tokens: at Qwen3-8B shape 16 tokens cost 7.9 ms,
32 cost 14.6, 64 cost 15.3; on the demo pair 512 tokens cost 2.35 ms and 1,536 cost 2.13. They followed the
attention's program count (request slots x head groups x query tiles x key splits), so buckets now have variants
with fewer request slots (`PrefillRunner.variants`: 1, 4, 16, ..., the full count); every variant is profiled.

    python benchmarks/prefill_profile_gpu.py --buckets 16 32 64 512 1536 --out prof.json             # demo pair
    python benchmarks/prefill_profile_gpu.py --shape qwen3-8b --buckets 16 32 64 128 --out prof8b.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_step import SHAPES, build_models, kernel_table  # noqa: E402

from dscale_runtime.config import EngineConfig  # noqa: E402
from dscale_runtime.demo.prompts import DEMO_DIR  # noqa: E402
from dscale_runtime.engine import Engine  # noqa: E402
from dscale_runtime.graphs import cuda_times  # noqa: E402
from dscale_runtime.kernels import heads_per_program, tile_rows_for  # noqa: E402
from dscale_runtime.prefill import PrefillChunk  # noqa: E402


def build(args) -> Engine:
    config = EngineConfig(mode=args.mode, device="cuda", dtype="bfloat16", step_graphs=True,
                          max_running_requests=args.max_running_requests, max_model_len=args.max_model_len,
                          prefix_caching=False, target_fallback=False, **({"kv_cache_tokens": args.kv_cache_tokens}
                                                   if args.kv_cache_tokens else {}))
    if args.shape == "demo":
        return Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter" if args.mode != "target" else None,
                                      None, config=config)
    from dscale_runtime.kernels import KernelChoice

    kernels = KernelChoice.resolve("cuda", torch.bfloat16)
    target, drafter = build_models(SHAPES[args.shape], "cuda", torch.bfloat16, kernels)
    return Engine(target, drafter if args.mode != "target" else None, config, eos_token_ids=set())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="demo", help="demo (the shipped pair) or a gpu_step.SHAPES name")
    parser.add_argument("--mode", default="dflash", choices=["target", "dflash"])
    parser.add_argument("--buckets", type=int, nargs="+", default=[16, 32, 64, 128, 512, 1536])
    parser.add_argument("--ctx", type=int, default=0, help="keys before the chunk in the second timing (0: "
                        "as many as the table holds beside the bucket, at most 16,384)")
    parser.add_argument("--max-running-requests", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-tokens", type=int, default=0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    engine = build(args)
    pre = engine.prefiller
    cfg = pre.target.config
    span = pre.max_pages * pre.page_size
    free = engine.allocator.num_pages - 1
    rows = []
    for tokens in args.buckets:
        if tokens not in pre.buckets:
            print(f"[profile] {tokens}: not a bucket ({pre.buckets})", flush=True)
            continue
        for slots in pre.variants(tokens):
            try:
                row = profile_bucket(pre, cfg, tokens, slots, span, free, args)
            except Exception as exc:  # noqa: BLE001 - one bucket's failure is reported, the others still run
                print(f"[profile] bucket {tokens} slots={slots}: {type(exc).__name__}: {exc}", flush=True)
                continue
            rows.append(row)
            print(f"[profile] bucket {tokens}: slots {row['request_slots']}, splits {row['kv_splits']}, grid "
                  f"{row['attention_grid']}; replay {row['replay_ms_from_0']} ms from 0, {row['replay_ms_after_ctx']} "
                  f"ms after {row['ctx_after_ctx']} keys", flush=True)
            print(f"    {row['kernels_from_0']['total_ms']} ms of kernels, {row['kernels_from_0']['launches']} "
                  "launches per call; the largest:", flush=True)
            for k in row["kernels_from_0"]["top"][:6]:
                print(f"    {k['ms']:8.4f} ms  x{k['calls']:<4} {k['kernel'][:90]}", flush=True)
        if args.out:
            args.out.write_text(json.dumps({"shape": args.shape, "mode": args.mode, "device":
                                            torch.cuda.get_device_name(), "torch": torch.__version__,
                                            "rows": rows}, indent=1))


def profile_bucket(pre, cfg, tokens: int, slots: int, span: int, free: int, args) -> dict:
    """One bucket's variant of `slots` request slots: replay times, grid and kernel breakdowns, one request's chunk
    of `tokens` in it."""
    step = pre.get(tokens, False, False, slots)
    row = {"bucket": tokens, "solo": slots == 1, "request_slots": step.buf.requests, "kv_splits": step.kv_splits}
    tile = pre.target.kernels.attention_tile or tile_rows_for(tokens)
    heads = heads_per_program(cfg.num_attention_heads // cfg.num_key_value_heads, tile)
    row["attention_grid"] = [step.buf.requests + 1, cfg.num_attention_heads // heads,
                             -(-tokens // tile) * step.kv_splits]
    row["attention_programs_per_layer"] = int(np.prod(row["attention_grid"]))
    for label, ctx in (("from_0", 0), ("after_ctx", min(args.ctx or 16384, span - tokens))):
        pages = [1 + p % free for p in range(-(-(ctx + tokens) // pre.page_size))]
        step.buf.fill([PrefillChunk([0] * tokens, ctx, pages)], pre.state.dummy)
        step()
        row[f"replay_ms_{label}"] = round(float(np.median(cuda_times(step, args.reps))), 3)
        row[f"ctx_{label}"] = ctx
        step.step()  # NOTE: once unprofiled: eager first calls pay allocator and launch set-up
        row[f"kernels_{label}"] = kernel_table(step.step, "cuda", args.reps, args.top)
    return row


if __name__ == "__main__":
    main()
