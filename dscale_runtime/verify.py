"""Prefix verifier on the packed layout (DESIGN 3.5): accepted drafts and the successor of each request.

Request i owns rows [verify_offsets[i], verify_offsets[i] + verify_lens[i]) of the target output; row
offset_i + s holds the target's prediction after slot s. Slot 0 is the anchor, slots 1..W-1 the drafts.
DFlash is the case verify_lens == W for all; target-only decoding is W == 1; DScale packs variable k_i.
"""

from __future__ import annotations

import torch


def _draft_rows(draft_tokens: torch.Tensor, verify_lens: torch.Tensor, verify_offsets: torch.Tensor, num_rows: int):
    """Row that judges each draft slot j = 1..W-1, and whether that slot is verified at all."""
    slots = torch.arange(1, draft_tokens.shape[1], device=draft_tokens.device)  # [W-1]
    rows = (verify_offsets[:, None] + slots[None, :] - 1).clamp(0, max(num_rows - 1, 0))  # [N, W-1]
    verified = slots[None, :] < verify_lens[:, None]  # [N, W-1]
    return rows, verified


def accept_greedy(
    target_tokens: torch.Tensor,  # [M] argmax of every verification row
    draft_tokens: torch.Tensor,  # [N, W] slot 0 = anchor, 1..W-1 = drafts
    verify_lens: torch.Tensor,  # [N] k_i >= 1
    verify_offsets: torch.Tensor,  # [N]
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted_lens [N] (0..k_i-1), successor [N]
    rows, verified = _draft_rows(draft_tokens, verify_lens, verify_offsets, target_tokens.shape[0])
    match = (draft_tokens[:, 1:] == target_tokens[rows]) & verified
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    return accepted, target_tokens[verify_offsets + accepted]


def accept_sampling(
    probs: torch.Tensor,  # [M, V] target policy distribution of every verification row
    draft_tokens: torch.Tensor,  # [N, W]
    verify_lens: torch.Tensor,  # [N]
    verify_offsets: torch.Tensor,  # [N]
    coins: torch.Tensor,  # [N, W-1] U[0,1), drawn independently of how verify_lens were chosen
    draw,  # callable: probs [N, V] -> tokens [N]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft x at a slot is accepted with probability P(x); at the first rejection the successor comes from
    P with x removed and renormalised; if every verified draft passes, from the unmodified P."""
    rows, verified = _draft_rows(draft_tokens, verify_lens, verify_offsets, probs.shape[0])
    p_draft = probs[rows, draft_tokens[:, 1:]]  # [N, W-1]
    passed = (coins < p_draft) & verified
    accepted = passed.long().cumprod(dim=1).sum(dim=1)
    residual = probs[verify_offsets + accepted].clone()  # [N, V]
    rejected = accepted < verify_lens - 1
    rejected_token = draft_tokens.gather(1, (accepted + 1).clamp(max=draft_tokens.shape[1] - 1)[:, None])
    kept = residual.gather(1, rejected_token)
    residual.scatter_(1, rejected_token, torch.where(rejected[:, None], torch.zeros_like(kept), kept))
    residual = residual / residual.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return accepted, draw(residual)
