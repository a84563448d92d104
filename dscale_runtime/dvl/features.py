"""Acceptance features: the single, versioned source of truth for the collector, the trainer and the runtime.

Per request, per draft position j = 1..W-1, from the drafter's logits at that position (DESIGN 3.1):
the highest logit, its gaps to ranks 2..16, the top token's log-probability and the softmax entropy
(18 values; 15 positions -> 270 confidence features, in draft order). Then the drafter's final hidden
state at each position through a fixed, seeded projection to `hidden_proj_dim` values (the matrix is a
function of the spec and the drafter width, and is stored in traces and artifacts), then the batch
context: live batch size, the request's context length and decode step, how many earlier steps it has,
and its last `history` accepted counts (most recent first, 0 where missing). From `dscale-features-v2` on, the
row ends with the request's sampling setup: its temperature (0 when greedy) and whether its drafts are sampled
(1 for the `sampled` rule, 0 for greedy and the `top1` rule), so one predictor serves greedy and sampled traffic.
From `dscale-features-v3` on, the row then ends with the drafts' agreement with the request's own recent tokens
(`agreement_features`, over the last `agreement_window` tokens of its context, anchor included): per draft position
the length (up to `agreement_ngram`) of the longest run ending at that draft that already occurs in the window, then
prompt lookup's verdict (the tokens that followed the latest earlier occurrence of the context's last 1..
`agreement_lookup` tokens, the longest found): how many leading drafts equal them, and per position whether it does.
The confidence columns are computed in `dscale_runtime.kernels.features` (the reference beside its Triton
kernel); this module lays out the whole row. The runtime computes whichever version an artifact was trained on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

# NOTE: re-exported: the collector, the trainer and the benchmarks read the feature definition from here.
from dscale_runtime.kernels.features import confidence_features, confidence_features_ref

__all__ = ["AGREEMENT_VERSIONS", "FEATURE_VERSION", "FEATURE_VERSION_DFLASH2", "FEATURE_VERSIONS", "FeatureSpec",
           "acceptance_features", "agreement_features",
           "confidence_features", "confidence_features_ref", "context_features", "drafter_feature_spec",
           "hidden_projection", "same_drafter_family", "sampling_features"]

FEATURE_VERSION = "dscale-features-v3"
"""The version the collector writes by default over a DFlash 1 drafter."""
# NOTE: DFlash 2 drafters: the same layout, but the confidence columns read the candidate selector's scores along
# the walked path ([N, W-1, K]: top score, its gaps, log q(best) at T = 1, the entropy over the candidates), not
# the drafter's logits over the vocabulary. Another meaning, so another family of versions: a predictor reads one.
# Within the family the columns follow DFlash 1's versions: dflash2-v2 adds the sampling columns, dflash2-v3 the
# agreement columns (which read the drafted tokens only, so they mean the same over either drafter).
FEATURE_VERSION_DFLASH2 = "dscale-features-dflash2-v3"
"""The version the collector writes by default over a DFlash 2 drafter."""
# NOTE: version -> sampling columns; v1 rows end with the batch context (artifacts trained on them still load).
FEATURE_VERSIONS = {"dscale-features-v1": 0, "dscale-features-v2": 2, "dscale-features-v3": 2,
                    "dscale-features-dflash2-v1": 0, "dscale-features-dflash2-v2": 2, "dscale-features-dflash2-v3": 2}
# versions whose rows end with `agreement_features`' columns
AGREEMENT_VERSIONS = ("dscale-features-v3", "dscale-features-dflash2-v3")
SAMPLING_NAMES = ("temperature", "sampled_drafts")


def same_drafter_family(a: str, b: str) -> bool:
    """Whether two feature versions read the same drafter signals (DFlash 1 logits, or DFlash 2 selector scores)."""
    return ("dflash2" in a) == ("dflash2" in b)


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
    agreement_window: int = 128
    """v3: the request's most recent tokens (anchor included) its drafts are matched against."""
    agreement_ngram: int = 8
    """v3: the longest run ending at a draft that is looked for in the window."""
    agreement_lookup: int = 4
    """v3: the longest context suffix prompt lookup matches."""

    def __post_init__(self) -> None:
        if self.version not in FEATURE_VERSIONS:
            raise ValueError(f"feature spec version '{self.version}' is not one this runtime computes "
                             f"({', '.join(FEATURE_VERSIONS)}); retrain the predictor on traces of a known version")

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
    def num_sampling(self) -> int:
        return FEATURE_VERSIONS[self.version]

    @property
    def num_agreement(self) -> int:
        """Agreement columns (v3): a run length per position, the lookup's leading run, a lookup flag per position."""
        return 2 * self.num_positions + 1 if self.version in AGREEMENT_VERSIONS else 0

    @property
    def width(self) -> int:
        return self.num_confidence + self.num_hidden + self.num_context + self.num_sampling + self.num_agreement

    @property
    def temperature_column(self) -> int | None:
        """Index of the temperature column (None before v2)."""
        return self.num_confidence + self.num_hidden + self.num_context if self.num_sampling else None

    def names(self) -> list[str]:
        per = ["top1_logit"] + [f"gap_{r}" for r in range(2, self.num_ranks + 1)] + ["top1_logprob", "entropy"]
        names = [f"pos{j}_{n}" for j in range(1, self.num_positions + 1) for n in per]
        names += [f"pos{j}_hidden{h}" for j in range(1, self.num_positions + 1) for h in range(self.hidden_proj_dim)]
        names += ["num_live", "context_len", "decode_step", "history_len"]
        names += [f"prev_accepted_{i}" for i in range(1, self.history + 1)]
        names += list(SAMPLING_NAMES[: self.num_sampling])
        if self.num_agreement:
            names += [f"pos{j}_ngram" for j in range(1, self.num_positions + 1)] + ["lookup_run"]
            names += [f"pos{j}_lookup" for j in range(1, self.num_positions + 1)]
        return names

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureSpec":
        return cls(**d)

    @classmethod
    def legacy(cls, **kwargs) -> "FeatureSpec":
        """The v1 layout (no sampling columns), e.g. for a predictor of one temperature band."""
        return cls(version="dscale-features-v1", **kwargs)


