"""Triton top-k / top-p floors on the GPU (issue 25): one program per row (`triton_filters._row_kernel`, vocabularies
up to ROW_PROGRAM_VOCAB) beside the radix rounds, per call, captured (20 calls per graph replay, 10 replays timed
with CUDA events), bf16 logits at T = 0.7, for top_p 0.8, top_k 50 and both; the Qwen3 vocabulary takes the rounds
only.

    python benchmarks/filter_floor_gpu.py OUT.json       # H200, ~20 s
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dscale_runtime.kernels import triton_filters  # noqa: E402

SHAPES = ((8, 4096), (32, 4096), (128, 4096), (512, 4096), (32, 151936))
FILTERS = (("top_p0.8", -1, 0.8), ("top_k50", 50, 1.0), ("both", 50, 0.8))
CALLS, REPLAYS = 20, 10


def time_floor(logits, shift, inv_t, top_k, top_p) -> float:
    """Microseconds per `filter_floor_triton` call, replayed from a CUDA graph."""
    triton_filters.filter_floor_triton(logits, shift, inv_t, top_k, top_p)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            triton_filters.filter_floor_triton(logits, shift, inv_t, top_k, top_p)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (CALLS * REPLAYS)


def main(out: str) -> dict:
    results, limit = {}, triton_filters.ROW_PROGRAM_VOCAB
    try:
        for rows, vocab in SHAPES:
            gen = torch.Generator().manual_seed(0)
            logits = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16().cuda()
            shift, inv_t = logits.float().amax(-1), torch.full((rows,), 1 / 0.7, device="cuda")
            for name, k, p in FILTERS:
                top_k = torch.full((rows,), k, dtype=torch.long, device="cuda")
                top_p = torch.full((rows,), p, device="cuda")
                for path, path_limit in (("row", limit), ("radix", 0)):
                    if path == "row" and vocab > limit:
                        continue
                    triton_filters.ROW_PROGRAM_VOCAB = path_limit
                    us = time_floor(logits, shift, inv_t, top_k, top_p)
                    results[f"{rows}x{vocab} {name} {path}"] = round(us, 2)
                    print(f"{rows}x{vocab} {name:9s} {path:6s} {us:8.2f} us", flush=True)
                    triton_filters.ROW_PROGRAM_VOCAB = limit
    finally:
        triton_filters.ROW_PROGRAM_VOCAB = limit
    Path(out).write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1])
