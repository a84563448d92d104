"""The step runner (`dscale_runtime/runner.py`): buckets, step kinds, padding, and captured == eager on the GPU.

CPU: the buckets a batch walks through decode what one bucket per batch size decodes (padding never changes a
token), `prepare` builds every (bucket, mode) a batch can need, the interpreted Triton kernels decode what the
portable paths decode on bucketed steps. GPU (marker `gpu`): the captured steps decode exactly what the same
runner decodes eagerly, greedy and seeded-sampled, in every mode, and captured sampling keeps the target's
distribution.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch

from checkpoints import write_drafter, write_target
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.engine import Engine
from dscale_runtime.runner import StepKind, default_buckets

from markers import needs_cuda, needs_triton


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return (write_target(root / "target", layers=2),
            write_drafter(root / "drafter", layers=1, target_layer_ids=(0, 1), num_target_layers=2))


@pytest.fixture(scope="module")
def predictor(pair, tmp_path_factory):
    from test_engine_dscale import save_predictor

    return save_predictor(tmp_path_factory.mktemp("pred"), pair, "heuristic")


PROMPTS = [[5, 9, 2], [7] * 20, list(range(1, 18)), [3, 1], [11, 12, 13, 14], [2] * 9]
LENGTHS = [6, 17, 11, 3, 25, 9]  # requests finish at different steps: n walks down through the buckets


def run(pair, predictor, mode, buckets=None, params=None, **config):
    cfg = EngineConfig(**{"mode": mode, "max_running_requests": 6, "max_model_len": 96, "dtype": "float32",
                          "graph_buckets": buckets, **config})
    engine = Engine.from_pretrained(pair[0], pair[1] if mode != "target" else None,
                                    predictor=predictor if mode == "dscale" else None, config=cfg, keep_history=True)
    params = params or [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in LENGTHS]
    return [o.token_ids for o in engine.generate(PROMPTS, params)], engine


def test_default_buckets():
    assert default_buckets(1) == [1] and default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(32) == [1, 2, 4, 8, 12, 16, 20, 24, 28, 32] and default_buckets(10) == [1, 2, 4, 8, 10]
    assert default_buckets(90)[-6:] == [60, 64, 72, 80, 88, 90]
    with pytest.raises(ValueError, match="graph_buckets"):
        EngineConfig(max_running_requests=8, graph_buckets=(1, 4))


def test_staged_sampling_columns_are_the_feature_definition():
    """The predictor's sampling columns, staged by the host with the step's inputs, equal `sampling_features` over
    the staged rule and temperature (the device-side definition) for every rule, padding rows included, and after
    a smaller batch reuses the buffers; a spec without sampling columns gets none."""
    import numpy as np

    from dscale_runtime.dvl.features import FeatureSpec
    from dscale_runtime.runner import RULE_GREEDY, RULE_SAMPLED, RULE_TOP1, StepBuffers

    buf = StepBuffers(6, 3, 8, 16, torch.device("cpu"))
    spec = FeatureSpec(version="dscale-features-v3", num_positions=15)
    rng = np.random.default_rng(0)
    for n in (5, 2, 0, 6):
        sampling = [(1, 2, int(rng.integers(-1, 50)), int(rng.choice([RULE_GREEDY, RULE_TOP1, RULE_SAMPLED])),
                     float(rng.choice([1.0, 0.7, 1.3, 1e-3])), float(rng.uniform(0.5, 1.0))) for _ in range(n)]
        buf.fill([3] * n, [10] * n, [[1]] * n, sampling, 0, None)
        got, want = buf.sampling_columns(spec), buf.sampling_columns_ref(spec)
        assert got.shape == want.shape == (6, spec.num_sampling) and torch.equal(got, want), n
        assert torch.equal(got[n:], torch.zeros(6 - n, 2))  # padding rows: greedy, temperature column 0
    blind = FeatureSpec(version="dscale-features-v1", num_positions=15)  # no sampling columns
    assert buf.sampling_columns(blind).shape == buf.sampling_columns_ref(blind).shape == (6, 0)


def test_staged_tables_keep_the_pseudo_requests_scratch_row():
    """The step buffers' block tables carry one more row, on the scratch page, whatever was staged before: the
    packed layout's metadata takes them as they are and equals the one that appends that row."""
    from dscale_runtime.dvl.pack import flat_pack, packed_metadata
    from dscale_runtime.kv_cache import SCRATCH_PAGE
    from dscale_runtime.runner import StepBuffers

    buf = StepBuffers(4, 3, 8, 16, torch.device("cpu"))
    for n in (4, 2):
        buf.fill([3] * n, [20] * n, [[5, 6, 7]] * n, [(1, 2, -1, 0, 1.0, 1.0)] * n, 0, None)
        assert buf.tables_with_scratch.shape == (5, 3)
        assert buf.block_tables.data_ptr() == buf.tables_with_scratch.data_ptr()
        assert (buf.tables_with_scratch[-1] == SCRATCH_PAGE).all()
        assert (buf.block_tables[:n] == torch.tensor([5, 6, 7])).all() and (buf.block_tables[n:] == SCRATCH_PAGE).all()
        lens = torch.tensor([3, 1, 0, 2])
        block = torch.arange(4 * 16).view(4, 16)
        packed = flat_pack(lens, block, buf.ctx, buf.block_tables, 8, 16)
        got = packed_metadata(packed, buf.ctx, buf.tables_with_scratch, 64, 16)
        want = packed_metadata(packed, buf.ctx, buf.block_tables, 64, 16)
        assert torch.equal(got.block_tables, want.block_tables) and torch.equal(got.kv_lens, want.kv_lens)


