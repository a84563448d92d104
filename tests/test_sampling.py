"""Sampling inside the step runner (issue 15): keyed draws, the policy, and both acceptance rules end to end.

Oracles: the exact probabilities of the target's sampled continuations (transformers' Qwen3 on the checkpoint,
our policy on its logits) for a chi-square goodness-of-fit of every rule, mode and budget; target-only seeded
sampling for the top-1 rule, whose seeded output must equal it token for token whatever the batch and budget.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.engine import Engine
from dscale_runtime.runner import RULE_GREEDY, RULE_SAMPLED, RULE_TOP1
from dscale_runtime.sampling import (
    Policy,
    SamplingRows,
    keyed_uniforms,
    policy_probs,
    policy_probs_ref,
    make_policy,
    sample,
    sample_inverse_cdf,
    sample_inverse_cdf_ref,
    split_seed,
    target_tokens,
)
from test_engine import pair, prompt_set, small_vocab_pair  # noqa: F401 (fixtures)
from test_engine_dscale import save_predictor


# ---------------------------------------------------------------------------------------------- keyed draws
def test_keyed_uniforms_are_uniform_independent_and_pure():
    n = 200_000
    pos = torch.arange(n)
    lo, hi = torch.full((n,), 12345), torch.full((n,), 7)
    u = keyed_uniforms(lo, hi, pos, 1)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert kstest(u.numpy(), "uniform").pvalue > 1e-3
    assert torch.equal(u, keyed_uniforms(lo, hi, pos, 1))  # a pure function of the key
    others = [keyed_uniforms(lo, hi, pos, 2), keyed_uniforms(lo + 1, hi, pos, 1), keyed_uniforms(lo, hi + 1, pos, 1)]
    for v in others:  # another purpose or seed: another stream
        assert abs(np.corrcoef(u.numpy(), v.numpy())[0, 1]) < 0.01
        assert kstest(v.numpy(), "uniform").pvalue > 1e-3
    # neighbouring positions are not correlated either
    assert abs(np.corrcoef(u[:-1].numpy(), u[1:].numpy())[0, 1]) < 0.01


def test_split_seed_covers_64_bits_and_names_the_range():
    assert split_seed(0) == (0, 0) and split_seed(2**64 - 1) == (2**32 - 1, 2**32 - 1)
    assert split_seed(2**32 + 5) == (5, 1)
    with pytest.raises(ValueError, match=r"\[0, 2\^64\)"):
        split_seed(2**64)


def test_inverse_cdf_never_draws_a_zero_probability_token_and_follows_the_distribution():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.2, 0.0, 0.3, 0.5, 0.0]])
    edge = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)
    for u in edge:
        tokens = sample_inverse_cdf(probs, u.repeat(2))
        assert (probs[torch.arange(2), tokens] > 0).all()
    u = torch.rand(100_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tokens = sample_inverse_cdf(probs[1:].expand(100_000, -1), u)
    counts = torch.bincount(tokens, minlength=5).double().numpy()
    assert counts[1] == counts[4] == 0
    assert chisquare(counts[[0, 2, 3]], np.array([0.2, 0.3, 0.5]) * 100_000).pvalue > 1e-3


@pytest.mark.parametrize("vocab,chunk", [(1000, 64), (1024, 256), (37, 8)])
def test_two_level_inverse_cdf_equals_the_one_scan_reference(vocab, chunk):
    gen = torch.Generator().manual_seed(vocab)
    weights = torch.rand(400, vocab, generator=gen) ** 4 * 3.0
    weights[:, ::7] = 0.0  # zero-weight tokens, whole zero chunks too
    weights[0, : vocab - 1] = 0.0  # all mass on the last token
    weights[1, 1:], weights[1, 0] = 0.0, 1.0  # all mass on the first
    u = torch.rand(400, generator=gen, dtype=torch.float64)
    u[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 1 - 2**-53], dtype=torch.float64)
    got, want = sample_inverse_cdf(weights, u, chunk=chunk), sample_inverse_cdf_ref(weights, u)
    assert (weights[torch.arange(400), got] > 0).all()
    assert (got == want).float().mean() > 0.99  # equal up to float rounding at a boundary
    assert got[0] == vocab - 1 and got[1] == 0


@pytest.mark.parametrize("filtered", [False, True])
def test_a_policy_kept_as_logits_is_the_policy(filtered):
    """make_policy's weights are policy_probs up to a row factor, and sampling it follows policy_probs."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 3000, generator=gen) * 3).to(torch.bfloat16)
    rows = SamplingRows(torch.zeros(6, dtype=torch.bool), torch.tensor([0.3, 0.7, 1.0, 1.5, 1.0, 2.0]),
                        torch.tensor([-1, -1, 50, -1, -1, -1]), torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0]),
                        torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.long))
    policy = make_policy(logits, rows, filtered)
    want = policy_probs(logits, rows, filtered).double()
    every = torch.arange(3000)
    got = torch.stack([policy.probs_at(torch.full((3000,), i), every) for i in range(6)])
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(policy.row_weights(torch.arange(6)) / policy.total[:, None], want, atol=1e-6)
    u = torch.rand(6, 20000, generator=gen, dtype=torch.float64)
    draws = torch.stack([sample(policy, u[:, i]) for i in range(200)], dim=1)  # [6, 200] through the chunks
    assert (want.gather(1, draws) > 0).all()
    ref = torch.stack([sample_inverse_cdf_ref(want, u[:, i]) for i in range(200)], dim=1)
    assert (draws == ref).float().mean() > 0.99


