"""Live calibration of the acceptance predictor (`dscale_runtime/dvl/calibration.py`).

Oracles: `calibrated_scores_ref` (np.interp per position) for the step's map; exact packing; a brute-force
isotonic fit; a synthetic served population whose true acceptance law is known and whose verify lengths come
from the runtime's own Algorithm 1 (censoring exactly as DScale censors), watched against its uncensored
labels; and target-only decoding for engines that calibrate while they serve.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dscale_runtime.config import SamplingParams
from dscale_runtime.dvl.allocate import allocate, budget_rows
from dscale_runtime.dvl.calibration import (
    LiveCalibration,
    calibrated_scores,
    calibrated_scores_ref,
    conditional_scores,
    fit_knots,
    identity_knots,
    isotonic,
    pack_unit,
    unpack_unit,
)
from dscale_runtime.dvl.predictor import seed_lengths

W = 16


def random_scores(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.sigmoid(2 * torch.randn(n, W - 1, generator=g) + 1).cummin(dim=1).values
    s[0] = 0.0  # a row of zeros (s_{j-1} = 0): conditionals 0
    s[1] = 1.0  # a certain row: conditionals 1
    return s


def test_identity_map_gives_the_raw_scores_and_any_map_equals_its_reference():
    s = random_scores(64, 0)
    x = conditional_scores(s)
    assert ((x >= 0) & (x <= 1)).all()
    assert torch.allclose(calibrated_scores(x, identity_knots(W - 1)), s, atol=1e-6)
    rng = np.random.default_rng(1)
    knots = np.sort(rng.random((W - 1, 9)), axis=1).astype(np.float32)
    got = calibrated_scores(x, torch.from_numpy(knots))
    np.testing.assert_allclose(got.numpy(), calibrated_scores_ref(x.numpy(), knots), atol=1e-6)
    assert (got[:, 1:] <= got[:, :-1] + 1e-7).all(), "calibrated scores must stay non-increasing"


def sequential_counts(cond: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Accepted counts drawn from true conditionals [R, P]: draft j is accepted with probability cond[:, j - 1]
    once drafts 1..j-1 were."""
    accepted = (rng.random(cond.shape) < cond).astype(np.int64)
    return np.cumprod(accepted, axis=1).sum(1)


def test_the_offline_fit_recovers_a_known_miscalibration():
    """Raw conditionals x whose true acceptance is 0.6 x^1.5 (a predictor that over-promises, as one trained on
    greedy traces does at T = 1): the fitted map is that law within sampling error, and P(accepted >= j) through
    it is calibrated."""
    from dscale_predictor.evaluate import ece

    rng = np.random.default_rng(3)
    x = rng.beta(3, 1.5, size=(20_000, W - 1))
    counts = sequential_counts(0.6 * x**1.5, rng)
    knots = fit_knots(x, counts)
    assert knots.shape == (W - 1, 9) and (np.diff(knots, axis=1) >= 0).all()
    grid = np.linspace(0, 1, 9)
    # Knots the data reaches (x >= 0.25 at the first two positions; later ones see fewer records at risk).
    np.testing.assert_allclose(knots[:2, 2:], np.broadcast_to(0.6 * grid[2:] ** 1.5, (2, 7)), atol=0.035)
    labels = counts[:, None] >= np.arange(1, W)[None, :]
    raw, fitted = np.cumprod(x, axis=1), calibrated_scores_ref(x, knots)
    for j in range(3):
        assert ece(raw[:, j], labels[:, j].astype(float)) > 0.15
        assert ece(fitted[:, j], labels[:, j].astype(float)) < 0.015


