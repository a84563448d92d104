"""Micro-benchmark: one layer's verification attention at Qwen3-8B shape on one GPU (DESIGN 3.6 and 5).

N requests verify `rows` slots each (16: DFlash's full width; 8: DScale's 8N budget) over a context of
`context` tokens in scattered 16-token pages. Variants, timed with CUDA events around CUDA-graph replays
(median over samples, each sample `inner` calls on caches that rotate so that K/V come from HBM):
- `ref`: the portable `paged_attention_ref` (gather, pad, masked SDPA);
- `sdpa-flash`: torch's flash SDPA on K/V gathered and expanded to every q head beforehand (the kernel
  alone; DESIGN 5's strawman), and `sdpa-flash+gather` with the gather and expansion timed too. Both
  run without a mask (flash takes none for a 16-row query over 1k keys): their cost, not their result;
- `triton-tile128` / `triton-tile16`: the Triton kernel with the query tile forced (the "+tiles" ablation),
  and a few launch settings of the 16-row tile (`triton-tile16 w8` = 8 warps, `s3` = 3 stages, `bn32`/`bn128`
  = keys per step), for tuning.
The K/V read floor is the layer's K/V bytes at 4.25 TB/s (the copy rate measured on the H200, DESIGN 5).

    python benchmarks/bench_attention.py --output runs/attention_bench.json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dscale_runtime.attention import build_metadata, paged_attention_ref
from dscale_runtime.kernels import paged_attention

COPY_BYTES_PER_S = 4.25e12  # H200 device copy rate (DESIGN 5)


@dataclass(frozen=True)
class AttentionBenchConfig:
    """One layer's verify attention at Qwen3-8B shape; every field is a command-line flag."""

    output: str = "runs/attention_bench.json"
    """JSON file written with the configuration, the device and every variant's timings."""
    num_requests: int = 32
    """N, requests in the verification batch."""
    rows: tuple[int, ...] = (16, 8)
    """Query rows per request, one table per value (16 = DFlash full width, 8 = DScale's 8N budget)."""
    context: int = 1024
    """Committed tokens per request before the verified rows."""
    num_heads: int = 32
    """Query heads (Qwen3-8B: 32)."""
    num_kv_heads: int = 8
    """KV heads (Qwen3-8B: 8)."""
    head_dim: int = 128
    """Head dimension (Qwen3-8B: 128)."""
    page_size: int = 16
    """Tokens per cache page (the engine's default)."""
    dtype: str = "bfloat16"
    """bfloat16, float16 or float32."""
    warmup: int = 10
    """Untimed samples before timing."""
    samples: int = 100
    """Timed samples (the median is reported)."""
    inner: int = 8
    """Calls per sample, each on the next of `cache_copies` caches."""
    cache_copies: int = 4
    """Distinct K/V caches cycled through, so that one call's K/V are not in L2 for the next."""
    tuning: bool = True
    """Also time launch settings of the 16-row tile (warps, stages, keys per step)."""
    seed: int = 0
    """Seed of the inputs and of the page order."""


def _inputs(cfg: AttentionBenchConfig, rows: int, device: str = "cuda"):
    """q [N*rows, H, D], `cache_copies` K/V caches, causal verify metadata over scattered pages."""
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype, n, ps = getattr(torch, cfg.dtype), cfg.num_requests, cfg.page_size
    per_request = -(-(cfg.context + rows) // ps)
    order = (torch.randperm(n * per_request, generator=gen) + 1).tolist()  # page 0 is scratch
    tables = [order[i * per_request : (i + 1) * per_request] for i in range(n)]
    meta = build_metadata([rows] * n, [cfg.context] * n, tables, ps, device, causal=True)
    slots = (n * per_request + 1) * ps
    shape = (slots, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.randn(shape, generator=gen).to(device, dtype), torch.randn(shape, generator=gen).to(device, dtype))
              for _ in range(cfg.cache_copies)]
    q = torch.randn(n * rows, cfg.num_heads, cfg.head_dim, generator=gen).to(device, dtype)
    return q, caches, meta