needs_triton = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None,
                                  reason="triton is not installed")


@pytest.fixture
def kernel_device() -> str:
    """Where the sampler's Triton kernels run: CUDA, or the CPU through Triton's interpreter (else skip)."""
    from dscale_runtime.kernels import triton_sampling

    if torch.cuda.is_available():
        return "cuda"
    if not triton_sampling.interpreted():
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    return "cpu"


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
def test_chunk_sums_kernel_equals_its_reference(kernel_device):
    from dscale_runtime.kernels.sampling import chunk_exp_sums, chunk_exp_sums_ref

    device = kernel_device
    gen = torch.Generator().manual_seed(2)
    for dtype, vocab in ((torch.float32, 5000), (torch.bfloat16, 1024), (torch.float16, 777), (torch.bfloat16, 151936)):
        logits = (torch.randn(5, vocab, generator=gen) * 4).to(dtype).to(device)
        shift = logits.float().amax(-1)
        inv_t = torch.tensor([1.0, 2.0, 0.5, 1.3, 10.0], device=device)
        want = chunk_exp_sums_ref(logits, shift, inv_t, 256)
        got = chunk_exp_sums(logits, shift, inv_t, 256, backend="triton")
        assert got.shape == want.shape == (5, -(-vocab // 256))
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-30)


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
def test_keyed_uniforms_kernel_equals_its_reference_bit_for_bit(kernel_device):
    from dscale_runtime.kernels.sampling import keyed_uniforms_ref

    device = kernel_device
    gen = torch.Generator().manual_seed(3)
    lo = torch.cat([torch.randint(0, 2**32, (37,), generator=gen), torch.tensor([0, 2**32 - 1])]).to(device)
    hi = torch.cat([torch.randint(0, 2**32, (37,), generator=gen), torch.tensor([2**32 - 1, 0])]).to(device)
    positions = torch.randint(0, 2**45, (39, 15), generator=gen).to(device)  # past 2^32: the low 32 bits key
    for purpose in (1, 2, 3, 4):
        want = keyed_uniforms_ref(lo[:, None], hi[:, None], positions, purpose)
        got = keyed_uniforms(lo[:, None], hi[:, None], positions, purpose, backend="triton")
        assert got.dtype == torch.float64 and torch.equal(got, want)
        flat = keyed_uniforms(lo, hi, positions[:, 0], purpose, backend="triton")
        assert torch.equal(flat, keyed_uniforms_ref(lo, hi, positions[:, 0], purpose))


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
@pytest.mark.parametrize("kept", ["logits", "dense"])
def test_sampling_kernel_draws_what_the_two_level_reference_draws(kept, kernel_device):
    device = kernel_device
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 6, 3000
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    logits[1, 1500:] = float("-inf")  # whole zero-weight chunks past the last positive one
    logits[2, ::2] = float("-inf")  # zero-weight tokens between positive ones
    sampling = SamplingRows(torch.zeros(rows, dtype=torch.bool, device=device),
                            torch.tensor([1.0, 0.7, 1.3, 0.2, 2.0, 1.0], device=device),
                            torch.full((rows,), -1, device=device), torch.ones(rows, device=device),
                            torch.zeros(rows, dtype=torch.long, device=device),
                            torch.zeros(rows, dtype=torch.long, device=device))
    policy = make_policy(logits, sampling, False, "ref", chunk=256)
    if kept == "dense":
        policy = Policy.dense(policy.row_weights(torch.arange(rows, device=device)), 256)
    u = torch.rand(rows, 120, generator=gen, dtype=torch.float64).to(device)
    u[:, 0], u[:, 1] = 0.0, 1.0 - 2**-53  # both ends of the unit interval
    want = torch.stack([sample(policy, u[:, i]) for i in range(u.shape[1])], dim=1)
    got = torch.stack([sample(policy, u[:, i], backend="triton") for i in range(u.shape[1])], dim=1)
    weights = policy.row_weights(torch.arange(rows, device=device))
    assert (weights.gather(1, got) > 0).all()  # never a zero-weight token
    assert (got == want).float().mean() > 0.99  # the same function up to the sums' rounding order


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
@pytest.mark.parametrize("dtype,vocab", [(torch.bfloat16, 4096), (torch.float32, 3000), (torch.float16, 777)])
def test_one_launch_row_tokens_draw_what_the_unfused_kernels_draw(dtype, vocab, kernel_device, monkeypatch):
    """`target_tokens` on a vocabulary of one tile (`row_tokens_triton`, one launch) == the unfused Triton path
    (max, floor, chunk sums, draws, two-level search) token for token: greedy rows' argmax (ties: the first),
    sampled rows' draws with and without top-k / top-p, rows mapped to requests by an index (clamped), and the
    policy beside it equal to the unfused one."""
    from dscale_runtime import sampling as sampling_module

    device = kernel_device
    gen = torch.Generator().manual_seed(11)
    rows, requests, draws = 10, 4, 3 if device == "cpu" else 64
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dtype)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie at the top: the first index wins
    logits[1, vocab // 2 :] = float("-inf")  # whole zero-weight chunks
    logits = logits.to(device)
    sampling = SamplingRows(torch.tensor([True, False, False, False], device=device),
                            torch.tensor([1.0, 0.7, 1.3, 0.2], device=device),
                            torch.tensor([-1, 50, 5, -1], device=device),
                            torch.tensor([1.0, 0.8, 0.9, 0.5], device=device),
                            torch.tensor([1, 2**32 - 1, 7, 123456], device=device),
                            torch.tensor([0, 5, 2**31, 99], device=device), backend="triton")
    index = torch.tensor([0, 1, 1, 2, 3, 3, 0, 2, 5, 9], device=device)  # past the last request: clamped to it
    for sampled, filtered in ((False, False), (True, False), (True, True)):
        for d in range(draws):
            positions = torch.randint(0, 2**40, (rows,), generator=gen).to(device)
            got, got_policy = target_tokens(logits, sampling, positions, filtered, sampled, index=index,
                                            max_index=requests - 1, offset=1)
            with monkeypatch.context() as m:
                m.setattr(sampling_module, "ROW_PROGRAM_VOCAB", 0)
                want, want_policy = target_tokens(logits, sampling, positions, filtered, sampled, index=index,
                                                  max_index=requests - 1, offset=1)
            assert torch.equal(got, want), (sampled, filtered, d)
            assert got[0] == 5  # greedy: the first of two maximal logits
            assert torch.equal(got[[0, 6]], logits[[0, 6]].argmax(-1))  # rows of the greedy request
            if sampled and d == 0:
                # the policy stored by the same launch (`Policy.from_rows`) == the unfused one on the sampled rows
                live = ~sampling.greedy[index.clamp(max=requests - 1)]
                assert torch.equal(got_policy.shift[live], want_policy.shift[live])
                assert torch.equal(got_policy.inv_t[live], want_policy.inv_t[live])
                assert torch.allclose(got_policy.total[live], want_policy.total[live], rtol=1e-12, atol=0)
                assert (got_policy.floor is None) == (want_policy.floor is None) == (not filtered)
                if filtered:
                    assert torch.equal(got_policy.floor[live], want_policy.floor[live])
                at = torch.arange(rows, device=device)[live]
                assert torch.allclose(got_policy.row_weights(at), want_policy.row_weights(at), rtol=1e-12, atol=0)
                assert torch.isfinite(got_policy.total).all()  # the greedy rows' placeholders
                u = torch.rand(rows, generator=gen, dtype=torch.float64).to(device)
                assert torch.equal(sample(got_policy, u)[live], sample(want_policy, u)[live])
            if not sampled:
                assert got_policy is None and torch.equal(got, logits.argmax(-1))


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
def test_greedy_tokens_are_torch_argmax(kernel_device, monkeypatch):
    """`greedy_tokens` (the drafter's drafts) == torch.argmax on both paths: one program per row for contiguous
    small-vocabulary rows (ties: the first maximal entry; -inf rows; [N, P, V] blocks), torch's reduction for a
    strided view and above ROW_PROGRAM_VOCAB."""
    from dscale_runtime.kernels import triton_sampling
    from dscale_runtime.sampling import greedy_tokens

    device = kernel_device
    gen = torch.Generator().manual_seed(12)
    launched = []
    real = triton_sampling.row_tokens_triton
    monkeypatch.setattr(triton_sampling, "row_tokens_triton",
                        lambda *a, **k: launched.append(a[0].shape) or real(*a, **k))
    for dtype, shape in ((torch.bfloat16, (3, 15, 4096)), (torch.float32, (7, 3000)), (torch.float16, (2, 5, 777))):
        logits = (torch.randn(*shape, generator=gen) * 3).to(dtype)
        flat = logits.view(-1, shape[-1])
        flat[0, 7] = flat[0, 700] = flat[0].max() + 1  # a tie at the top: the first index
        flat[1] = float("-inf")  # no finite entry: index 0, as torch
        flat[2, :] = flat[2, 0]  # all equal
        logits = logits.to(device)
        got = greedy_tokens(logits, "triton")
        assert got.dtype == torch.long and got.shape == shape[:-1]
        assert torch.equal(got, logits.argmax(-1)), dtype
        assert got.view(-1)[0] == 7 and got.view(-1)[2] == 0
        if len(shape) == 3:  # into a block's draft slots [N, 1 + P] (anchors kept) by the same launch
            block = torch.full((shape[0], shape[1] + 1), -5, dtype=torch.long, device=device)
            assert greedy_tokens(logits, "triton", out=block[:, 1:]).data_ptr() == block[:, 1:].data_ptr()
            assert torch.equal(block[:, 1:], got) and (block[:, 0] == -5).all()
    assert len(launched) == 5
    strided = (torch.randn(6, 2 * 1000, generator=gen)).to(device)[:, ::2]
    big = torch.randn(3, 9000, generator=gen).to(device)
    for logits in (strided, big):  # torch's argmax: no launch of the row kernel
        assert torch.equal(greedy_tokens(logits, "triton"), logits.argmax(-1))
        into = torch.zeros(logits.shape[0], 2, dtype=torch.long, device=device)[:, 1]
        assert torch.equal(greedy_tokens(logits, "triton", out=into), logits.argmax(-1))  # a copy into `out`
    assert len(launched) == 5
    ref = torch.randn(4, 100, generator=gen)
    assert torch.equal(greedy_tokens(ref, "ref"), ref.argmax(-1)) and len(launched) == 5


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
@pytest.mark.parametrize("dtype,vocab,filtered", [(torch.bfloat16, 4096, False), (torch.float32, 3000, True),
                                                   (torch.bfloat16, 9000, False)])
def test_one_launch_drafts_and_acceptance_equal_the_unfused_rules(dtype, vocab, filtered, kernel_device, monkeypatch):
    """The sampled step's two fused launches against their references on the same inputs: `draft_draws` (one
    `row_tokens_triton` launch with the rows' stats) == the unfused Triton path (`make_policy` + `sample`) draft for
    draft, its q's weights equal; `verify.accept_rules` on the Triton path (`accept_rules_triton`, one program per
    request) == the reference rules (`accept_greedy`, `accept_sampled_drafts` with the keyed coins and residual
    draw) request for request: greedy, top-1 and sampled-draft requests in one packed batch, DScale-like prefix
    lengths (1 = no draft verified), rejections drawn from the residual over several chunks, whole blocks accepted.
    Above ROW_PROGRAM_VOCAB (9,000) the drafts and the target's tokens take the row programs' wide form (four
    launches) and the acceptance sums its residual's chunks in a launch of their own; below it the wide form is run
    too, against the one-program rows; either layout of the residual's sums gives the other's tokens."""
    from dscale_runtime import sampling as sampling_module
    from dscale_runtime.kernels import triton_sampling
    from dscale_runtime.kernels.sampling import _SECOND_KEY, purpose_key
    from dscale_runtime.sampling import COIN, RESIDUAL, draft_draws
    from dscale_runtime.verify import accept_rules

    launched = collections.Counter()
    accept_kernels = triton_sampling.accept_rules_triton
    for name in ("row_tokens_triton", "accept_rules_triton"):
        real = getattr(triton_sampling, name)
        monkeypatch.setattr(triton_sampling, name, lambda *a, _real=real, _name=name, **k: launched.update([_name])
                            or _real(*a, **k))

    device = kernel_device
    gen = torch.Generator().manual_seed(13)
    b, w = 6, 5
    rule = torch.tensor([RULE_SAMPLED, RULE_SAMPLED, RULE_TOP1, RULE_SAMPLED, RULE_GREEDY, RULE_SAMPLED], device=device)
    lens = torch.tensor([5, 3, 4, 1, 2, 5], device=device)
    offsets = torch.cumsum(lens, 0) - lens
    m = int(lens.sum()) + 3  # three placeholder rows past the live ones, as DScale packs
    sampling = SamplingRows(rule == RULE_GREEDY, torch.tensor([1.0, 0.7, 1.0, 1.3, 1.0, 0.9], device=device),
                            torch.tensor([-1, 40, -1, -1, -1, 7], device=device),
                            torch.tensor([1.0, 0.8, 1.0, 0.95, 1.0, 1.0], device=device),
                            torch.tensor([5, 2**32 - 1, 7, 123, 0, 9], device=device),
                            torch.tensor([0, 3, 2**31, 1, 0, 77], device=device), backend="triton")
    row_req = torch.repeat_interleave(torch.arange(b), lens.cpu()).tolist() + [b] * 3
    # the rows whose policy a rule reads: sampled-draft requests' verification rows
    live_rows = torch.tensor([r for r, i in enumerate(row_req) if i < b and rule[i] == RULE_SAMPLED], device=device)
    small = vocab <= sampling_module.ROW_PROGRAM_VOCAB
    outcomes = collections.Counter()
    draws = 6 if device == "cpu" else 200
    for d in range(draws):
        base = torch.randn(m, vocab, generator=gen) * 3
        base[:, :16] += 6  # most of the mass on a few tokens: drafts are often accepted
        t_logits = base.to(dtype).to(device)
        slot_rows = [min(int(offsets[i]) + j, m - 1) for i in range(b) for j in range(w - 1)]
        d_logits = (base[slot_rows] + torch.randn(b * (w - 1), vocab, generator=gen) * (0.2 + 0.4 * (d % 3))).to(dtype)
        d_logits = d_logits.to(device)
        ctx = torch.randint(1, 2**31, (b,), generator=gen).to(device)
        argmax = d_logits.float().view(b, w - 1, vocab).argmax(-1)
        drafts, q = draft_draws(d_logits.view(b, w - 1, vocab), sampling, ctx, rule == RULE_SAMPLED, filtered, argmax)
        # into a block's draft slots, its greedy drafts there first (the runner's call): the same drafts, anchors kept
        slots = torch.cat([torch.full((b, 1), -5, device=device), argmax], dim=1)
        into, _ = draft_draws(d_logits.view(b, w - 1, vocab), sampling, ctx, rule == RULE_SAMPLED, filtered,
                              slots[:, 1:], out=slots[:, 1:])
        assert into.data_ptr() == slots[:, 1:].data_ptr() and torch.equal(slots[:, 1:], drafts)
        assert (slots[:, 0] == -5).all()
        drawn_rows = torch.repeat_interleave(rule == RULE_SAMPLED, w - 1).nonzero()[:, 0]
        positions = torch.randint(0, 2**31, (m,), generator=gen).to(device)
        index = torch.tensor(row_req, device=device)
        tokens, policy = target_tokens(t_logits, sampling, positions, filtered, True, index=index, max_index=b - 1,
                                       offset=1)
        # the references: the unfused path (no row programs at all), and on every third draw the other form of the
        # row programs (the wide form's four launches below ROW_PROGRAM_VOCAB; the one-program rows above it cannot run)
        wide_too = small and d % 3 == 0
        layouts = [dict(ROW_PROGRAM_VOCAB=0, WIDE_ROW_VOCAB=0)] + ([dict(ROW_PROGRAM_VOCAB=0)] if wide_too else [])
        for layout in layouts:
            with monkeypatch.context() as mp:
                for name, value in layout.items():
                    mp.setattr(sampling_module, name, value)
                want_drafts, want_q = draft_draws(d_logits.view(b, w - 1, vocab), sampling, ctx, rule == RULE_SAMPLED,
                                                  filtered, argmax)
                want_tokens, want_p = target_tokens(t_logits, sampling, positions, filtered, True, index=index,
                                                    max_index=b - 1, offset=1)
            assert torch.equal(drafts, want_drafts), (d, layout)
            assert torch.equal(tokens, want_tokens), (d, layout)
            for mine, theirs, kept in ((q, want_q, drawn_rows), (policy, want_p, live_rows)):
                assert torch.allclose(mine.row_weights(kept) / mine.total[kept, None],
                                      theirs.row_weights(kept) / theirs.total[kept, None], rtol=1e-9, atol=1e-15)
        block = torch.cat([torch.randint(0, vocab, (b, 1), generator=gen).to(device), drafts], dim=1)
        got = accept_rules(policy, q, block, tokens, lens, offsets, rule, RULE_SAMPLED, sampling, ctx)
        ref = dataclasses.replace(sampling, backend="ref")
        want = accept_rules(policy, q, block, tokens, lens, offsets, rule, RULE_SAMPLED, ref, ctx)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (d, got, want)
        # the other layout of the residual's sums (split over B x chunks programs above ROW_PROGRAM_VOCAB, one
        # program's pass below): the same sums, bit for bit, so the same tokens
        split = vocab <= sampling_module.ROW_PROGRAM_VOCAB
        other = accept_kernels(*[(pol.values, pol.shift, pol.inv_t, pol.floor, pol.total) for pol in (policy, q)],
                               tokens, block, lens, offsets, rule, RULE_SAMPLED, sampling.seed_lo, sampling.seed_hi, ctx,
                               purpose_key(COIN), purpose_key(RESIDUAL), _SECOND_KEY, split=split)
        assert torch.equal(other[0], got[0]) and torch.equal(other[1], got[1]), (d, split, other, got)
        for i in range(b):
            if rule[i] == RULE_SAMPLED:
                outcomes["rejected" if want[0][i] < lens[i] - 1 else "all accepted"] += 1
                outcomes["accepted drafts"] += int(want[0][i])
    assert outcomes["rejected"] >= 5 and outcomes["all accepted"] >= 5 and outcomes["accepted drafts"] >= 10, outcomes
    # per draw: drafts (twice: into a block too) and target tokens one call each (and again in the wide form's
    # reference), acceptance one
    wide_draws = len(range(0, draws, 3)) if small else 0
    assert launched == collections.Counter(row_tokens_triton=3 * draws + 2 * wide_draws,
                                           accept_rules_triton=draws), launched


@needs_triton
def test_compiled_sampler_kernels_build_for_sm90_without_spills():
    """The fused sampled step's kernels through Triton's compiler rather than its interpreter, without a GPU (the
    bundled ptxas, sm_90): the acceptance kernel at the demo pair's vocabulary (one program's pass over 4 chunks)
    and at Qwen3's (149 chunks summed by the residual-sums kernel, also built), the row kernel drawing drafts with
    their policy stats and its wide form's three kernels, the unfused sampler's two-level search, the keyed-uniforms
    kernel; none spills registers. The interpreter runs their arithmetic (the tests above), not their compiled
    form."""
    from offline import run_without_interpreter

    lines = run_without_interpreter("""
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dscale_runtime.kernels import stack_usage, triton_sampling as ts
from dscale_runtime.kernels.filters import KEY_ALL, MASS_BITS

def build(kernel, consts, pointers, warps):
    sig = {n: "constexpr" if n in consts else pointers.get(n, "i64" if n == "key" else "i32") for n in kernel.arg_names}
    return stack_usage(triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps}))

policy = {f"{side}_{name}": kind for side in "td" for name, kind in (("shift", "*fp32"), ("inv_t", "*fp32"),
                                                                      ("floor", "*fp32"), ("total", "*fp64"))}
accept = {"t_logits": "*bf16", "d_logits": "*bf16", **policy, **{n: "*i64" for n in (
    "tokens", "block", "lens", "offsets", "rule", "seed_lo", "seed_hi", "ctx", "accepted_out", "successor_out")}}
accept["sums_in"] = "*fp64"
for blocks, split in ((4, False), (256, True)):
    consts = dict(W=16, BLOCK_J=16, CHUNK=1024, BLOCK_C=blocks, T_FLOOR=True, D_FLOOR=True, ACCURATE=True, SPLIT=split)
    print("accept", blocks, build(ts._accept_rules_kernel, consts, accept, 4))
consts = dict(W=16, BLOCK_J=16, CHUNK=1024, T_FLOOR=True, D_FLOOR=True, ACCURATE=True)
print("accept sums", build(ts._residual_sums_kernel, consts, {**accept, "sums_out": "*fp64"}, 4))
rows = {"logits": "*bf16", "greedy": "*i1", "temperature": "*fp32", "top_p": "*fp32", "stat_shift": "*fp32",
        "stat_inv_t": "*fp32", "stat_floor": "*fp32", "stat_total": "*fp64",
        **{n: "*i64" for n in ("index", "top_k", "seed_lo", "seed_hi", "positions", "out")}}
consts = dict(SAMPLED=True, FILTERED=True, INDEXED=False, PER_REQ=15, STATS=True, OUT_MAP=True, CHUNK=1024, NUM_CHUNKS=4,
              BLOCK_C=4, VBLOCK=4096, KEY_ALL=KEY_ALL, KEY_BITS=16, SCALE=float(2**MASS_BITS), ACCURATE=True, KEY16=True,
              DTYPE=tl.bfloat16)
print("rows", build(ts._row_tokens_kernel, consts, rows, 4))
wide = {"cmax": "*fp32", "carg": "*i64", "arg": "*i64", "shift_out": "*fp32", "inv_t_out": "*fp32", "arg_out": "*i64",
        "sums": "*fp32", "shift": "*fp32", "inv_t": "*fp32", "floor": "*fp32", "total_out": "*fp64", **rows}
print("rows wide max", build(ts._wide_max_kernel, dict(CHUNK=1024), wide, 4))
print("rows wide row", build(ts._wide_row_kernel, dict(INDEXED=True, PER_REQ=1, BLOCK_C=256), wide, 4))
print("rows wide draw", build(ts._wide_draw_kernel, dict(INDEXED=False, PER_REQ=15, FLOOR=True, CHUNK=1024,
                                                          BLOCK_C=256), wide, 4))
print("rows sample", build(ts._sample_kernel, dict(LOGITS=True, FLOOR=True, CHUNK=1024, BLOCK_C=256),
                          {"values": "*bf16", "shift": "*fp32", "inv_t": "*fp32", "floor": "*fp32", "chunk_sums": "*fp64",
                           "u": "*fp64", "out": "*i64"}, 4))
print("uniforms", build(ts._keyed_uniforms_kernel, dict(BLOCK=256), {"seed_lo": "*i64", "seed_hi": "*i64",
                                                                     "positions": "*i64", "out": "*fp64"}, 4))
""")
    built = [line for line in lines if line.startswith(("accept", "rows", "uniforms"))]
    assert len(built) == 9, lines
    for line in built:
        assert line.endswith(("STACK:0", "?")), f"register spills: {line}"


def test_policy_applies_temperature_top_k_and_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    rows = SamplingRows(torch.tensor([False, False]), torch.tensor([0.5, 1.0]), torch.tensor([2, -1]),
                        torch.tensor([1.0, 0.7]), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    probs = policy_probs(logits, rows, filtered=True)
    assert torch.allclose(probs[0], torch.softmax(torch.tensor([6.0, 4.0, -1e9, -1e9]), -1))
    p = torch.softmax(logits[1], -1)  # 0.644, 0.237, ...: top_p 0.7 keeps the first two
    assert torch.allclose(probs[1], torch.cat([p[:2] / p[:2].sum(), torch.zeros(2)]))
    assert torch.allclose(policy_probs(logits, rows, filtered=False)[1], p)


# ----------------------------------------------------------------------------- exact distribution, end to end
PROMPT = [1, 2, 3, 4]
NEW_TOKENS = 3


def exact_sequence_probs(target_folder, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3 | PROMPT) under the target's policy: transformers' model on every prefix, the policy's
    definition (`policy_probs_ref`, which sorts)."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(target_folder, torch_dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    one = lambda v, dtype: torch.tensor([v], dtype=dtype)  # noqa: E731
    rows = SamplingRows(torch.tensor([False]), one(params.temperature, torch.float32),
                        one(params.top_k, torch.long), one(params.top_p, torch.float32),
                        one(0, torch.long), one(0, torch.long))
    probs = {(): 1.0}
    for length in range(NEW_TOKENS):
        prefixes = [p for p in probs if len(p) == length]
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
        policy = policy_probs_ref(logits, SamplingRows(*(t.expand(len(prefixes)) for t in (
            rows.greedy, rows.temperature, rows.top_k, rows.top_p, rows.seed_lo, rows.seed_hi))), filtered=True)
        for prefix, dist in zip(prefixes, policy.tolist()):
            for token in range(vocab):
                if dist[token] > 0:
                    probs[prefix + (token,)] = probs[prefix] * dist[token]
    return {k: v for k, v in probs.items() if len(k) == NEW_TOKENS}


def goodness_of_fit(counts: collections.Counter, exact: dict) -> float:
    assert all(seq in exact for seq in counts), "a sequence of probability 0 was produced"
    total = sum(counts.values())
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * total >= 5]
    rest = [c for c in cells if exact[c] * total < 5]
    observed = [counts[c] for c in big] + [sum(counts[c] for c in rest)]
    expected = [exact[c] * total for c in big] + [sum(exact[c] for c in rest) * total]
    assert len(big) >= 8, "the distribution must have some spread"
    expected = np.array(expected) * total / sum(expected)
    return chisquare(np.array(observed, dtype=float), expected).pvalue


CASES = [  # (mode, sampling_rule, budget_ratio, params)
    ("target", "top1", 0.5, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)),
    ("dflash", "top1", 0.5, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)),
    ("dflash", "sampled", 0.5, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)),
    ("dflash", "sampled", 0.5, SamplingParams(temperature=0.8, top_k=5, max_tokens=3, ignore_eos=True)),
    ("dscale", "top1", 0.5, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)),
    ("dscale", "top1", 0.25, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)),
    ("dscale", "sampled", 0.5, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)),
    ("dscale", "sampled", 0.25, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)),
]


