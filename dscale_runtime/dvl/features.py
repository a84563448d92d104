"""Acceptance features: the single, versioned source of truth for the collector, the trainer and the runtime.

Per request, per draft position j = 1..W-1, from the drafter's logits at that position (DESIGN 3.1):
the highest logit, its gaps to ranks 2..16, the top token's log-probability and the softmax entropy
(18 values; 15 positions -> 270 confidence features, in draft order). Then the drafter's final hidden
state at each position through a fixed, seeded projection to `hidden_proj_dim` values (the matrix is a
function of the spec and the drafter width, and is stored in traces and artifacts), then the batch
context: live batch size, the request's context length and decode step, how many earlier steps it has,
and its last `history` accepted counts (most recent first, 0 where missing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

FEATURE_VERSION = "dscale-features-v1"


@dataclass(frozen=True)
class FeatureSpec:
    """Layout of one request's feature vector; `version` changes whenever the meaning of any column does."""

    version: str = FEATURE_VERSION
    num_positions: int = 15
    """Draft positions per block (W - 1)."""
    num_ranks: int = 16
    """Top-k logits read per position (gaps to ranks 2..num_ranks)."""
    hidden_proj_dim: int = 4
    """Values per position from the projected drafter hidden state."""
    history: int = 4
    """Most recent accepted counts of the request in the batch context."""
    proj_seed: int = 20260523
    """Seed of the hidden-state projection matrix."""

    @property
    def per_position(self) -> int:
        return 1 + (self.num_ranks - 1) + 1 + 1

    @property
    def num_confidence(self) -> int:
        return self.per_position * self.num_positions

    @property
    def num_hidden(self) -> int:
        return self.hidden_proj_dim * self.num_positions

    @property
    def num_context(self) -> int:
        return 4 + self.history

    @property
    def width(self) -> int:
        return self.num_confidence + self.num_hidden + self.num_context

    def names(self) -> list[str]:
        per = ["top1_logit"] + [f"gap_{r}" for r in range(2, self.num_ranks + 1)] + ["top1_logprob", "entropy"]
        names = [f"pos{j}_{n}" for j in range(1, self.num_positions + 1) for n in per]
        names += [f"pos{j}_hidden{h}" for j in range(1, self.num_positions + 1) for h in range(self.hidden_proj_dim)]
        names += ["num_live", "context_len", "decode_step", "history_len"]
        names += [f"prev_accepted_{i}" for i in range(1, self.history + 1)]
        return names

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureSpec":
        return cls(**d)


def hidden_projection(spec: FeatureSpec, hidden_size: int) -> torch.Tensor:
    """The fixed projection [hidden_size, hidden_proj_dim] (seeded, CPU-generated, so identical everywhere)."""
    gen = torch.Generator().manual_seed(spec.proj_seed)
    return torch.randn(hidden_size, spec.hidden_proj_dim, generator=gen) / hidden_size**0.5


def confidence_features(draft_logits: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """draft_logits [N, P, V] -> [N, P * (num_ranks + 2)]: `confidence_features_ref`'s columns, on CUDA in one
    fused Triton pass over the logits (`dscale_runtime.kernels.features`), elsewhere the reference itself."""
    from dscale_runtime.kernels.features import confidence_features as routed

    return routed(draft_logits, num_ranks)


def confidence_features_ref(draft_logits: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """draft_logits [N, P, V] -> [N, P * (num_ranks + 2)] (per position: top1, gaps, top1 logprob, entropy):
    the portable definition, and the oracle of the fused kernel."""
    logits = draft_logits.float()
    top = logits.topk(min(num_ranks, logits.shape[-1]), dim=-1).values  # [N, P, R]
    if top.shape[-1] < num_ranks:
        # NOTE: only toy vocabularies are smaller than the rank count; missing ranks repeat the last logit.
        top = torch.cat([top, top[..., -1:].expand(*top.shape[:-1], num_ranks - top.shape[-1])], dim=-1)
    top1 = top[..., :1]
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, P, 1]
    log_p = logits - log_z
    entropy = -(log_p.exp() * log_p).sum(-1, keepdim=True)
    per_position = torch.cat([top1, top1 - top[..., 1:], top1 - log_z, entropy], dim=-1)  # [N, P, R + 2]
    return per_position.flatten(1)


def context_features(spec: FeatureSpec, num_live: int, context_lens: list[int], decode_steps: list[int],
                     recent_accepted: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Batch context [N, 4 + history] built on the host from request state (one small copy per step)."""
    rows = []
    for ctx, step, recent in zip(context_lens, decode_steps, recent_accepted):
        last = list(reversed(recent[-spec.history :]))
        rows.append([num_live, ctx, step, len(last)] + last + [0] * (spec.history - len(last)))
    return torch.tensor(rows, dtype=torch.float32, device=device).view(len(rows), spec.num_context)


def acceptance_features(
    spec: FeatureSpec,
    draft_logits: torch.Tensor,  # [N, P, V] drafter logits at draft positions 1..P
    draft_hidden: torch.Tensor,  # [N, P, d] drafter final (normed) hidden states at those positions
    projection: torch.Tensor,  # [d, hidden_proj_dim]
    context: torch.Tensor,  # [N, num_context] from context_features
) -> torch.Tensor:  # [N, spec.width] float32
    assert draft_logits.shape[1] == spec.num_positions, "feature spec and block size disagree"
    hidden = (draft_hidden.float() @ projection.to(draft_hidden.device, torch.float32)).flatten(1)
    return torch.cat([confidence_features(draft_logits, spec.num_ranks), hidden, context], dim=-1)
