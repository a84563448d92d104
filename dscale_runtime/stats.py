"""Per-step statistics of the engine: what a step did (`StepStats`), what observers get (`StepTrace`), totals."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def retained_drafts(full_accepted: list[int], verify_lens: list[int]) -> int:
    """Drafts full-width verification accepted that a prefix of k slots still holds: sum_i min(y_i, k_i - 1)."""
    return sum(min(y, k - 1) for y, k in zip(full_accepted, verify_lens))


@dataclass
class StepStats:
    """What one decode step did (the collector and the metrics read this)."""

    step: int
    num_live: int
    """Requests decoded in this step."""
    request_ids: list[str]
    accepted_lens: list[int]
    """Accepted draft count per request (before stop rules cut the output)."""
    verify_lens: list[int]
    """Verified slots per request, anchor included."""
    num_verify_rows: int
    """Rows of the verification forward (M)."""
    full_accepted: list[int] | None = None
    """Accepted drafts under full-width verification (only with EngineConfig.measure_retention)."""

    @property
    def retention(self) -> float | None:
        """sum_i min(y_i, k_i - 1) / sum_i y_i (DESIGN 3.7); None when not measured or nothing to retain."""
        if self.full_accepted is None or not sum(self.full_accepted):
            return None
        return retained_drafts(self.full_accepted, self.verify_lens) / sum(self.full_accepted)


@dataclass
class StepTrace:
    """What a step observer receives after every speculative decode step (the trace collector's record)."""

    request_ids: list[str]
    decode_steps: list[int]
    """Index of this step within each request's decoding (0 = first decode step after prefill)."""
    context_lens: list[int]
    """Committed tokens of each request when its block was drafted (the anchor's position)."""
    num_live: int
    features: torch.Tensor  # [N, spec.width] float32 on the CPU, from dscale_runtime.dvl.features
    accepted_lens: list[int]
    """Accepted drafts of each request in this step (full-width verification in dflash mode)."""
    verify_lens: list[int]
    blocks: list[list[int]] | None = None
    """Each request's block: the anchor and its drafts."""


@dataclass
class EngineCounters:
    """Running totals since the engine started."""

    steps: int = 0
    prefill_tokens: int = 0
    context_tokens: int = 0
    """Positions whose drafter context was written after target-only steps had skipped it
    (`Engine._catch_up_context`)."""
    generated_tokens: int = 0
    accepted_drafts: int = 0
    request_steps: int = 0
    verify_rows: int = 0
    retained_drafts: int = 0
    full_width_drafts: int = 0
    steps_by_mode: dict[str, int] = field(default_factory=dict)
    """Decode steps by the step they ran ('target', 'dflash', 'dscale'): the policies' choices."""
    history: list[StepStats] = field(default_factory=list)
