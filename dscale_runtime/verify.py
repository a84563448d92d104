"""Prefix verifier on the packed layout (DESIGN 3.5): accepted drafts and the successor of each request.

Request i owns rows [verify_offsets[i], verify_offsets[i] + verify_lens[i]) of the target output; row
offset_i + s holds the target's prediction after slot s. Slot 0 is the anchor, slots 1..W-1 the drafts.
DFlash is the case verify_lens == W for all; target-only decoding is W == 1; DScale packs variable k_i.

Two exact rules:
- top-1 drafts (the paper's rule): each row's target token is the target's own choice at that position
  (argmax when greedy; when sampling, the inverse-CDF draw `sampling.target_tokens` keys by seed and
  position); drafts are accepted while they equal it and the successor is the first differing row's token.
  A top-1 draft x is then accepted with probability P(x), and on rejection the successor is P conditioned on
  "not x": the paper's rule, realised as a coupling under which a seeded request yields exactly the tokens
  of target-only sampling, whatever its prefix lengths.
- sampled drafts (Leviathan et al. / Chen et al.; z-lab's reference): drafts drawn from the drafter's policy
  q, accepted with probability min(1, p(x) / q(x)); the successor after the first rejection comes from
  max(0, p - q) renormalised, and from the last row's p when every verified draft passed (`accept_sampled_drafts`).
  q is a dense policy over the vocabulary (DFlash 1) or a sparse one over a few candidates per slot
  (`CandidatePolicy`: DFlash 2's selector), scattered into the vocabulary for the residual.
Prefix lengths never read the draws, so both rules keep the target's distribution at any budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dscale_runtime.kernels.sampling import _SECOND_KEY, purpose_key
from dscale_runtime.sampling import COIN, RESIDUAL, Policy, SamplingRows, _resolved, sample_inverse_cdf


@dataclass
class CandidatePolicy:
    """A draft policy over K candidates per row (DFlash 2's selector q), every other token at probability 0."""

    probs: torch.Tensor  # [R, K] float64, each row sums to 1
    tokens: torch.Tensor  # [R, K] int64 distinct token ids of each row

    def probs_at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """float64 q of tokens `cols` at rows `rows` (index tensors of one shape)."""
        return (self.probs[rows] * (self.tokens[rows] == cols[..., None])).sum(-1)

    def row_probs(self, rows: torch.Tensor, vocab: int) -> torch.Tensor:
        """float64 q [n, V] of rows `rows` [n], scattered into the vocabulary."""
        dense = torch.zeros(rows.shape[0], vocab, dtype=torch.float64, device=rows.device)
        return dense.scatter_(1, self.tokens[rows], self.probs[rows])


def _draft_rows(draft_tokens: torch.Tensor, verify_lens: torch.Tensor, verify_offsets: torch.Tensor, num_rows: int):
    """Row that judges each draft slot j = 1..W-1, and whether that slot is verified at all."""
    slots = torch.arange(1, draft_tokens.shape[1], device=draft_tokens.device)  # [W-1]
    rows = (verify_offsets[:, None] + slots[None, :] - 1).clamp(0, max(num_rows - 1, 0))  # [N, W-1]
    verified = slots[None, :] < verify_lens[:, None]  # [N, W-1]
    return rows, verified


def accept_greedy(
    target_tokens: torch.Tensor,  # [M] the target's token of every verification row (argmax or keyed draw)
    draft_tokens: torch.Tensor,  # [N, W] slot 0 = anchor, 1..W-1 = drafts
    verify_lens: torch.Tensor,  # [N] k_i >= 1
    verify_offsets: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted_lens [N] (0..k_i-1), successor [N]
    """The top-1 rule: drafts accepted while they equal the rows' target tokens."""
    rows, verified = _draft_rows(draft_tokens, verify_lens, verify_offsets, target_tokens.shape[0])
    match = (draft_tokens[:, 1:] == target_tokens[rows]) & verified
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, target_tokens[(verify_offsets + accepted).clamp(max=max(target_tokens.shape[0] - 1, 0))]


def accept_sampled_drafts(
    target: Policy,  # p at every verification row [M, V]
    draft: Policy | CandidatePolicy,  # q at each draft slot, rows n * (W-1) + j - 1 [N * (W-1), V or K]
    draft_tokens: torch.Tensor,  # [N, W] drafts drawn from q (slot 0 = anchor)
    target_tokens: torch.Tensor,  # [M] a draw from p at every row (the successor when every draft passes)
    verify_lens: torch.Tensor,  # [N]
    verify_offsets: torch.Tensor,  # [N]
    coins: torch.Tensor,  # [N, W-1] float64 U[0, 1), independent of the drafts and of verify_lens
    residual_u: torch.Tensor,  # [N] float64 U[0, 1) for the residual draw
    backend: str = "ref",  # the residual draw's path (`sampling.sample`)
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted_lens [N], successor [N]
    """Standard speculative sampling over the packed rows (the sampled-drafts rule)."""
    n, w = draft_tokens.shape
    num_rows = target.values.shape[0]
    rows, verified = _draft_rows(draft_tokens, verify_lens, verify_offsets, num_rows)
    drafts = draft_tokens[:, 1:]  # [N, W-1]
    q_rows = torch.arange(n * (w - 1), device=drafts.device).view(n, w - 1)
    p_x = target.probs_at(rows, drafts)  # [N, W-1]
    q_x = draft.probs_at(q_rows, drafts)  # > 0: drafts come from q
    passed = (coins * q_x < p_x) & verified
    accepted = passed.long().cumprod(dim=1).sum(dim=1)
    rejected = accepted < verify_lens - 1
    succ_rows = (verify_offsets + accepted).clamp(0, max(num_rows - 1, 0))
    slot = accepted.clamp(max=w - 2)  # the rejected draft's column
    p_row = target.row_weights(succ_rows) / target.total[succ_rows, None]  # [N, V]
    q_flat = q_rows.gather(1, slot[:, None])[:, 0]
    if isinstance(draft, CandidatePolicy):
        q_row = draft.row_probs(q_flat, p_row.shape[1])
    else:
        q_row = draft.row_weights(q_flat) / draft.total[q_flat, None]
    residual = (p_row - q_row).clamp_min(0)
    # NOTE: p == q at that row makes a rejection impossible; the residual is then never used.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_row)
    from_residual = sample_inverse_cdf(residual, residual_u, backend=backend)
    return accepted, torch.where(rejected, from_residual, target_tokens[succ_rows])


def accept_rules(
    target: Policy,  # p at every verification row [M, V]
    draft: Policy | CandidatePolicy,  # q at each draft slot, rows n * (W-1) + j - 1
    draft_tokens: torch.Tensor,  # [N, W] (slot 0 = anchor): top-1 drafts, or drawn from q where the rule samples them
    target_tokens: torch.Tensor,  # [M] the rows' target tokens
    verify_lens: torch.Tensor,  # [N]
    verify_offsets: torch.Tensor,  # [N]
    rule: torch.Tensor,  # [N] each request's rule: == rule_sampled for sampled drafts, else the top-1 rule
    rule_sampled: int,
    rows: SamplingRows,  # per request: the draws' seeds, and the sampler's path (`rows.backend`)
    ctx: torch.Tensor,  # [N] context lengths: slot j's coin is keyed at ctx + j, the residual draw at ctx + 1
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted_lens [N], successor [N]
    """Each request by its own rule in one batch: `accept_greedy` where it takes top-1 drafts, `accept_sampled_drafts`
    (coins u(seed, ctx + j, COIN), residual u(seed, ctx + 1, RESIDUAL)) where it samples them. On the Triton path
    with both policies kept as logits, one launch does both, two above ROW_PROGRAM_VOCAB tokens
    (`triton_sampling.accept_rules_triton`: the same arithmetic, its sums rounded in their own order; the unfused
    step took ~100 launches)."""
    values = target.values
    if (_resolved(rows.backend, values) == "triton" and isinstance(draft, Policy) and draft.shift is not None
            and target.shift is not None and values.stride(-1) == 1 and draft.values.stride(-1) == 1):
        from dscale_runtime.kernels.triton_sampling import accept_rules_triton

        return accept_rules_triton((values, target.shift, target.inv_t, target.floor, target.total),
                                   (draft.values, draft.shift, draft.inv_t, draft.floor, draft.total), target_tokens,
                                   draft_tokens, verify_lens, verify_offsets, rule, rule_sampled, rows.seed_lo,
                                   rows.seed_hi, ctx, purpose_key(COIN), purpose_key(RESIDUAL), _SECOND_KEY)
    accepted, successor = accept_greedy(target_tokens, draft_tokens, verify_lens, verify_offsets)
    positions = ctx[:, None] + torch.arange(1, draft_tokens.shape[1], device=draft_tokens.device)
    s_acc, s_succ = accept_sampled_drafts(target, draft, draft_tokens, target_tokens, verify_lens, verify_offsets,
                                          rows.uniforms(positions, COIN), rows.uniforms(ctx + 1, RESIDUAL), rows.backend)
    use = rule == rule_sampled
    return torch.where(use, s_acc, accepted), torch.where(use, s_succ, successor)
