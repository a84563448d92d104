"""Verify-step unit tables (DESIGN 3.5): accept none / some / all, the successor's row, packed layouts."""

import torch

from dscale_runtime.verify import accept_greedy, accept_sampling

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


def _one_hot(tokens, vocab=6):
    return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).float()


def test_sampling_with_deterministic_policy_equals_greedy():
    drafts = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    rows = [1, 2, 5, 4, 5] + [1, 2, 3, 4, 0]
    lens = torch.tensor([W, W])
    offsets = torch.tensor([0, W])
    coins = torch.rand(2, W - 1)
    acc, succ = accept_sampling(_one_hot(rows), drafts, lens, offsets, coins, lambda p: p.argmax(-1))
    g_acc, g_succ = accept_greedy(torch.tensor(rows), drafts, lens, offsets)
    assert acc.tolist() == g_acc.tolist() == [2, 4]
    assert succ.tolist() == g_succ.tolist() == [5, 0]


def test_sampling_rejection_removes_the_rejected_draft():
    # P at the row judging d1 is 0.5 on the draft token 1 and 0.5 on token 3; a coin above 0.5 rejects d1 and
    # the successor must come from P without token 1, i.e. token 3 with certainty.
    probs = torch.zeros(2, 6)
    probs[0, 1] = probs[0, 3] = 0.5
    probs[1, 2] = 1.0
    drafts = torch.tensor([[0, 1]])
    seen = []
    acc, succ = accept_sampling(probs, drafts, torch.tensor([2]), torch.tensor([0]), torch.tensor([[0.9]]),
                                lambda p: (seen.append(p.clone()), p.argmax(-1))[1])
    assert acc.tolist() == [0] and succ.tolist() == [3]
    assert torch.allclose(seen[0][0], torch.tensor([0, 0, 0, 1.0, 0, 0]))
    # The same draft with a coin below 0.5 is accepted and the successor comes from the unmodified last row.
    acc, succ = accept_sampling(probs, drafts, torch.tensor([2]), torch.tensor([0]), torch.tensor([[0.1]]),
                                lambda p: p.argmax(-1))
    assert acc.tolist() == [1] and succ.tolist() == [2]