def drafter_feature_spec(drafter_config) -> FeatureSpec:
    """The spec a drafter's steps compute (a `DFlashConfig`): v1 over a DFlash 1 drafter's logits, the DFlash 2
    version over its selector's scores; one position per draft slot (W - 1). The collector, the trainer (from
    the traces' manifest) and the runtime all take it from here."""
    version = FEATURE_VERSION if drafter_config.dflash2 is None else FEATURE_VERSION_DFLASH2
    return FeatureSpec(version=version, num_positions=drafter_config.block_size - 1)


def hidden_projection(spec: FeatureSpec, hidden_size: int) -> torch.Tensor:
    """The fixed projection [hidden_size, hidden_proj_dim] (seeded, CPU-generated, so identical everywhere)."""
    gen = torch.Generator().manual_seed(spec.proj_seed)
    return torch.randn(hidden_size, spec.hidden_proj_dim, generator=gen) / hidden_size**0.5


def context_features(spec: FeatureSpec, num_live: int, context_lens: list[int], decode_steps: list[int],
                     recent_accepted: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Batch context [N, 4 + history] built on the host from request state (one small copy per step)."""
    rows = []
    for ctx, step, recent in zip(context_lens, decode_steps, recent_accepted):
        last = list(reversed(recent[-spec.history :]))
        rows.append([num_live, ctx, step, len(last)] + last + [0] * (spec.history - len(last)))
    return torch.tensor(rows, dtype=torch.float32, device=device).view(len(rows), spec.num_context)


def sampling_features(spec: FeatureSpec, temperature: torch.Tensor, sampled_drafts: torch.Tensor) -> torch.Tensor:
    """The sampling columns [N, num_sampling]: temperature [N] (0 for greedy rows) and sampled_drafts [N] (bool)."""
    cols = torch.stack([temperature.float(), sampled_drafts.float()], dim=-1)  # [N, 2]
    return cols[:, : spec.num_sampling]


def acceptance_features(
    spec: FeatureSpec,
    draft_logits: torch.Tensor,  # [N, P, V] drafter logits at draft positions 1..P
    draft_hidden: torch.Tensor,  # [N, P, d] drafter final (normed) hidden states at those positions
    projection: torch.Tensor,  # [d, hidden_proj_dim]
    context: torch.Tensor,  # [N, num_context] from context_features
    backend: str = "auto",
    sampling: torch.Tensor | None = None,  # [N, num_sampling] from sampling_features (v2 and later)
    agreement: torch.Tensor | None = None,  # [N, num_agreement] from agreement_features (v3)
) -> torch.Tensor:  # [N, spec.width] float32
    """One feature row per request in `spec`'s layout. `backend` is the confidence features' path: the runner
    passes its KernelChoice's `features` (chosen once); 'auto' applies the auto rule to the logits (the
    portable reference on CPU, the Triton kernel on CUDA when triton is importable)."""
    assert draft_logits.shape[1] == spec.num_positions, "feature spec and block size disagree"
    hidden = (draft_hidden.float() @ projection.to(draft_hidden.device, torch.float32)).flatten(1)
    parts = [confidence_features(draft_logits, spec.num_ranks, backend), hidden, context]
    if spec.num_sampling:
        assert sampling is not None and sampling.shape[-1] == spec.num_sampling, "the spec wants sampling columns"
        parts.append(sampling.to(context.device, torch.float32))
    if spec.num_agreement:
        assert agreement is not None and agreement.shape[-1] == spec.num_agreement, "the spec wants agreement columns"
        parts.append(agreement.to(context.device, torch.float32))
    return torch.cat(parts, dim=-1)


def agreement_features(spec: FeatureSpec, window: torch.Tensor, valid: torch.Tensor,
                       block: torch.Tensor) -> torch.Tensor:
    """The v3 agreement columns [N, 2P + 1] float32 of each request's block against its recent tokens: a fixed-shape
    tensor function (captured with the step; no host reads).

    window [N, R] int64: the tokens at positions ctx - R + 1 .. ctx (the last is the anchor), valid [N, R] bool
    (False before the sequence's start); block [N, W]: the anchor and the P = W - 1 drafts. Columns: per draft j the
    longest L <= `agreement_ngram` such that the L tokens ending at draft j (context, anchor, drafts 1..j) occur
    contiguously in the window; then prompt lookup: the latest position e < ctx where the longest suffix (1..
    `agreement_lookup` tokens, ending at the anchor) also ends, the tokens after e compared with the drafts: the
    leading run of equal ones, and per position whether it is equal (0 where no suffix recurs)."""
    n, r = window.shape
    p_count, ngram = block.shape[1] - 1, spec.agreement_ngram
    back = ngram - 2  # context tokens before the anchor that an n-gram ending at draft 1 reaches
    assert 0 <= spec.agreement_lookup - 1 <= back and r > back
    q = torch.cat([window[:, r - 1 - back :], block[:, 1:]], dim=1)  # [N, K]: k = -back..P, 0 = the anchor
    q_valid = torch.cat([valid[:, r - 1 - back :], torch.ones_like(block[:, 1:], dtype=torch.bool)], dim=1)
    e = (window[:, None, :] == q[:, :, None]) & valid[:, None, :] & q_valid[:, :, None]  # [N, K, R]
    # NOTE: every span at once (a few launches, not a few per span): e padded on the left by `ngram` columns, so
    # window position p - i is column p - i + ngram (False before the window); g[:, i, j, p] = e[k(j) - i, p - i].
    e = torch.nn.functional.pad(e, (ngram, 0))
    device, shifts = window.device, torch.arange(ngram, device=window.device)
    where = torch.arange(r, device=device)
    columns = where[None, :] - shifts[:, None] + ngram  # [L, R]
    draft_rows = back + 1 + torch.arange(p_count, device=device)[None, :] - shifts[:, None]  # [L, P] q index - i
    runs = e[:, draft_rows[:, :, None], columns[:, None, :]].int().cumprod(dim=1)  # [N, L, P, R]: span i + 1 ends at p
    length = runs.amax(dim=-1).sum(dim=1)  # [N, P] the longest span found (every shorter one is found too)
    lookup = spec.agreement_lookup
    suffix = e[:, (back - shifts[:lookup])[:, None], columns[:lookup]].int().cumprod(dim=1)  # [N, Lk, R]
    found = torch.where((suffix > 0) & (where < r - 1), where, -1).amax(dim=-1)  # [N, Lk] latest end before the anchor
    longest = ((found >= 0) * (shifts[:lookup] + 1)).argmax(dim=1, keepdim=True)  # the longest suffix that recurs
    latest = found.gather(1, longest)[:, 0]  # -1 where none does
    after = latest[:, None] + torch.arange(1, p_count + 1, device=window.device)  # [N, P]
    follows = window.gather(1, after.clamp(max=r - 1))
    equal = (latest[:, None] >= 0) & (after <= r - 1) & (follows == block[:, 1:])
    flags = equal.float()
    return torch.cat([length.float(), flags.cumprod(dim=1).sum(dim=1, keepdim=True), flags], dim=1)