def test_the_predictors_temperature_bands_equal_their_reference(tmp_path):
    """`AcceptancePredictor.scores` with a calibration of bands at T = 0, 0.7, 1: each row goes through the map of
    its nearest temperature (ties to the lower), against `calibrated_scores_ref` row by row; it survives the
    artifact round trip, and the artifact's checks refuse bad maps."""
    from dscale_runtime.dvl.features import FeatureSpec, hidden_projection
    from dscale_runtime.dvl.predictor import (
        AcceptancePredictor,
        PredictorError,
        load_predictor,
        predictor_artifact,
    )

    spec = FeatureSpec()
    torch.manual_seed(0)
    model = AcceptancePredictor(spec, (16,)).eval()
    rng = np.random.default_rng(4)
    knots = np.sort(rng.random((3, W - 1, 9)), axis=2).astype(np.float32)
    model.set_calibration([0.0, 0.7, 1.0], torch.from_numpy(knots))
    temps = torch.tensor([0.0, 0.3, 0.35, 0.36, 0.7, 0.85, 0.86, 1.0, 2.0])
    x = torch.randn(len(temps), spec.width) * 2
    x[:, spec.temperature_column] = temps
    band = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    with torch.no_grad():
        raw, got = model.uncalibrated_scores(x), model.scores(x)
    cond = conditional_scores(raw).numpy()
    want = np.concatenate([calibrated_scores_ref(cond[i : i + 1], knots[b]) for i, b in enumerate(band)])
    np.testing.assert_allclose(got.numpy(), want, atol=1e-6)
    assert not torch.allclose(got, raw, atol=1e-3)

    art = predictor_artifact(model, {}, hidden_projection(spec, 32))
    torch.save(art, tmp_path / "p.pt")
    loaded, _ = load_predictor(tmp_path / "p.pt")
    assert loaded.calibration_temperatures == (0.0, 0.7, 1.0)
    with torch.no_grad():
        assert torch.equal(loaded.scores(x), got)
    for bad, match in ((knots[:2], "knots of shape"), (knots[:, :, ::-1].copy(), "non-decreasing"),
                       (knots * 2, "non-decreasing")):
        torch.save({**art, "calibration": {"temperatures": [0.0, 0.7, 1.0], "knots": torch.from_numpy(bad)}},
                   tmp_path / "bad.pt")
        with pytest.raises(PredictorError, match=match):
            load_predictor(tmp_path / "bad.pt")
    v1 = AcceptancePredictor(FeatureSpec.legacy(), (16,))
    with pytest.raises(PredictorError, match="carry no temperature"):
        v1.set_calibration([0.0, 1.0], torch.from_numpy(knots[:2]))


def test_packed_conditionals_round_trip_within_one_step():
    x = conditional_scores(random_scores(33, 2))
    words = pack_unit(x)
    assert words.shape == (33, 4) and words.dtype == torch.int64 and (words >= 0).all()
    np.testing.assert_allclose(unpack_unit(words.numpy(), W - 1), x.numpy(), atol=0.5 / 32767 + 1e-7)


def test_isotonic_is_the_weighted_least_squares_monotone_fit():
    rng = np.random.default_rng(3)
    for _ in range(20):
        v, w = rng.random(6), rng.random(6) + 0.1
        got = isotonic(v, w)
        assert (np.diff(got) >= -1e-12).all()
        # Brute force: the optimum is constant on blocks of a partition; try every partition into runs.
        best = np.inf
        for cuts in itertools.product([0, 1], repeat=5):
            edges = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [6]
            fit = np.concatenate([np.full(b - a, np.average(v[a:b], weights=w[a:b])) for a, b in zip(edges, edges[1:])])
            if (np.diff(fit) >= -1e-12).all():
                best = min(best, float((w * (fit - v) ** 2).sum()))
        assert float((w * (got - v) ** 2).sum()) == pytest.approx(best, abs=1e-10)


# ------------------------------------------------------------------ a served population with a known law
def drifted(x: np.ndarray) -> np.ndarray:
    """The true conditional acceptance after the move to sampling: well below the greedy-trained predictor."""
    return 0.72 * x**1.4