def test_refilled_buffers_equal_buffers_filled_once():
    """A bucket's buffers carry nothing from one fill to the next: after every fill of a random sequence (batches
    growing and shrinking, tables longer and shorter, empty batches, context on and off), its ints and floats equal
    those of fresh buffers given only that fill (an empty batch once kept the last batch's temperatures)."""
    import numpy as np

    from dscale_runtime.runner import StepBuffers

    rng = np.random.default_rng(0)
    size, pages, num_context = 5, 7, 3
    reused = StepBuffers(size, pages, num_context, 16, torch.device("cpu"), dummy_slot=9)
    for step in range(60):
        n = int(rng.integers(0, size + 1))
        tables = [[int(p) for p in rng.integers(1, 50, int(rng.integers(0, pages + 1)))] for _ in range(n)]
        sampling = [tuple(int(v) for v in rng.integers(0, 9, 4)) + (float(rng.uniform(0.1, 2)), float(rng.uniform()))
                    for _ in range(n)]
        context = rng.standard_normal((n, num_context)).astype(np.float32) if step % 3 else None
        args = ([int(a) for a in rng.integers(0, 99, n)], [int(c) for c in rng.integers(0, 99, n)], tables, sampling,
                int(rng.integers(0, 40)), context, [int(x) for x in rng.integers(0, 8, n)] if step % 2 else None,
                [bool(h) for h in rng.integers(0, 2, n)] if step % 4 else None)
        fresh = StepBuffers(size, pages, num_context, 16, torch.device("cpu"), dummy_slot=9)
        reused.fill(*args)
        fresh.fill(*args)
        assert torch.equal(reused.dev_int, fresh.dev_int) and torch.equal(reused.dev_float, fresh.dev_float), step


@pytest.mark.parametrize("mode,config", [("target", {}), ("dflash", {}), ("dscale", {}),
                                         ("dscale", {"full_width_max_batch": 2})],
                         ids=["target", "dflash", "dscale", "dscale-full-width-2"])
