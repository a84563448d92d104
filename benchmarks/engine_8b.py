"""The public engine at Qwen3-8B shape on the GPU: decode throughput and host overhead per step (issue 15, crit. 3).

Random bf16 weights (`gpu_step.build_models`, the layout the loader produces on CUDA) in an `Engine` with step
graphs, c requests of `--prompt-len` random tokens, `--max-tokens` new tokens each (ignore_eos). Per mode
(target-only, DFlash, DScale with a random predictor normalised on real features): prefill seconds (the first
engine step admits and prefills all requests), decode tokens/s over the remaining steps, engine wall time per
decode step against the captured step's replay alone (CUDA events over the same bucket and kind), and the
same with half the requests sampled at T = 1 (per-request seeds) beside the all-greedy step.

    python benchmarks/engine_8b.py --out $OUT/engine_8b.json       # H200: about 2-3 minutes
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_step import SHAPES, build_models, fit_normalisation, random_predictor  # noqa: E402

from dscale_runtime.config import EngineConfig, SamplingParams  # noqa: E402
from dscale_runtime.dvl.features import FeatureSpec, hidden_projection  # noqa: E402
from dscale_runtime.engine import Engine  # noqa: E402
from dscale_runtime.kernels import KernelChoice  # noqa: E402


def replay_ms(step, reps: int = 20) -> float:
    """Median milliseconds of one replay of a captured step (its buffers as the last engine step left them)."""
    step.buf.host.fill_(1)  # NOTE: replay the inputs the last step resolved, not the device state it advanced
    times = []
    for _ in range(reps + 3):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times[3:])[reps // 2]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_mode(mode: str, models, args, mixed: bool, overlap: bool = True) -> dict:
    target, drafter, predictor, projection = models
    cfg = EngineConfig(mode=mode, max_running_requests=args.concurrency, device=args.device, dtype=args.dtype,
                       max_model_len=args.prompt_len + args.max_tokens + 32, step_graphs=args.device == "cuda",
                       graph_buckets=(args.concurrency,), sampling_rule=args.sampling_rule,
                       overlap_schedule=overlap, target_fallback=False)  # NOTE: each mode's own steps
    t0 = time.perf_counter()
    engine = Engine(target, drafter if mode != "target" else None, cfg, eos_token_ids=set(),
                    predictor=predictor if mode == "dscale" else None,
                    hidden_projection=projection if mode == "dscale" else None)
    sync()
    capture_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    for i in range(args.concurrency):
        sampled = mixed and i % 2 == 1
        params = SamplingParams(temperature=1.0 if sampled else 0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                seed=i if sampled else None)
        engine.add_request(torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist(), params)
    sync()
    t0 = time.perf_counter()
    engine.step()  # admits and prefills every request (the first chunk of them)
    while engine.num_waiting or any(r.prefilling for r in engine.scheduler.running):
        engine.step()  # NOTE: the rest of the prompts' chunks: prefill stays out of the decode window
    sync()
    prefill_s = time.perf_counter() - t0
    before_tokens, before_steps = engine.counters.generated_tokens, engine.counters.steps
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    decode_s = time.perf_counter() - t0
    steps = engine.counters.steps - before_steps
    tokens = engine.counters.generated_tokens - before_tokens
    size, kind = engine.runner.last_key  # the full batch's bucket: the first decode steps ran in it
    assert size == args.concurrency
    step_ms = replay_ms(engine.runner.steps[(size, kind)])
    wall_ms = decode_s / steps * 1000
    accepted = engine.counters.accepted_drafts / max(engine.counters.request_steps, 1)
    return {"mode": mode, "overlap_schedule": overlap, "mixed_half_sampled": mixed, "capture_and_build_s": round(capture_s, 2),
            "prefill_s": round(prefill_s, 3), "decode_tokens_per_s": round(tokens / decode_s, 1),
            "decode_steps": steps, "engine_ms_per_step": round(wall_ms, 3), "replay_ms": round(step_ms, 3),
            "wall_over_replay": round(wall_ms / step_ms, 3), "accepted_per_step": round(accepted, 3),
            "kind": str(kind)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--sampling-rule", default="auto")
    parser.add_argument("--modes", nargs="+", default=["target", "dflash", "dscale"])
    parser.add_argument("--overlap", nargs="+", default=["on", "off"], choices=["on", "off"],
                        help="EngineConfig.overlap_schedule settings to run")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape, dtype = SHAPES[args.shape], getattr(torch, args.dtype)
    kernels = KernelChoice.resolve(args.device, dtype)
    with torch.no_grad():
        target, drafter = build_models(shape, args.device, dtype, kernels)
        spec = FeatureSpec(num_positions=drafter.config.block_size - 1)
        projection = hidden_projection(spec, shape.hidden).to(args.device)
        predictor = random_predictor(spec, args.device)
        # Standardise the random predictor's inputs (spread-out scores, ragged k).
        fit_normalisation(predictor, torch.randn(256, spec.width, device=args.device))
    models = (target, drafter, predictor, projection)
    rows = []
    with torch.no_grad():
        for overlap in (o == "on" for o in args.overlap):
            for mode in args.modes:
                for mixed in (False, True):
                    row = run_mode(mode, models, args, mixed, overlap)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
    for overlap in (o == "on" for o in args.overlap):
        for mode in args.modes:
            greedy, mixed = (next(r for r in rows if r["mode"] == mode and r["mixed_half_sampled"] == m
                                  and r["overlap_schedule"] == overlap) for m in (0, 1))
            mixed["mixed_over_greedy_step"] = round(mixed["engine_ms_per_step"] / greedy["engine_ms_per_step"], 3)
    result = {"command": "python benchmarks/engine_8b.py " + " ".join(
                  f"--{k.replace('_', '-')} {' '.join(v) if isinstance(v, list) else v}"
                  for k, v in vars(args).items() if k != "out"),
              "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "rows": rows}
    print(json.dumps({r["mode"] + (" mixed" if r["mixed_half_sampled"] else "") + (
        "" if r["overlap_schedule"] else " no-overlap"): (
        r["decode_tokens_per_s"], r["wall_over_replay"], r.get("mixed_over_greedy_step")) for r in rows}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