@pytest.mark.parametrize("mode,rule,ratio,params", CASES,
                         ids=[f"{m}-{r}-{b}-T{p.temperature}-p{p.top_p}-k{p.top_k}" for m, r, b, p in CASES])
def test_sampled_output_has_the_target_distribution(small_vocab_pair, tmp_path, mode, rule, ratio,  # noqa: F811
                                                    params):
    target, drafter = small_vocab_pair
    exact = exact_sequence_probs(target, params)
    predictor = save_predictor(tmp_path, small_vocab_pair, "untrained", 3) if mode == "dscale" else None
    cfg = EngineConfig(mode=mode, max_model_len=32, max_running_requests=256, seed=11, budget_ratio=ratio,
                       sampling_rule=rule, live_calibration=True)
    engine = Engine.from_pretrained(target, drafter if mode != "target" else None, predictor=predictor, config=cfg)
    outputs = engine.generate([PROMPT] * 2000, params)
    counts = collections.Counter(tuple(o.token_ids) for o in outputs)
    if mode != "target":
        assert engine.counters.accepted_drafts > 300, "drafts must be accepted for the test to mean anything"
    if mode == "dscale":
        assert engine.counters.verify_rows <= ratio * 16 * engine.counters.request_steps + engine.counters.steps
        assert engine.calibration.report()["refreshes"] > 0, "the live calibration refreshed while sampling"
    p_value = goodness_of_fit(counts, exact)
    assert p_value > 1e-3, f"{mode}/{rule} sampling differs from the target's distribution (p={p_value:.3g})"