def test_padding_into_buckets_changes_no_token(pair, predictor, mode, config):
    """Default buckets (batches of 3 and 5 run padded in buckets of 4 and 6) against one bucket per size."""
    seeded = [SamplingParams(temperature=1.0 if i % 2 else 0, max_tokens=m, ignore_eos=True, seed=i)
              for i, m in enumerate(LENGTHS)]
    for params in (None, seeded):
        padded, engine = run(pair, predictor, mode, params=params, **config)
        exact, plain = run(pair, predictor, mode, buckets=(1, 2, 3, 4, 5, 6), params=params, **config)
        assert padded == exact
        assert {4, 6} <= {size for size, _ in engine.runner.steps} and {3, 5} <= {size for size, _ in plain.runner.steps}
        if params is None:
            assert [h.verify_lens for h in engine.counters.history] == [h.verify_lens for h in plain.counters.history]
            if mode == "dscale" and not config:
                assert any(len(set(h.verify_lens)) > 1 for h in engine.counters.history)  # the decision ran


def test_prepare_builds_every_bucket_and_mode_a_batch_can_need(pair, predictor):
    cfg = EngineConfig(mode="dscale", max_running_requests=6, max_model_len=96, dtype="float32",
                       full_width_max_batch=3)
    engine = Engine.from_pretrained(pair[0], pair[1], predictor=predictor, config=cfg)
    runner = engine.runner
    assert runner.buckets == [1, 2, 4, 6] and not runner.steps  # on the CPU nothing is built up front
    assert [runner.mode_for(n) for n in range(1, 7)] == ["dflash"] * 3 + ["dscale"] * 3
    kinds = engine._serving_kinds()
    assert len(kinds) == 5 and StepKind("dscale") in kinds
    runner.prepare(kinds)
    modes = {(size, kind.mode) for size, kind in runner.steps}
    assert modes == {(1, "dflash"), (2, "dflash"), (4, "dflash"), (4, "dscale"), (6, "dscale")}
    assert len(runner.steps) == 5 * len(modes)
    assert runner.steps[(6, StepKind("dscale"))].num_rows == 48
    assert runner.steps[(4, StepKind("dflash"))].num_rows == 64


