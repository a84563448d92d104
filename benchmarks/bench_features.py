"""Micro-benchmark: the Triton confidence features (`kernels/triton_features.py`) against the reference
`kernels.features.confidence_features_ref` on random logits at Qwen3's vocabulary, on one GPU.

`bench` times one configuration (CUDA events after warm-up); `sweep` times launch configurations around the
default (tuning; each compiles once).

    python benchmarks/bench_features.py            # fp32 and bf16, N = 1..64 requests x 15 positions
    python benchmarks/bench_features.py --sweep    # launch configurations, best first
"""

from __future__ import annotations

import sys

import torch

from dscale_runtime.kernels.features import confidence_features_ref
from dscale_runtime.kernels.triton_features import confidence_features_triton, launch_config


def bench(rows: int, vocab: int, dtype: torch.dtype, iters: int = 50, config: dict | None = None,
          num_ranks: int = 16, with_reference: bool = True) -> tuple[float, float | None]:
    """Milliseconds per call of the Triton path and of the reference on random CUDA logits [rows, vocab]
    (CUDA events, after warm-up): the GPU benchmark's measurement. Needs a CUDA device."""
    assert torch.cuda.is_available(), "bench needs a CUDA device"
    logits = (torch.randn(rows, vocab, device="cuda") * 4).to(dtype)
    out = torch.empty(rows, num_ranks + 2, dtype=torch.float32, device="cuda")
    paths = {"triton": lambda: confidence_features_triton(logits, num_ranks, out=out, config=config),
             "ref": lambda: confidence_features_ref(logits.view(rows, 1, vocab), num_ranks)}
    if not with_reference:
        del paths["ref"]
    times = {}
    for name, call in paths.items():
        for _ in range(3):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            call()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / iters
    return times["triton"], times.get("ref")


def sweep(dtype: torch.dtype = torch.bfloat16, requests=(8, 32, 64)) -> list[dict]:
    """Launch configurations around the default at Qwen3's vocabulary: milliseconds per call, printed as
    they come (tuning; each configuration compiles once)."""
    configs = [{"GROUPS": 512, "TILES": t, "num_warps": w} for t in (4, 8, 16, 32) for w in (2, 4)]
    configs += [{"GROUPS": 256, "TILES": t, "num_warps": 2} for t in (16, 32)]
    results = []
    for config in configs:
        for n in requests:
            rows = n * 15
            default = launch_config(rows, 151936, 16, dtype)
            try:
                ms, _ = bench(rows, 151936, dtype, iters=20, config=config, with_reference=False)
            except Exception as exc:  # noqa: BLE001 (a configuration that does not compile or fit)
                print(f"N={n} {config}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                break
            row = {"N": n, **config, "ms": round(ms, 4), "default": all(default[k] == v for k, v in config.items())}
            results.append(row)
            print(row, flush=True)
    return results


if __name__ == "__main__":  # python benchmarks/bench_features.py [--sweep]: Qwen3 vocabulary
    if "--sweep" in sys.argv:
        table = sweep()
        for n in sorted({r["N"] for r in table}):
            rows = sorted((r for r in table if r["N"] == n), key=lambda r: r["ms"])
            base = next(r for r in rows if r["default"]) if any(r["default"] for r in rows) else None
            print(f"N={n}: default {base}; best: " + "; ".join(
                f"G{r['GROUPS']} T{r['TILES']} w{r['num_warps']} {r['ms']:.4f}" for r in rows[:6]))
        sys.exit(0)
    for dtype in (torch.float32, torch.bfloat16):
        for requests in (1, 8, 16, 32, 64):
            fused_ms, ref_ms = bench(requests * 15, 151936, dtype)
            print(f"{str(dtype):15s} N={requests:3d} rows={requests * 15:4d}  triton {fused_ms:.3f} ms  "
                  f"reference {ref_ms:.3f} ms  x{ref_ms / fused_ms:.1f}")
