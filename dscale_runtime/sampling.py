"""The target's decoding policy: temperature, top-k and top-p turned into per-row distributions, and draws.

Per-request seeds get their own `torch.Generator` (as in vLLM), so a seeded request samples the same
tokens whatever else is in the batch; unseeded requests share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingBatch:
    """Policy parameters of R rows (requests, or verification rows via `rows`)."""

    temperature: torch.Tensor  # [R] float32, > 0 for every row that samples (greedy rows are ignored)
    top_k: torch.Tensor  # [R] int64, <= 0 means off
    top_p: torch.Tensor  # [R] float32, 1 means off
    needs_sort: bool  # some row uses top-k or top-p (decided on the host, no device read)

    def rows(self, index: torch.Tensor) -> "SamplingBatch":
        """The same parameters gathered for rows that belong to requests `index` [M]."""
        return SamplingBatch(self.temperature[index], self.top_k[index], self.top_p[index], self.needs_sort)


def policy_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """fp32 logits [R, V] -> probabilities [R, V] of the temperature/top-k/top-p policy."""
    logits = logits.float() / batch.temperature.clamp_min(1e-6)[:, None]
    if not batch.needs_sort:
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    top_k = torch.where(batch.top_k > 0, batch.top_k, logits.shape[-1])
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= batch.top_p[:, None]
    drop[:, 0] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.zeros_like(logits).scatter_(-1, order, torch.softmax(sorted_logits, dim=-1))


def sample(probs: torch.Tensor, generators: list[torch.Generator | None], default: torch.Generator) -> torch.Tensor:
    """One draw per row of probs [R, V] (exponential race: argmax p / E, E ~ Exp(1))."""
    noise = torch.empty_like(probs).exponential_(generator=default)
    for row, gen in enumerate(generators):
        if gen is not None:
            noise[row].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)


def uniforms(rows: int, cols: int, generators: list[torch.Generator | None], default: torch.Generator,
             device: torch.device) -> torch.Tensor:
    """U[0, 1) draws [rows, cols], row i from generators[i] when it has one."""
    out = torch.rand(rows, cols, generator=default, device=device)
    for row, gen in enumerate(generators):
        if gen is not None:
            out[row] = torch.rand(cols, generator=gen, device=device)
    return out