@pytest.mark.parametrize("mode", ["target", "dflash", "dscale"])
def test_eager_steps_attend_over_the_live_context(pair, predictor, mode, monkeypatch):
    """Issue 24: an eager decode step's attention width (`AttentionMetadata.max_kv`) follows the live context,
    not max_pages x page_size (max_model_len), under the overlap schedule too (rows that start from the device
    state: the host's bound holds, at most a block loose), and decodes what the static width decodes, greedy
    and seeded-sampled."""
    import dscale_runtime.kernels as kernels
    from dscale_runtime.runner import BucketStep, StepBuffers

    params = [SamplingParams(temperature=1.0 if i % 2 else 0, max_tokens=m, ignore_eos=True, seed=i)
              for i, m in enumerate(LENGTHS)]
    widths, bounds, stepping = [], [], [False]
    attention, kv_width, bucket_step = kernels.paged_attention_ref, StepBuffers.kv_width, BucketStep.step

    def recording_attention(q, k_cache, v_cache, meta, page_size, scale):
        assert int(meta.kv_lens.max()) <= meta.max_kv  # no visible key is cut off
        if stepping[0]:
            widths.append(meta.max_kv)
        return attention(q, k_cache, v_cache, meta, page_size, scale)

    def recording_width(buf, width):
        bounds.append((buf.ctx_bound, int(buf.ctx.max()), bool((buf.host == 0).any())))
        return kv_width(buf, width)

    def recording_step(step):
        stepping[0] = True
        try:
            return bucket_step(step)
        finally:
            stepping[0] = False

    monkeypatch.setattr(kernels, "paged_attention_ref", recording_attention)
    monkeypatch.setattr(StepBuffers, "kv_width", recording_width)
    monkeypatch.setattr(BucketStep, "step", recording_step)
    got, engine = run(pair, predictor, mode, params=params, max_model_len=1024)
    runner = engine.runner
    static = runner.buffers[runner.buckets[-1]].max_kv
    assert static >= 1024 and widths
    longest = max(len(p) + m for p, m in zip(PROMPTS, LENGTHS)) + 2 * runner.block_size
    assert max(widths) <= -(-longest // 16) * 16 < static // 8
    assert any(ahead for _, _, ahead in bounds), "no step started from the device state"
    for bound, exact, ahead in bounds:
        assert bound is not None and exact <= bound <= exact + (runner.block_size if ahead else 0)
    monkeypatch.setattr(StepBuffers, "kv_width", lambda buf, width: buf.max_kv)  # the static width (before)
    widths.clear()
    want, _ = run(pair, predictor, mode, params=params, max_model_len=1024)
    assert set(widths) == {static}
    assert got == want


@needs_triton
def test_bucketed_dscale_step_through_the_interpreted_kernels(pair, predictor, monkeypatch):
    """Buckets leave more placeholder rows than W (M fixed per bucket, M_live per batch): the Triton paths
    (interpreter on CPU) must skip them and decode what the portable paths decode."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA run of this comparison is the gpu test below")
    # NOTE: 2, 3, 2, 1, 5, 2 tokens: n still walks 6 -> 4 -> ... -> 1 (every interpreted step costs ~20 s in CI)
    params = [SamplingParams(temperature=0, max_tokens=m // 6 + 1, ignore_eos=True) for m in LENGTHS]
    want, _ = run(pair, predictor, "dscale", params=params)
    for var in ("DSCALE_ATTENTION", "DSCALE_FUSED"):
        monkeypatch.setenv(var, "triton")
    # NOTE: the features kernel reads each request's drafts, not the packed rows, and its interpreted tl.topk was most
    # of this test's minute in CI; test_interpreter_engine_tokens_equal_portable_path runs it in an engine whose
    # bucket holds a placeholder request, tests/test_kernels_features.py against its reference
    monkeypatch.setenv("DSCALE_FEATURES", "ref")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got, engine = run(pair, predictor, "dscale", params=params)
    finally:
        torch.set_num_threads(threads)
    assert engine.runner.features_backend == "ref"
    assert (engine.target.kernels.attention, engine.target.kernels.fused) == ("triton", "triton")
    assert got == want
    assert any(size > 2 for size, _ in engine.runner.steps)


# ------------------------------------------------------------------------------------------------- GPU
def demo_engine(mode: str, graphs: bool, drafter: str = "drafter", **config) -> Engine:
    """The demo pair on CUDA in fp32 (`drafter`: 'drafter2' runs the DFlash 2 drafter, DScale with its predictor)."""
    from dscale_runtime.demo.prompts import DEMO_DIR

    config.setdefault("dscale_policy", "always")  # DScale's own steps (the measured policy may pick DFlash's)
    config.setdefault("target_fallback", False)  # speculative steps only (the fallback may pick target-only ones)
    config.setdefault("max_running_requests", 8)  # NOTE: 4 buckets (1, 2, 4, 8) to capture, the GPU suite's time
    # NOTE: eager prefill in both engines of a comparison: captured prefill pads chunks to token buckets, whose other
    # matmul shapes round the logits differently, and a sampled draw that falls within that rounding of a boundary
    # picks another token (tests/test_gpu.py compares captured prefill with eager prefill); it also keeps each
    # engine's start-up (prefill capture and timing) out of these decode-step tests' time in the one-process GPU suite.
    config.setdefault("prefill_graphs", False)
    cfg = EngineConfig(mode=mode, device="cuda", dtype="float32", max_model_len=1024, step_graphs=graphs, **config)
    predictor = DEMO_DIR.parent / ("demo_dflash2.pt" if drafter == "drafter2" else "demo.pt")
    return Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / drafter if mode != "target" else None,
                                  predictor if mode == "dscale" else None, config=cfg)


@functools.cache
def greedy_oracle() -> tuple[list[str], SamplingParams, list[list[int]]]:
    """16 held-out prompts x 32 greedy tokens and captured target-only's tokens for them, its step's index work on
    the torch reference (`DSCALE_DECISION=ref`; the served default takes the Triton kernels): the oracle of the
    policy tests (computed once per process, by whichever test asks first)."""
    from dscale_runtime.demo.prompts import stdlib_prompts

    prompts = [p["prompt"] for p in stdlib_prompts()[:16]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DSCALE_DECISION", "ref")
        engine = demo_engine("target", True)
        assert engine.runner.decision_backend == "ref"
    return prompts, params, [o.token_ids for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("mode", ["target", "dflash", "dscale"])
@pytest.mark.gpu
@needs_cuda
def test_captured_steps_equal_eager_steps_on_the_demo_pair(mode):
    """Greedy, seeded T=1 (sampled drafts under the auto rule) and seeded T=0.7/top_p 0.8 (top-1 rule) requests
    in one batch: graphs on and off decode the same tokens, with the overlap schedule and without. Overlap on
    and off decode the same greedy tokens; their sampled tokens may differ: the overlap schedule runs other
    batch compositions (a finished request's last step is discarded a step later), other batch shapes round
    the logits differently, and a draw that falls within that rounding of a boundary picks the next token."""
    from dscale_runtime.demo.prompts import stdlib_prompts

    prompts = [p["prompt"] for p in stdlib_prompts()[:15]]
    points = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8)]
    params = [SamplingParams(temperature=points[i % 3][0], top_p=points[i % 3][1], max_tokens=36, ignore_eos=True,
                             seed=i) for i in range(len(prompts))]
    tokens = {}
    for graphs, overlap in ((False, True), (True, True), (False, False), (True, False)):
        engine = demo_engine(mode, graphs, overlap_schedule=overlap)
        tokens[graphs, overlap] = [o.token_ids for o in engine.generate(prompts, params)]
        if graphs:
            assert engine.runner.steps and all(s.call.graph is not None for s in engine.runner.steps.values())
            if mode != "target":
                assert engine.counters.accepted_drafts > 0.5 * engine.counters.request_steps
    assert tokens[True, True] == tokens[False, True]
    assert tokens[True, False] == tokens[False, False]
    assert tokens[True, True][::3] == tokens[True, False][::3]  # the greedy requests


@pytest.mark.parametrize("mode", ["dflash", "dscale"])
@pytest.mark.gpu
@needs_cuda
def test_captured_steps_over_the_demo_dflash2_drafter(mode):
    """The shipped DFlash 2 drafter (and DScale with its v3 predictor, whose agreement columns read the token ring
    inside the captured step): greedy output equals captured target-only's; greedy and seeded T = 1 requests decode
    the same tokens with graphs on and off."""
    prompts, greedy, want = greedy_oracle()
    params = [greedy if i % 2 == 0 else SamplingParams(temperature=1.0, max_tokens=greedy.max_tokens,
                                                       ignore_eos=True, seed=i) for i in range(len(prompts))]
    tokens = {}
    for graphs in (False, True):
        engine = demo_engine(mode, graphs, drafter="drafter2")
        tokens[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        assert tokens[graphs][::2] == want[::2], graphs
        if graphs:
            assert engine.runner.steps and all(s.call.graph is not None for s in engine.runner.steps.values())
            assert engine.counters.accepted_drafts > engine.counters.request_steps
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("mode", ["target", "dflash", "dscale"])
@pytest.mark.gpu
@needs_cuda
def test_captured_steps_through_the_step_kernels(mode, monkeypatch):
    """With the step's Triton kernels (`KernelChoice.decision='triton'`: metadata, acceptance and result rows, state,
    DScale's decision): greedy output equals captured target-only's on the reference kernels, and greedy, seeded
    T = 1 (sampled drafts) and T = 0.7 / top_p 0.8 requests decode the same tokens with graphs on and off."""
    prompts, greedy, want = greedy_oracle()  # NOTE: the reference kernels' oracle
    monkeypatch.setenv("DSCALE_DECISION", "triton")
    points = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8)]
    params = [SamplingParams(temperature=points[i % 3][0], top_p=points[i % 3][1], max_tokens=greedy.max_tokens,
                             ignore_eos=True, seed=i) for i in range(len(prompts))]
    tokens = {}
    for graphs in (False, True):
        engine = demo_engine(mode, graphs)
        assert engine.runner.decision_backend == "triton"
        tokens[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        assert tokens[graphs][::3] == want[::3], graphs
        if graphs:
            assert engine.runner.steps and all(s.call.graph is not None for s in engine.runner.steps.values())
    assert tokens[True] == tokens[False]


@pytest.mark.gpu
@needs_cuda
def test_captured_calibrated_steps_equal_eager_steps():
    """DScale's live calibration map is a fixed-address tensor the host rewrites between replays: refreshed
    every 16 request-steps, graphs on and off decode the same tokens (greedy and seeded top-1 T = 1, which
    equal target-only's) and the maps move; then an all-zero map written in place decides the captured steps'
    verify lengths exactly as `allocate` does for those scores (`test_calibration.written_map_decides`)."""
    from dscale_runtime.demo.prompts import stdlib_prompts
    from test_calibration import written_map_decides

    prompts = [p["prompt"] for p in stdlib_prompts()[:16]]
    params = [SamplingParams(temperature=float(i % 2), max_tokens=48, ignore_eos=True, seed=i) for i in range(16)]
    want = demo_engine("target", True).generate(prompts, params)
    for graphs in (False, True):
        engine = demo_engine("dscale", graphs, sampling_rule="top1", live_calibration=True)
        engine.calibration.refresh = 16
        assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in want], graphs
        assert engine.calibration.report()["refreshes"] >= 10
        assert torch.equal(engine.runner.calibration_knots.cpu(), torch.from_numpy(engine.calibration.knots))
        assert not torch.allclose(engine.runner.calibration_knots.cpu(), torch.linspace(0, 1, 9).expand(15, -1),
                                  atol=0.02)
        if graphs:
            assert all(s.call.graph is not None for s in engine.runner.steps.values())
            written_map_decides(engine, prompts[:8], params[:8], want[:8])


@pytest.mark.gpu
@needs_cuda
def test_measured_policy_times_every_bucket_and_keeps_greedy_output():
    """DScale's default policy on CUDA: every bucket's DFlash and DScale steps timed after capture, each bucket
    running the faster one; greedy output still equals target-only output."""
    prompts, params, want = greedy_oracle()
    engine = demo_engine("dscale", True, dscale_policy="measured")
    runner = engine.runner
    assert sorted(runner.bucket_modes) == runner.buckets == sorted(runner.policy_ms)
    for size, times in runner.policy_ms.items():
        assert times["dflash"] > 0 and times["dscale"] > 0
        assert runner.bucket_modes[size] == ("dscale" if times["dscale"] <= times["dflash"] else "dflash")
        assert engine.step_policy[size]["mode"] == runner.bucket_modes[size]
    if "dscale" not in runner.bucket_modes.values():  # NOTE: a DFlash engine: neither history nor token ring
        assert runner.state.history is None and runner.state.tokens is None and runner.token_ring == 0
        assert engine.prefiller.tail_width == 0
    else:
        assert runner.state.tokens is not None and engine.prefiller.tail_width == runner.token_ring > 0
    assert [o.token_ids for o in engine.generate(prompts, params)] == want


@pytest.mark.gpu
@needs_cuda
def test_live_policy_serves_only_captured_steps_and_keeps_greedy_output():
    """dscale_policy='live' with the target fallback: every step the live choice may pick in a bucket is captured
    for every serving kind at start-up (no capture while serving), and greedy output equals target-only's."""
    import dataclasses

    prompts, params, want = greedy_oracle()
    engine = demo_engine("dscale", True, dscale_policy="live", target_fallback=True)
    runner = engine.runner
    for n in range(1, runner.buckets[-1] + 1):
        for mode in runner.live_modes(n):
            for kind in engine._serving_kinds():
                kind = dataclasses.replace(kind, mode=mode, draft_sampling=kind.draft_sampling and mode != "target")
                assert (runner.bucket(n), kind) in runner.steps, (n, kind)
    captured = len(runner.steps)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert len(runner.steps) == captured, "a step was captured while serving"


@pytest.mark.gpu
@needs_cuda
def test_target_fallback_times_target_steps_and_keeps_greedy_output():
    """Speculative engines with graphs time every bucket's target-only step beside their own; with start-up
    times that make speculation lose at the live acceptance, their target-only steps (which leave the drafter's
    context to a catch-up before the next speculative step) and the probes between them still decode target-only's
    greedy tokens."""
    prompts, params, want = greedy_oracle()
    for mode in ("dflash", "dscale"):
        engine = demo_engine(mode, True, target_fallback=True)
        runner = engine.runner
        assert all({"target", runner.mode_for(b)} <= set(runner.policy_ms[b]) for b in runner.buckets)
        assert [o.token_ids for o in engine.generate(prompts, params)] == want
        for times in runner.policy_ms.values():  # speculation now costs 100 target steps
            times.update({step: 100 * times["target"] for step in times if step != "target"})
        assert [o.token_ids for o in engine.generate(prompts, params)] == want
        assert engine.counters.steps_by_mode["target"] > 0, engine.counters.steps_by_mode


@pytest.mark.gpu
@needs_cuda
def test_target_only_steps_leave_the_drafter_context_to_a_captured_catch_up(monkeypatch):
    """Captured steps and captured prefill, the overlap schedule on: a forced pattern of target-only steps (which
    skip the drafter's context) and DFlash steps (before which the engine writes it, `Engine._catch_up_context`, in
    prefill replays) decodes target-only's greedy tokens, and its DFlash steps accept about what those of an engine
    whose target-only steps write the context do (the pattern differs by the step each catch-up waits for its
    tokens; on the CPU, without the catch-up, the same steps accept half as much: tests/test_demo_pair.py)."""
    import itertools

    from dscale_runtime.runner import StepRunner

    prompts, params, want = greedy_oracle()

    def per_draft_step(defer: bool) -> tuple[Engine, float]:
        monkeypatch.setattr(StepRunner, "DEFER_CONTEXT", defer)
        engine = demo_engine("dflash", True, target_fallback=True, prefill_graphs=defer)
        steps = itertools.count()
        engine._mode_for = lambda n, probe=True: "target" if next(steps) % 7 < 4 else "dflash"
        engine.keep_history = True
        assert [o.token_ids for o in engine.generate(prompts, params)] == want
        rows = [a for step in engine.counters.history for a, k in zip(step.accepted_lens, step.verify_lens) if k > 1]
        return engine, sum(rows) / len(rows)

    deferred, accepted = per_draft_step(True)
    writing, reference = per_draft_step(False)
    assert deferred.counters.context_tokens > 0 and writing.counters.context_tokens == 0
    assert accepted >= 0.8 * reference > 0.8, (accepted, reference)


@pytest.mark.gpu
@needs_cuda
def test_chunked_prefill_and_prefix_caching_keep_greedy_output_on_cuda():
    """Prompts sharing long prefixes, prefilled in 48-token chunks from cached pages (Triton attention over a
    cached context), decode target-only's greedy tokens (target-only without caching or chunks as the oracle)."""
    from dscale_runtime.demo.prompts import stdlib_prompts

    base = [p["prompt"] for p in stdlib_prompts()[:6]]
    prompts = [base[i % 3] * 3 + base[3 + i % 3] for i in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in demo_engine("target", True, prefix_caching=False, chunked_prefill_tokens=0,
                                             max_running_requests=4).generate(prompts, params)]
    for mode in ("target", "dflash", "dscale"):
        engine = demo_engine(mode, True, chunked_prefill_tokens=48, max_running_requests=4)
        assert [o.token_ids for o in engine.generate(prompts, params)] == want, mode
        assert engine.prefix_cache_stats["hit_tokens"] > 0


@pytest.mark.gpu
@needs_cuda
def test_captured_top1_sampling_equals_captured_target_only_sampling():
    from dscale_runtime.demo.prompts import stdlib_prompts

    prompts = [p["prompt"] for p in stdlib_prompts()[:16]]
    params = [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=100 + i) for i in range(16)]
    want = [o.token_ids for o in demo_engine("target", True).generate(prompts, params)]
    for mode in ("dflash", "dscale"):
        got = [o.token_ids for o in demo_engine(mode, True, sampling_rule="top1").generate(prompts, params)]
        assert got == want, mode


@pytest.mark.parametrize("mode,rule,ratio", [("dflash", "sampled", 0.5), ("dscale", "top1", 0.25),
                                             ("dscale", "sampled", 0.5)])
@pytest.mark.gpu
@needs_cuda
def test_captured_sampling_has_the_target_distribution(tmp_path, mode, rule, ratio):
    from test_engine_dscale import save_predictor
    from test_sampling import PROMPT, exact_sequence_probs, goodness_of_fit

    target = write_target(tmp_path / "target", vocab=8, hidden=32, seed=5)
    drafter = write_drafter(tmp_path / "drafter", vocab=8, mask_token_id=7, seed=6)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)
    exact = exact_sequence_probs(target, params)
    predictor = save_predictor(tmp_path, (target, drafter), "untrained", 3) if mode == "dscale" else None
    cfg = EngineConfig(mode=mode, max_model_len=32, max_running_requests=256, seed=11, budget_ratio=ratio,
                       sampling_rule=rule, device="cuda", dtype="float32", step_graphs=True, dscale_policy="always",
                       target_fallback=False, graph_buckets=(16, 64, 256))  # NOTE: 3 buckets, not default_buckets' 40
    engine = Engine.from_pretrained(target, drafter, predictor=predictor, config=cfg)
    counts = collections.Counter(tuple(o.token_ids) for o in engine.generate([PROMPT] * 3000, params))
    assert engine.counters.accepted_drafts > 300
    assert goodness_of_fit(counts, exact) > 1e-3


def test_step_results_compare_arrays_element_by_element():
    """Graph replay == eager compares whole `StepResult`s; DScale steps carry arrays (conditionals), which the
    generated dataclass `__eq__` cannot compare. Timings never count."""
    import numpy as np

    from dscale_runtime.runner import StepResult

    def result(conditionals=None, features=None, device_ms=1.0):
        return StepResult([1, 0], [5, 6], [3, 2], None, [[1, 2], [3, 4]], 5, features, device_ms, conditionals)

    cond = np.array([[0.5, 0.25], [1.0, 0.0]])
    assert result(cond.copy(), device_ms=1.0) == result(cond.copy(), device_ms=2.0)
    assert result(cond) != result(cond + np.array([[0.0, 2.0 ** -15], [0.0, 0.0]]))
    assert result(cond) != result(None) and result(None) != result(cond) and result(None) == result(None)
    assert result(cond) != result(cond[:1])
    feats = torch.ones(2, 3)
    assert result(features=feats) == result(features=feats.clone())
    assert result(features=feats) != result(features=feats * 2) and result(features=feats) != result()
    assert result() != "a result"
