"""KV-pool sizing from a share of the device's memory (`EngineConfig.memory_fraction`, SGLang's meaning of
--mem-fraction-static): weights, workspaces, captured graphs and the paged pool together take at most
`fraction x total` bytes, and the pool gets what the others leave.

The weights are what the process holds when the pool is planned. The workspaces and graphs are not allocated
yet, so they are measured: one eager decode step of the largest bucket, of the heaviest kind, and one prefill
chunk, each on a small temporary cache, give the peak of transient memory; the reserve is twice that peak
(the captured graphs' shared pool holds about one step's transients, eager prefills need their own).
"""

from __future__ import annotations

import gc

import torch

RESERVE_FACTOR = 2.0
"""Reserve for workspaces and graphs, in units of the profiled transient peak."""
RESERVE_MIN_BYTES = 256 << 20
"""At least this much is left besides weights and pool (allocator fragmentation, cuBLAS workspaces)."""


def kv_bytes_per_token(*caches: tuple[int, int, int, torch.dtype]) -> int:
    """Bytes one token takes in the pool: K and V of every layer of every cache (num_layers, kv_heads,
    head_dim, dtype), e.g. the target's and the drafter's."""
    return sum(2 * layers * heads * dim * torch.empty((), dtype=dtype).element_size()
               for layers, heads, dim, dtype in caches)


def pool_tokens(fraction: float, total_bytes: int, in_use_bytes: int, reserve_bytes: int, bytes_per_token: int,
                page_size: int, min_tokens: int, free_bytes: int | None = None) -> int:
    """Tokens of pool (whole pages) that fit in `fraction x total` beside what is in use and the reserve, and
    in what the device has free (other processes' memory included) less the reserve; raises ValueError, naming
    the numbers, when fewer than `min_tokens` (one request of max_model_len plus its lookahead) fit."""
    reserve = max(reserve_bytes, RESERVE_MIN_BYTES)
    budget = int(fraction * total_bytes) - in_use_bytes - reserve
    if free_bytes is not None:
        budget = min(budget, free_bytes - reserve)
    tokens = max(0, budget) // bytes_per_token // page_size * page_size
    if tokens < min_tokens:
        gib = 1 << 30
        raise ValueError(
            f"EngineConfig.memory_fraction={fraction} leaves room for {tokens} KV tokens "
            f"({fraction} x {total_bytes / gib:.1f} GiB, minus {in_use_bytes / gib:.2f} GiB of weights and "
            f"{reserve / gib:.2f} GiB for workspaces and graphs, at "
            f"{bytes_per_token} bytes per token); one request needs {min_tokens}: raise memory_fraction or "
            "lower max_model_len")
    return tokens


def transient_peak(device: torch.device, work) -> int:
    """Bytes `work()` allocates at its peak beyond what was allocated before it (CUDA); everything it
    allocated is released before this returns."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    work()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    gc.collect()  # NOTE: a runner's steps hold themselves in reference cycles
    torch.cuda.empty_cache()
    return max(0, peak)