def _gather_expanded(k_cache, v_cache, meta, page_size: int, num_heads: int):
    """Each request's K/V [N, H, kv, D], gathered through the block table and repeated for every q head."""
    key_pos = torch.arange(meta.max_kv, device=k_cache.device)
    slots = meta.block_tables[:, key_pos // page_size] * page_size + key_pos % page_size  # [N, kv]
    group = num_heads // k_cache.shape[1]
    k = k_cache[slots].transpose(1, 2).repeat_interleave(group, dim=1)  # [N, H, kv, D]
    v = v_cache[slots].transpose(1, 2).repeat_interleave(group, dim=1)
    return k, v


def _time(fn, calls: int, cfg: AttentionBenchConfig) -> tuple[list[float], bool]:
    """Per-call milliseconds of `samples` samples; fn(i) is call i of a sample. CUDA-graph replays when the
    calls capture, else eager; a device-side sleep first keeps host launch time out of the measurement."""
    for _ in range(cfg.warmup):
        for i in range(calls):
            fn(i)
    torch.cuda.synchronize()
    def run():
        for i in range(calls):
            fn(i)

    graphed = True
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    except Exception:  # noqa: BLE001 - a path that cannot be captured is timed eagerly (reported as such)
        graphed = False
        torch.cuda.synchronize()
    host = time.perf_counter()
    run()
    host = time.perf_counter() - host
    torch.cuda.synchronize()
    sleep_cycles = int(min(max(4 * host, 1e-4), 0.05) * 2e9)  # ~4x the host time of a sample, at <= 2 GHz
    times = []
    for _ in range(cfg.samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times, graphed


def bench_verify_attention(cfg: AttentionBenchConfig) -> dict:
    """Time every variant for every `rows` value; returns the JSON-ready result."""
    import triton

    assert torch.cuda.is_available(), "the attention benchmark needs a CUDA device"
    results, floors = [], {}
    for rows in cfg.rows:
        floors[rows], by_variant = _bench_rows(cfg, rows)
        results += by_variant
        torch.cuda.empty_cache()
    return {"config": dataclasses.asdict(cfg), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "kv_read_floor_ms": floors, "results": results}


def _bench_rows(cfg: AttentionBenchConfig, rows: int) -> tuple[float, list[dict]]:
    """(K/V read floor in ms, one result per variant) for `rows` query rows per request."""
    scale = cfg.head_dim**-0.5
    q, caches, meta = _inputs(cfg, rows)
    kv_bytes = 2 * cfg.num_requests * (cfg.context + rows) * cfg.num_kv_heads * cfg.head_dim * q.element_size()
    want = paged_attention_ref(q.float(), caches[0][0].float(), caches[0][1].float(), meta, cfg.page_size, scale)
    outs = [torch.empty_like(q) for _ in caches]
    q_pad = q.view(cfg.num_requests, rows, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [N, H, rows, D]
    expanded = [_gather_expanded(k, v, meta, cfg.page_size, cfg.num_heads) for k, v in caches]

    def flash(i, gather=False):
        if gather:
            k, v = _gather_expanded(*caches[i % len(caches)], meta, cfg.page_size, cfg.num_heads)
        else:
            k, v = expanded[i % len(caches)]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q_pad, k, v, scale=scale)

    variants = {
        "ref": lambda i: paged_attention_ref(q, *caches[i % len(caches)], meta, cfg.page_size, scale),
        "sdpa-flash": flash,
        "sdpa-flash+gather": lambda i: flash(i, gather=True),
    }
    triton_runs = {"triton-tile128": (128, None), "triton-tile16": (16, None)}
    if cfg.tuning:
        triton_runs |= {"triton-tile16 w8": (16, {"num_warps": 8}), "triton-tile16 s3": (16, {"num_stages": 3}),
                        "triton-tile16 bn32": (16, {"BLOCK_N": 32}), "triton-tile16 bn128": (16, {"BLOCK_N": 128})}
    for name, (tile, config) in triton_runs.items():
        variants[name] = _triton_call(q, caches, outs, meta, cfg.page_size, scale, tile, config)
    results = []
    for name, fn in variants.items():
        error = None
        if name.startswith("triton") or name == "ref":  # the SDPA variants run unmasked: cost only
            error = (fn(0).float() - want).abs().max().item()
        times, graphed = _time(fn, cfg.inner, cfg)
        results.append({"rows": rows, "variant": name, "median_ms": statistics.median(times),
                        "p10_ms": _quantile(times, 0.1), "p90_ms": _quantile(times, 0.9),
                        "max_abs_err_vs_fp32_ref": error, "graphed": graphed})
    return kv_bytes / COPY_BYTES_PER_S * 1e3, results


def _triton_call(q, caches, outs, meta, page_size, scale, tile, config):
    from dscale_runtime.kernels.triton_attention import paged_attention_triton

    def call(i):
        k, v = caches[i % len(caches)]
        if config is None:
            return paged_attention(q, k, v, meta, page_size, scale, backend="triton", tile_rows=tile,
                                   out=outs[i % len(outs)])
        return paged_attention_triton(q, k, v, meta, page_size, scale, tile_rows=tile, out=outs[i % len(outs)],
                                      config=config)

    return call


def _quantile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def format_table(result: dict) -> str:
    """One markdown table per `rows` value: median / p10 / p90 per call, speed-up over ref, x the K/V floor."""
    lines = []
    for rows, floor in result["kv_read_floor_ms"].items():
        ref = next(r["median_ms"] for r in result["results"] if r["rows"] == rows and r["variant"] == "ref")
        cfg = result["config"]
        lines += [(f"\n{cfg['num_requests']} requests x {rows} rows, context {cfg['context']}, {result['device']}; "
                   f"K/V read floor {floor * 1e3:.1f} us"),
                  "| variant | median us | p10 us | p90 us | vs ref | x floor | max abs err |",
                  "|---|---|---|---|---|---|---|"]
        for r in (r for r in result["results"] if r["rows"] == rows):
            err = "-" if r["max_abs_err_vs_fp32_ref"] is None else f"{r['max_abs_err_vs_fp32_ref']:.1e}"
            lines.append(f"| {r['variant']}{'' if r['graphed'] else ' (eager)'} | {r['median_ms'] * 1e3:.1f} | "
                         f"{r['p10_ms'] * 1e3:.1f} | {r['p90_ms'] * 1e3:.1f} | {ref / r['median_ms']:.2f}x | "
                         f"{r['median_ms'] / floor:.1f} | {err} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="python benchmarks/bench_attention.py", description=__doc__)
    parser.add_class_arguments(AttentionBenchConfig)
    cfg = AttentionBenchConfig(**vars(parser.parse_args(argv)))
    result = bench_verify_attention(cfg)
    path = Path(cfg.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