# ------------------------------------------------------------------------------ seeded, token for token
def seeded(params: SamplingParams, i: int) -> SamplingParams:
    return SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                          max_tokens=params.max_tokens, ignore_eos=True, seed=1000 + i)


def generate(pair_paths, mode, params_list, prompts, predictor=None, **config):  # noqa: F811
    cfg = EngineConfig(mode=mode, **{"max_model_len": 1024, "dtype": "float32", **config})
    engine = Engine.from_pretrained(pair_paths[0], pair_paths[1] if mode != "target" else None, predictor=predictor,
                                    config=cfg)
    return [o.token_ids for o in engine.generate(prompts, params_list)], engine


def test_top1_rule_reproduces_target_only_sampling_token_for_token():
    """Seeded requests under the top-1 rule decode exactly what target-only sampling decodes with the same
    seeds (the demo pair, fp32): in DFlash and in DScale at two budgets, at two batch sizes, mixed with greedy
    requests in one batch."""
    from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts

    demo = (DEMO_DIR / "target", DEMO_DIR / "drafter")
    prompts = [p["prompt"] for p in stdlib_prompts()[40:49]]
    points = [SamplingParams(temperature=1.0, max_tokens=32), SamplingParams(temperature=0.7, top_p=0.8, max_tokens=32)]
    plist = [seeded(points[i % 2], i) if i % 3 else SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
             for i in range(len(prompts))]
    want, _ = generate(demo, "target", plist, prompts, max_running_requests=9)
    predictor = DEMO_DIR.parent / "demo.pt"
    runs = [("dflash", None, {"max_running_requests": 3}),
            ("dscale", predictor, {"max_running_requests": 9, "budget_ratio": 0.5}),
            ("dscale", predictor, {"max_running_requests": 5, "budget_ratio": 0.25})]
    for mode, pred, config in runs:
        got, engine = generate(demo, mode, plist, prompts, pred, sampling_rule="top1", **config)
        assert engine.counters.accepted_drafts > 0.5 * engine.counters.request_steps, "drafts must be accepted"
        assert got == want, f"{mode} {config}"
        if mode == "dscale":  # the budget really cut rows
            assert engine.counters.verify_rows < 0.6 * 16 * engine.counters.request_steps


