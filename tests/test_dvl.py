"""DVL: features vs a slow reference, Algorithm 1 vs brute force, flat-pack vs a loop, predictor artifacts."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dscale_runtime.dvl.allocate import allocate, budget_rows
from dscale_runtime.dvl.features import (
    FEATURE_VERSION,
    FeatureSpec,
    acceptance_features,
    agreement_features,
    context_features,
    hidden_projection,
    sampling_features,
)
from dscale_runtime.dvl.pack import flat_pack, packed_metadata
from dscale_runtime.dvl.predictor import (
    AcceptancePredictor,
    PredictorError,
    load_predictor,
    predictor_artifact,
    seed_lengths,
)
from dscale_runtime.kv_cache import SCRATCH_PAGE


# ----------------------------------------------------------------------------------------------- features
def features_slow(logits: np.ndarray, hidden: np.ndarray, proj: np.ndarray, ctx: np.ndarray, ranks: int,
                  sampling: np.ndarray | None = None):
    """Loops and float64 numpy, straight from DESIGN 3.1 (+ the v2 sampling columns)."""
    n, p, v = logits.shape
    rows = []
    for i in range(n):
        row = []
        for j in range(p):
            x = logits[i, j].astype(np.float64)
            srt = sorted(x, reverse=True)
            m = max(x)
            log_z = m + math.log(sum(math.exp(t - m) for t in x))
            probs = [math.exp(t - log_z) for t in x]
            entropy = -sum(q * (t - log_z) for q, t in zip(probs, x))
            row += [srt[0]] + [srt[0] - srt[r] for r in range(1, ranks)] + [srt[0] - log_z, entropy]
        for j in range(p):
            row += list(hidden[i, j].astype(np.float64) @ proj.astype(np.float64))
        row += list(ctx[i])
        row += list(sampling[i]) if sampling is not None else []
        rows.append(row)
    return np.array(rows)


@pytest.mark.parametrize("legacy", [False, True])
def test_features_equal_slow_reference(legacy):
    spec = FeatureSpec.legacy() if legacy else FeatureSpec()
    gen = torch.Generator().manual_seed(0)
    n, v, d = 3, 50, 12
    logits = torch.randn(n, spec.num_positions, v, generator=gen) * 3
    hidden = torch.randn(n, spec.num_positions, d, generator=gen)
    proj = hidden_projection(spec, d)
    ctx = context_features(spec, n, [10, 200, 7], [0, 5, 2], [[], [3, 0, 15, 4, 9], [1, 2]], "cpu")
    sampling = None if legacy else sampling_features(spec, torch.tensor([0.0, 1.0, 0.7]),
                                                     torch.tensor([False, True, False]))
    agreement = None if legacy else torch.arange(n * spec.num_agreement, dtype=torch.float32).view(n, -1)
    got = acceptance_features(spec, logits, hidden, proj, ctx, sampling=sampling, agreement=agreement)
    want = features_slow(logits.numpy(), hidden.numpy(), proj.numpy(), ctx.numpy(), spec.num_ranks,
                         None if legacy else np.array([[0, 0], [1, 1], [0.7, 0]]))
    if not legacy:  # v3 rows end with the agreement columns, as given
        want = np.concatenate([want, agreement.numpy()], axis=1)
    assert got.shape == (n, spec.width) == (n, len(spec.names()))
    if not legacy:
        assert spec.names()[spec.temperature_column] == "temperature" and spec.names()[-1] == "pos15_lookup"
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5, rtol=1e-5)
    # Batch context columns: num_live, context_len, decode_step, history_len, most recent accepted first.
    assert ctx[1].tolist() == [3, 200, 5, 4, 9, 4, 15, 0]
    assert ctx[0].tolist() == [3, 10, 0, 0, 0, 0, 0, 0]


def test_spec_width_and_projection_are_fixed():
    spec = FeatureSpec()
    assert spec.version == FEATURE_VERSION
    assert spec.num_confidence == 270 and spec.width == 270 + 60 + 8 + 2 + 31
    assert FeatureSpec(version="dscale-features-v2").width == 270 + 60 + 8 + 2  # v2 artifacts keep their layout
    assert FeatureSpec.legacy().width == 270 + 60 + 8  # v1 artifacts keep their layout
    with pytest.raises(ValueError, match="dscale-features-v0"):
        FeatureSpec(version="dscale-features-v0")
    assert torch.equal(hidden_projection(spec, 64), hidden_projection(spec, 64))
    assert not torch.equal(hidden_projection(spec, 64), hidden_projection(FeatureSpec(proj_seed=1), 64))


# ----------------------------------------------------------------------------------------------- allocator
def objective(scores: torch.Tensor, k: torch.Tensor) -> float:
    return sum(float(scores[i, : int(k[i]) - 1].sum()) for i in range(len(k)))


def brute_force(scores: torch.Tensor, seeds: torch.Tensor, budget: int) -> float:
    n, w = scores.shape[0], scores.shape[1] + 1
    gap = budget - int(seeds.sum())
    best = -math.inf
    for ks in itertools.product(range(1, w + 1), repeat=n):
        if sum(ks) != budget:
            continue
        if gap > 0 and any(k < s for k, s in zip(ks, seeds.tolist())):
            continue
        if gap < 0 and any(k > s for k, s in zip(ks, seeds.tolist())):
            continue
        if gap == 0 and list(ks) != seeds.tolist():
            continue
        best = max(best, objective(scores, torch.tensor(ks)))
    return best


@st.composite
def allocation_case(draw, max_n=4, max_w=6):
    n = draw(st.integers(1, max_n))
    w = draw(st.integers(2, max_w))
    # Scores drawn from a small grid so ties are frequent; rows made non-increasing.
    raw = draw(st.lists(st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.5, 0.75, 0.9, 1.0]), min_size=n * (w - 1),
                        max_size=n * (w - 1)))
    scores = torch.tensor(raw).view(n, w - 1).cummin(dim=1).values
    seeds = torch.tensor(draw(st.lists(st.integers(1, w), min_size=n, max_size=n)))
    budget = draw(st.integers(n, n * w))
    return scores, seeds, budget


@settings(max_examples=400, deadline=None)
@given(allocation_case())
def test_allocator_properties_and_optimality(case):
    scores, seeds, budget = case
    n, w = scores.shape[0], scores.shape[1] + 1
    k = allocate(scores, seeds, torch.ones(n, dtype=torch.bool), budget)
    gap = budget - int(seeds.sum())
    assert int(k.sum()) == budget
    assert bool(((k >= 1) & (k <= w)).all())
    if gap > 0:
        assert bool((k >= seeds).all())
    elif gap < 0:
        assert bool((k <= seeds).all())
    else:
        assert torch.equal(k, seeds)
    assert objective(scores, k) == pytest.approx(brute_force(scores, seeds, budget), abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(allocation_case(max_n=6, max_w=16), st.lists(st.booleans(), min_size=6, max_size=6))
def test_allocator_inactive_rows_get_nothing(case, live_flags):
    scores, seeds, _ = case
    n, w = scores.shape[0], scores.shape[1] + 1
    live = torch.tensor(live_flags[:n])
    if not live.any():
        live[0] = True
    num_live = int(live.sum())
    budget = budget_rows(num_live, w, 0.5)
    k = allocate(scores, seeds, live, budget)
    assert int(k.sum()) == budget
    assert bool((k[~live] == 0).all()) and bool((k[live] >= 1).all())


def test_budget_rows():
    assert budget_rows(8, 16, 0.5) == 64
    assert budget_rows(3, 16, 0.25) == 12
    assert budget_rows(4, 16, 0.01) == 4  # at least the anchors
    assert budget_rows(4, 16, 1.0) == 64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_allocator_cuda_equals_cpu():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n, w = int(torch.randint(1, 64, (1,), generator=gen)), 16
        scores = torch.rand(n, w - 1, generator=gen).round(decimals=1).cummin(1).values
        seeds = torch.randint(1, w + 1, (n,), generator=gen)
        budget = int(torch.randint(n, n * w + 1, (1,), generator=gen))
        live = torch.ones(n, dtype=torch.bool)
        cpu = allocate(scores, seeds, live, budget)
        gpu = allocate(scores.cuda(), seeds.cuda(), live.cuda(), budget)
        assert torch.equal(cpu, gpu.cpu())


# ----------------------------------------------------------------------------------------------- flat-pack
def test_flat_pack_matches_a_loop_and_places_placeholders():
    page = 4
    k = torch.tensor([3, 1, 5, 0])  # the last request is inactive (graph padding)
    draft = torch.arange(4 * 6).view(4, 6) + 100
    ctx = torch.tensor([5, 0, 9, 2])
    tables = torch.tensor([[3, 4, 0, 0], [5, 0, 0, 0], [6, 7, 8, 9], [10, 0, 0, 0]])
    rows = 12  # M > M_live = 9: three placeholder rows
    packed = flat_pack(k, draft, ctx, tables, rows, page)
    assert packed.verify_offsets.tolist() == [0, 3, 4, 9]
    want_tokens, want_pos, want_slots = [], [], []
    for i in range(4):
        for s in range(int(k[i])):
            pos = int(ctx[i]) + s
            want_tokens.append(int(draft[i, s]))
            want_pos.append(pos)
            want_slots.append(int(tables[i, pos // page]) * page + pos % page)
    assert packed.token_ids[:9].tolist() == want_tokens
    assert packed.positions[:9].tolist() == want_pos
    assert packed.slot_mapping[:9].tolist() == want_slots
    assert packed.row_req[:9].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2]
    assert packed.row_local[:9].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4]
    # Placeholders: write to the scratch page only, and belong to the pseudo request N.
    assert packed.row_req[9:].tolist() == [4, 4, 4]
    assert all(s // page == SCRATCH_PAGE for s in packed.slot_mapping[9:].tolist())
    meta = packed_metadata(packed, ctx, tables, max_kv=16, max_q=6)
    assert meta.kv_lens.tolist() == [8, 1, 14, 2, 1]
    assert meta.block_tables[4].tolist() == [SCRATCH_PAGE] * 4


# ----------------------------------------------------------------------------------------------- artifacts
IDENTITY = {"target": {"hidden_size": 32, "num_hidden_layers": 4, "vocab_size": 96},
            "drafter": {"hidden_size": 32, "num_hidden_layers": 2, "block_size": 16, "target_layer_ids": [0, 2],
                        "mask_token_id": 95}}


def save_artifact(path, model=None, identity=IDENTITY, **overrides):
    model = model or AcceptancePredictor(FeatureSpec())
    art = predictor_artifact(model, identity, hidden_projection(model.spec, identity["drafter"]["hidden_size"]))
    art.update(overrides)
    torch.save(art, path)
    return path


def test_predictor_size_and_monotone_scores():
    model = AcceptancePredictor(FeatureSpec())
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 125_000
    s = model.scores(torch.randn(7, FeatureSpec().width))
    assert bool((s[:, 1:] <= s[:, :-1]).all()) and bool(((s >= 0) & (s <= 1)).all())
    assert seed_lengths(torch.ones(2, 15), 16).tolist() == [16, 16]
    assert seed_lengths(torch.zeros(2, 15), 16).tolist() == [1, 1]
    assert seed_lengths(torch.full((1, 15), 0.1), 16).tolist() == [3]  # 1 + round(1.5), half rounds up


def test_artifact_round_trip_with_weights_only(tmp_path):
    model = AcceptancePredictor(FeatureSpec())
    path = save_artifact(tmp_path / "p.pt", model)
    loaded, proj = load_predictor(path, IDENTITY)
    x = torch.randn(5, FeatureSpec().width)
    torch.testing.assert_close(loaded(x), model(x))
    assert proj.shape == (32, 4)


def test_artifact_errors_name_the_problem(tmp_path):
    with pytest.raises(PredictorError, match="no predictor artifact"):
        load_predictor(tmp_path / "missing.pt", IDENTITY)
    # A pickle carrying code is refused by weights_only loading.
    evil = tmp_path / "evil.pt"
    torch.save({"format": "dscale-acceptance-predictor", "payload": np.random.default_rng(0)}, evil)
    with pytest.raises(PredictorError, match="not a loadable predictor artifact"):
        load_predictor(evil, IDENTITY)
    torch.save({"weights": torch.zeros(3)}, tmp_path / "other.pt")
    with pytest.raises(PredictorError, match="not a DScale predictor artifact"):
        load_predictor(tmp_path / "other.pt", IDENTITY)
    old = dict(FeatureSpec().to_dict(), version="dscale-features-v0")
    with pytest.raises(PredictorError, match="feature spec version 'dscale-features-v0'"):
        load_predictor(save_artifact(tmp_path / "v0.pt", feature_spec=old), IDENTITY)
    wider = {**IDENTITY, "drafter": {**IDENTITY["drafter"], "hidden_size": 64}}
    with pytest.raises(PredictorError, match="hidden_size=64"):
        load_predictor(save_artifact(tmp_path / "h.pt"), wider)
    with pytest.raises(PredictorError, match="tampered"):
        load_predictor(save_artifact(tmp_path / "t.pt", hidden_projection=torch.zeros(32, 4)), IDENTITY)
    bad_weights = {k: torch.zeros(1) for k in AcceptancePredictor(FeatureSpec()).state_dict()}
    with pytest.raises(PredictorError, match="weights do not fit"):
        load_predictor(save_artifact(tmp_path / "w.pt", state_dict=bad_weights), IDENTITY)


# ----------------------------------------------------------------------------- v3: the drafts' agreement with context
def agreement_brute_force(seq: list[int], ctx: int, block: list[int], spec: FeatureSpec) -> list[float]:
    """The v3 agreement columns by their definition, over plain lists: seq holds the request's tokens up to the anchor
    (seq[ctx] == block[0]); only the last `agreement_window` of them (anchor included) are looked in."""
    lo = max(0, ctx - spec.agreement_window + 1)
    window, ext = seq[lo : ctx + 1], seq[: ctx + 1] + block[1:]

    def occurs(gram: list[int]) -> bool:
        return any(window[i : i + len(gram)] == gram for i in range(len(window) - len(gram) + 1))

    runs = []
    for j in range(1, len(block)):
        run = 0
        for span in range(1, spec.agreement_ngram + 1):
            start = ctx + j - span + 1
            if start < lo or not occurs(ext[start : ctx + j + 1]):
                break
            run = span
        runs.append(float(run))
    follows = None
    for span in range(spec.agreement_lookup, 0, -1):  # the longest suffix that recurs wins
        if ctx - span + 1 < lo:
            continue
        suffix = seq[ctx - span + 1 : ctx + 1]
        ends = [e for e in range(lo + span - 1, ctx) if seq[e - span + 1 : e + 1] == suffix]
        if ends:
            follows = seq[ends[-1] + 1 : ctx + 1]
            break
    flags = [float(follows is not None and j - 1 < len(follows) and follows[j - 1] == block[j])
             for j in range(1, len(block))]
    lead = next((i for i, f in enumerate(flags) if not f), len(flags))
    return runs + [float(lead)] + flags


def test_agreement_features_follow_their_definition():
    spec = FeatureSpec(agreement_window=24)
    assert spec.num_agreement == 2 * spec.num_positions + 1 and spec.width == len(spec.names())
    assert FeatureSpec(version="dscale-features-v2").num_agreement == 0
    rng = np.random.default_rng(5)
    n, r, w = 64, spec.agreement_window, spec.num_positions + 1
    seqs, ctxs, blocks = [], [], []
    for i in range(n):
        period = int(rng.integers(2, 9))
        base = rng.integers(0, 6, period).tolist()  # repeating text over a small vocabulary: many matches
        seq = [base[k % period] if rng.random() < 0.85 else int(rng.integers(0, 6)) for k in range(int(rng.integers(1, 60)))]
        ctx = len(seq) - 1
        drafts = [seq[(ctx + 1 + k) % len(seq)] if rng.random() < 0.7 else int(rng.integers(0, 6)) for k in range(w - 1)]
        seqs.append(seq), ctxs.append(ctx), blocks.append([seq[ctx]] + drafts)
    window = torch.zeros(n, r, dtype=torch.long)
    valid = torch.zeros(n, r, dtype=torch.bool)
    for i, (seq, ctx) in enumerate(zip(seqs, ctxs)):
        for k in range(r):
            if ctx - r + 1 + k >= 0:
                window[i, k], valid[i, k] = seq[ctx - r + 1 + k], True
    got = agreement_features(spec, window, valid, torch.tensor(blocks))
    want = torch.tensor([agreement_brute_force(s, c, b, spec) for s, c, b in zip(seqs, ctxs, blocks)])
    assert torch.equal(got, want)
    assert (want[:, : spec.num_positions] > 0).float().mean() > 0.5 and (want[:, spec.num_positions] > 0).any()
