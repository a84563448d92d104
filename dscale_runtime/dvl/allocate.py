"""Algorithm 1: share a verification budget of M_live slots among live requests by predicted acceptance.

Seeds k0 (from the predictor) are adjusted by the gap D = M_live - sum k0: when D > 0 the D highest-scoring
next slots are added, when D < 0 the |D| lowest-scoring tail slots (never an anchor) are removed. Because
each row of scores is non-increasing, taking the |D| best (worst) candidates of one global ranking and
counting them per row is the same as growing (shrinking) each row's prefix slot by slot, and maximises the
sum of kept scores under the budget and k >= k0 (grow) or k <= k0 (shrink): equal scores are
interchangeable, so how ties fall does not change the objective. Everything is tensor work with static
shapes: no loop over requests, no host synchronisation (D stays on the device; the selection is a rank
comparison, not a top-|D|).
"""

from __future__ import annotations

import torch


def budget_rows(num_live: int, block_size: int, budget_ratio: float) -> int:
    """M_live = round(budget_ratio * W * N_live), at least one slot (the anchor) per live request."""
    rows = int(budget_ratio * block_size * num_live + 0.5)
    return max(num_live, min(rows, block_size * num_live))


def _rank(keys: torch.Tensor) -> torch.Tensor:
    """Rank of every entry of a 1-D key vector under a stable ascending sort."""
    order = torch.sort(keys, stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=keys.device))


def allocate(
    scores: torch.Tensor,  # [N, W-1] non-increasing along dim 1; s[i, j-1] scores draft slot j
    seeds: torch.Tensor,  # [N] int64 in [1, W]
    live: torch.Tensor,  # [N] bool; inactive rows (graph padding) get k = 0
    budget: int | torch.Tensor,  # M_live, N_live <= M_live <= W * N_live
) -> torch.Tensor:  # [N] int64 verify lengths k (anchor included)
    n, p = scores.shape
    w = p + 1
    device = scores.device
    seeds = torch.where(live, seeds, torch.zeros_like(seeds))
    gap = torch.as_tensor(budget, device=device) - seeds.sum()
    slot = torch.arange(1, w, device=device)  # draft slot j of each column
    grow = gap > 0
    # Grow: candidates are the slots j >= k0_i not yet verified; take the |D| highest scores.
    # Shrink: candidates are the verified drafts 1 <= j < k0_i; drop the |D| lowest scores.
    # NOTE: only one of the two applies (the sign of D, on the device): one ranking serves both.
    candidate = live[:, None] & torch.where(grow, slot[None, :] >= seeds[:, None], slot[None, :] < seeds[:, None])
    keys = torch.where(candidate, torch.where(grow, -scores.float(), scores.float()), torch.inf).reshape(-1)
    chosen = ((_rank(keys) < gap.abs()) & candidate.reshape(-1)).view(n, p).sum(1)
    return seeds + torch.where(grow, chosen, -chosen)
