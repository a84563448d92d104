"""Verify-step unit tables (DESIGN 3.5): accept none / some / all, the successor's row, packed layouts; both
sampling rules exact in distribution against the target's own probabilities (chi-square)."""

import pytest
import torch
from scipy.stats import chisquare

from dscale_runtime.sampling import Policy, sample_inverse_cdf
from dscale_runtime.verify import accept_greedy, accept_sampled_drafts

W = 5


def _case(drafts, target_rows, lens):
    """drafts: per request [anchor, d1..d4]; target_rows: flat argmax of the packed rows."""
    draft_tokens = torch.tensor(drafts)
    verify_lens = torch.tensor(lens)
    offsets = torch.cumsum(verify_lens, 0) - verify_lens
    return accept_greedy(torch.tensor(target_rows), draft_tokens, verify_lens, offsets)


def test_accept_none_some_all_full_width():
    drafts = [
        [9, 1, 2, 3, 4],  # target says 7 after the anchor: nothing accepted, successor 7
        [9, 1, 2, 3, 4],  # first two match, third differs: 2 accepted, successor = row 2's 8
        [9, 1, 2, 3, 4],  # all four match: successor from the last row
    ]
    target = [7, 2, 3, 4, 5] + [1, 2, 8, 4, 5] + [1, 2, 3, 4, 6]
    accepted, successor = _case(drafts, target, [W, W, W])
    assert accepted.tolist() == [0, 2, 4]
    assert successor.tolist() == [7, 8, 6]


def test_prefix_lengths_bound_acceptance_and_pick_successor_row():
    drafts = [[9, 1, 2, 3, 4], [9, 1, 2, 3, 4], [9, 1, 2, 3, 4]]
    # k = 1 (anchor only), k = 3, k = 2 packed back to back: rows 0 | 1..3 | 4..5
    target = [1] + [1, 2, 3] + [1, 7]
    accepted, successor = _case(drafts, target, [1, 3, 2])
    # k=1: no draft is verified even though row 0 would match d1; successor is row 0.
    # k=3: d1, d2 verified and both match; successor is row offset+2 = 3.
    # k=2: d1 verified and matches; successor row offset+1 = 5 -> 7.
    assert accepted.tolist() == [0, 2, 1]
    assert successor.tolist() == [1, 3, 7]


def test_mismatch_after_first_rejection_does_not_count():
    accepted, successor = _case([[0, 1, 2, 3, 4]], [1, 9, 3, 4, 5], [W])
    assert accepted.tolist() == [1]  # d3, d4 match again but come after the rejection
    assert successor.tolist() == [9]