def serve(cal: LiveCalibration, steps: int, law, rng, batch: int = 16, ratio: float = 0.5, truth=None):
    """`steps` request-steps of a batch of 16: raw conditionals from a latent per-request quality, verify lengths
    by Algorithm 1 on the live map's scores, accepted = min(y, k - 1) with y drawn from the true law."""
    errors = []
    for _ in range(steps // batch):
        quality = rng.beta(5, 1.5, size=(batch, 1))
        x = np.clip(quality + 0.08 * rng.standard_normal((batch, W - 1)), 0.02, 0.99)
        x[:, 1:] = np.minimum(x[:, 1:], x[:, :1] + 0.1)
        knots = cal.knots if cal.apply else None
        xt = torch.from_numpy(x).float()
        scores = calibrated_scores(xt, torch.from_numpy(knots)) if knots is not None else torch.cumprod(xt, 1)
        k = allocate(scores, seed_lengths(scores, W), torch.ones(batch, dtype=torch.bool),
                     budget_rows(batch, W, ratio)).numpy()
        passed = rng.random((batch, W - 1)) < law(x)
        y = np.where(passed.all(1), W - 1, np.argmin(passed, axis=1))  # drafts before the first rejection
        cal.observe(x, np.minimum(y, k - 1).tolist(), k.tolist(), knots)
        if truth is not None:
            truth.observe(x, y.tolist(), [W] * batch, knots)
        errors.append(max(cal.report()["error"]))
    return errors


def test_live_calibration_recovers_from_a_drift_within_2000_request_steps():
    """Acceptance 3 on a population with a known law: calibrated traffic (greedy) for 1,500 request-steps, then
    a drift that leaves the raw predictor's P(accepted >= j) off by ~0.1. The censored live error (what
    /metrics reports) flags it, and the refreshed map brings it back under 0.03 at j = 1..3 within 2,000
    request-steps; the uncensored error over every request-step (each labelled by its full-width count) agrees,
    so censoring biases neither the fit nor the watch. Without the map (apply False) the error stays high."""
    rng = np.random.default_rng(0)
    cal, truth = LiveCalibration(W - 1, apply=True), LiveCalibration(W - 1, apply=False)
    before = serve(cal, 1504, lambda x: x, rng, truth=truth)
    assert before[-1] < 0.03 and max(truth.report()["error"]) < 0.03
    after = serve(cal, 2000, drifted, rng, truth=truth)
    assert max(after) > 0.035 and max(cal.report()["error_raw"]) > 0.2, "the drift must show in the live error"
    report, true = cal.report(), truth.report()
    assert max(report["error"]) < 0.03 and max(true["error"]) < 0.03, (report["error"], true["error"])
    assert max(report["error_raw"]) > 0.2  # the raw predictor is still off: the map made the difference
    assert report["refreshes"] >= 100
    grid = np.linspace(0, 1, cal.knots.shape[1])
    dense = grid >= 0.875  # where most conditionals lie: the map found the true law
    np.testing.assert_allclose(cal.knots[0, dense], drifted(grid[dense]), atol=0.05)

    off = LiveCalibration(W - 1, apply=False)
    serve(off, 1504, lambda x: x, np.random.default_rng(0))
    serve(off, 2000, drifted, rng)
    assert max(off.report()["error"]) > 0.2 and off.report()["refreshes"] == 0
    assert np.array_equal(off.knots, np.tile(grid, (W - 1, 1)).astype(np.float32))


def test_the_watch_drops_the_censored_positions_not_the_observed_failures():
    """A request-step that verified k - 1 = 2 drafts and accepted both says nothing about draft 3; one that
    rejected draft 1 says 'not >= 3' but is selected by its own failure: neither enters position 3's watch,
    only steps that verified position 3 do (selected by k alone)."""
    cal = LiveCalibration(W - 1, apply=False)
    x = np.full((3, W - 1), 0.875)  # on a knot: each sample weighs 1 in the fit
    cal.observe(x, accepted=[2, 0, 5], verify_lens=[3, 3, 9], knots=None)
    weight = cal.report()["weight"]
    assert weight[:3] == pytest.approx([3, 3, 1]) and weight[8] == pytest.approx(0)
    assert cal.report()["realised"][2] == pytest.approx(1.0)  # the one step that verified draft 3 accepted it
    fit_weight = cal.diag.sum(1)  # the conditional fit: verified and reached
    assert fit_weight[:3] == pytest.approx([3, 2, 1])


# ------------------------------------------------------------------ engines that calibrate while they serve
def test_a_calibrating_engine_changes_verify_lengths_never_tokens(pair, predictors):  # noqa: F811
    """Oracle drafts (the target's greedy continuation, corrupted at a random slot) and a heuristic predictor
    whose scores know nothing of where the corruption falls: the live map moves away from the identity, the
    verify lengths differ from the uncalibrated engine's, the calibrated scores are better calibrated than the
    raw ones (the same steps' watch), and every output equals target-only greedy decoding."""
    from test_engine import OracleDraftEngine, assert_same, make_engine, prompt_set
    from test_engine_dscale import dscale_engine

    prompts, _ = prompt_set(8, seed=7)
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    continuations = {str(i): o.token_ids for i, o in enumerate(make_engine(pair, "target").generate(prompts, long))}
    params = [SamplingParams(temperature=0, max_tokens=40 + 2 * i, ignore_eos=True) for i in range(len(prompts))]
    want = make_engine(pair, "target").generate(prompts, params)
    runs = {}
    for on in (True, False):
        engine = dscale_engine(pair, predictors["heuristic"], cls=OracleDraftEngine, max_running_requests=8,
                               live_calibration=on, keep_history=True, continuations=continuations)
        engine.calibration.refresh = 4  # NOTE: refresh often, so that this short run serves many maps
        assert_same(engine.generate(prompts, params), want)
        runs[on] = engine
    on, off = runs[True], runs[False]
    assert on.counters.accepted_drafts > on.counters.request_steps, "drafts must be accepted"
    assert on.calibration.report()["refreshes"] >= 8 and off.calibration.report()["refreshes"] == 0
    identity = identity_knots(W - 1).to(on.runner.calibration_knots.device)
    assert not torch.allclose(on.runner.calibration_knots, identity, atol=0.05), "the map must have moved"
    assert torch.equal(on.runner.calibration_knots.cpu(), torch.from_numpy(on.calibration.knots))
    assert off.runner.calibration_knots is None
    lens = lambda e: [k for s in e.counters.history for k in s.verify_lens]  # noqa: E731
    assert lens(on) != lens(off)
    report = on.calibration.report()
    assert all(e < r - 0.05 for e, r in zip(report["error"], report["error_raw"])), report


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from checkpoints import write_drafter, write_target

    root = tmp_path_factory.mktemp("pair")
    write_target(root / "target", tokenizer=True)
    write_drafter(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="module")
def predictors(pair, tmp_path_factory):
    from test_engine_dscale import save_predictor

    return {"heuristic": save_predictor(tmp_path_factory.mktemp("predictors"), pair, "heuristic")}


def written_map_decides(engine, prompts, params, want) -> None:
    """Write an all-zero map (every calibrated score 0: seeds 1, the budget's slots go to the first requests by
    Algorithm 1's tie order) and decode: every DScale step's verify lengths are what `allocate` gives those
    scores, and the tokens are still target-only's."""
    engine.calibration.refresh = 10**9  # NOTE: no refresh overwrites the written map during this run
    engine.calibration.knots = np.zeros_like(engine.calibration.knots)
    engine.runner.write_calibration(engine.calibration.knots)
    engine.keep_history = True
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    steps = [s for s in engine.counters.history if s.num_live > engine.config.full_width_max_batch]
    assert steps
    for s in steps:
        n = s.num_live
        expected = allocate(torch.zeros(n, W - 1), torch.ones(n, dtype=torch.long), torch.ones(n, dtype=torch.bool),
                            budget_rows(n, W, engine.config.budget_ratio))
        assert s.verify_lens == expected.tolist()


def test_the_step_reads_the_map_the_host_writes(pair, predictors):  # noqa: F811
    from test_engine import make_engine
    from test_engine_dscale import dscale_engine

    prompts = [[5, 9, 2, 7], [3, 1], list(range(1, 12)), [8] * 6]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = make_engine(pair, "target").generate(prompts, params)
    written_map_decides(dscale_engine(pair, predictors["heuristic"], max_running_requests=4, live_calibration=True), prompts,
                        params, want)