def test_sampled_drafts_rule_is_reproducible_whatever_the_batch(small_vocab_pair):  # noqa: F811
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    cfg = dict(max_model_len=32, max_running_requests=8, sampling_rule="sampled")
    alone, _ = generate(small_vocab_pair, "dflash", [params], [[1, 2, 3]], **cfg)
    crowd, engine = generate(small_vocab_pair, "dflash", [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [params],
                             [[3, 2, 1]] * 5 + [[1, 2, 3]], **cfg)
    assert alone[0] == crowd[-1]
    padded, _ = generate(small_vocab_pair, "dflash", [params] * 3, [[1, 2, 3]] * 3, **cfg)  # bucket 4, one pad row
    assert padded == [alone[0]] * 3


def test_auto_rule_picks_by_temperature_and_steps_pick_their_kind(pair):  # noqa: F811
    engine = Engine.from_pretrained(pair[0], pair[1], config=EngineConfig(mode="dflash", max_model_len=64,
                                                                          sampled_drafts_min_temperature=0.9))
    assert engine._rule(SamplingParams(temperature=0)) == RULE_GREEDY
    assert engine._rule(SamplingParams(temperature=0.7)) == RULE_TOP1
    assert engine._rule(SamplingParams(temperature=1.0)) == RULE_SAMPLED
    ids = [engine.add_request([5, 6, 7], p) for p in (SamplingParams(temperature=0), SamplingParams(temperature=1.0),
                                                       SamplingParams(temperature=0.7, top_p=0.8))]
    requests = [engine.requests[i] for i in ids]
    kind = engine._step_kind(requests, "dflash")
    assert kind.sampled and kind.filtered and kind.draft_sampling and not kind.features
    assert engine._step_kind(requests[:1], "dflash") == type(kind)("dflash")
    assert engine._step_kind(requests[:2], "target") == type(kind)("target", sampled=True)
    huge = engine.requests[engine.add_request([5], SamplingParams(temperature=1.0, top_k=10**6))]
    assert huge.sampling[2] == -1  # top_k beyond the vocabulary keeps every token


def test_every_mode_runs_through_the_one_runner(pair, tmp_path):  # noqa: F811
    """Target-only, DFlash and DScale, greedy and sampled, traced or not: each step is a runner step."""
    predictor = save_predictor(tmp_path, pair, "heuristic")
    prompts, _ = prompt_set(6, seed=4)
    params = [SamplingParams(temperature=t, max_tokens=6, ignore_eos=True, seed=i)
              for i, t in zip(range(6), itertools.cycle([0, 1.0]))]
    for mode in ("target", "dflash", "dscale"):
        config = {"measure_retention": True} if mode == "dscale" else {}
        _, engine = generate(pair, mode, params, prompts, predictor if mode == "dscale" else None,
                             max_running_requests=6, **config)
        kinds = {kind for _, kind in engine.runner.steps}
        assert {k.mode for k in kinds} == {mode} and any(k.sampled for k in kinds)
        if mode == "dscale":
            assert all(k.retention for k in kinds) and engine.counters.full_width_drafts > 0