def test_sampled_drafts_deterministic_cases():
    # q == p one-hot on the draft: always accepted; the all-pass successor is the last row's target token.
    vocab = 6
    p = torch.nn.functional.one_hot(torch.tensor([1, 2, 3]), vocab).float()  # rows judge d1, d2, then successor
    q = p[:2][None]  # [1, 2, V]
    drafts = torch.tensor([[0, 1, 2]])
    p, q = Policy.dense(p), Policy.dense(q[0])
    acc, succ = accept_sampled_drafts(p, q, drafts, torch.tensor([1, 2, 3]), torch.tensor([3]), torch.tensor([0]),
                                      torch.rand(1, 2, dtype=torch.float64), torch.rand(1, dtype=torch.float64))
    assert acc.tolist() == [2] and succ.tolist() == [3]
    # p puts no mass on d1: rejected at once; the residual max(0, p - q) is p's row, token 1... here token 4.
    p0 = torch.nn.functional.one_hot(torch.tensor([4, 2, 3]), vocab).float()
    acc, succ = accept_sampled_drafts(Policy.dense(p0), q, drafts, torch.tensor([4, 2, 3]), torch.tensor([3]), torch.tensor([0]),
                                      torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert acc.tolist() == [0] and succ.tolist() == [4]
    # k = 1 verifies no draft: the successor is row 0's target token, whatever the coins.
    acc, succ = accept_sampled_drafts(p, q, drafts, torch.tensor([1, 2, 3]), torch.tensor([1]), torch.tensor([0]),
                                      torch.zeros(1, 2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert acc.tolist() == [0] and succ.tolist() == [1]


def _fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of counts [V] against probs [V] (cells of mass 0 must be empty)."""
    assert counts[probs == 0].sum() == 0, "a token of probability 0 was produced"
    keep = probs > 0
    observed, probs = counts[keep].double().numpy(), probs[keep].double().numpy()
    return chisquare(observed, probs / probs.sum() * observed.sum()).pvalue


@pytest.mark.parametrize("rule", ["top1", "sampled"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_both_rules_keep_the_target_distribution(rule, k):
    """Two output tokens of a 3-slot block with fixed per-row distributions p0, p1 (a model whose next-token law
    does not depend on the previous token): the first committed token must follow p0 whatever k, and the second
    (produced when the first draft was accepted) must follow p1."""
    gen = torch.Generator().manual_seed(k + 10 * (rule == "sampled"))
    vocab, trials = 7, 60000
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)
    p[0, 5] = 0.0  # a token the target never emits
    p[0] /= p[0].sum()
    q = torch.softmax((p[:2] + 1e-3).log() + torch.randn(2, vocab, generator=gen), -1)  # a drafter close to p
    u = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    lens = torch.full((trials,), k)
    offsets = torch.arange(trials) * k
    rows = torch.cat([p[:k]] * trials)  # [trials * k, V] packed rows of every trial
    target = sample_inverse_cdf(rows, u(trials * k))
    if rule == "top1":
        drafts = torch.cat([torch.zeros(trials, 1, dtype=torch.long), q.argmax(-1).expand(trials, 2)], dim=1)
        acc, succ = accept_greedy(target, drafts, lens, offsets)
    else:
        drawn = sample_inverse_cdf(q.repeat(trials, 1), u(trials * 2)).view(trials, 2)
        drafts = torch.cat([torch.zeros(trials, 1, dtype=torch.long), drawn], dim=1)
        acc, succ = accept_sampled_drafts(Policy.dense(rows), Policy.dense(q.repeat(trials, 1)), drafts, target,
                                          lens, offsets,
                                          u(trials, 2), u(trials))
    first = torch.where(acc >= 1, drafts[:, 1], succ)
    assert _fit(torch.bincount(first, minlength=vocab), p[0]) > 1e-3
    if k >= 2:
        accepted = acc >= 1
        assert accepted.sum() > 2000, "drafts must be accepted for the second token to be tested"
        second = torch.where(acc[accepted] >= 2, drafts[accepted, 2], succ[accepted])
        assert _fit(torch.bincount(second, minlength=vocab), p[1]) > 1e-3
    else:
        assert (acc == 0).all()


def test_sampled_drafts_with_a_sparse_candidate_q_keep_the_target_distribution(k=3):
    """DFlash 2's q lives on a few candidates per slot (`CandidatePolicy`): drafts drawn from it, the residual
    max(p - q scattered, 0) after a rejection, and the committed tokens still follow p0 (and p1 after an
    accepted first draft), including tokens outside the candidates."""
    from dscale_runtime.verify import CandidatePolicy

    gen = torch.Generator().manual_seed(20 + k)
    vocab, trials, top = 7, 30000, 3
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:top] for _ in range(2)])  # [2 slots, 3]
    probs = torch.softmax(torch.randn(2, top, generator=gen, dtype=torch.float64), -1)
    u = lambda *shape: torch.rand(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    lens, offsets = torch.full((trials,), k), torch.arange(trials) * k
    rows = torch.cat([p[:k]] * trials)
    target = sample_inverse_cdf(rows, u(trials * k))
    q = CandidatePolicy(probs.repeat(trials, 1), tokens.repeat(trials, 1))
    index = sample_inverse_cdf(probs.repeat(trials, 1), u(trials * 2)).view(trials, 2)
    drawn = tokens[torch.arange(2)[None, :].expand(trials, 2), index]
    drafts = torch.cat([torch.zeros(trials, 1, dtype=torch.long), drawn], dim=1)
    acc, succ = accept_sampled_drafts(Policy.dense(rows), q, drafts, target, lens, offsets, u(trials, 2), u(trials))
    first = torch.where(acc >= 1, drafts[:, 1], succ)
    assert _fit(torch.bincount(first, minlength=vocab), p[0]) > 1e-3
    outside = ~torch.isin(first, tokens[0])
    assert outside.sum() > 1000, "tokens outside the candidates must come from the residual"
    accepted = acc >= 1
    assert accepted.sum() > 2000
    second = torch.where(acc[accepted] >= 2, drafts[accepted, 2], succ[accepted])
    assert _fit(torch.bincount(second, minlength=vocab), p[1]) > 1e-3
