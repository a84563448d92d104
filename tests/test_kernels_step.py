"""The step's index work in Triton (`kernels/triton_step.py`) against the torch definitions: the block and its
metadata (`runner.block_metadata`), acceptance with the drafter's kept slots and the result row (`verify.accept_greedy`
and `BucketStep.verify`'s reference), DScale's conditionals (`dvl.calibration`). Exact, in the interpreter on CPU
machines with triton installed; the compiler offline for sm_90; the compiled kernels on CUDA (marker `gpu`); and
engines whose steps run through them, against the same engines on the reference."""

from __future__ import annotations

import collections

import pytest
import torch

from markers import needs_cuda, needs_triton
from test_engine import OracleDraftEngine, assert_same, make_engine, pair, prompt_set  # noqa: F401 - fixture
from test_engine_dscale import predictors  # noqa: F401 - fixture
from dscale_runtime.config import SamplingParams
from dscale_runtime.dvl.calibration import calibrated_scores, conditional_scores, identity_knots, pack_unit
from dscale_runtime.dvl.pack import flat_pack
from dscale_runtime.verify import accept_greedy

W, PAGE, PAGES = 16, 16, 6
FIELDS = ("row_req", "row_local", "positions", "slot_mapping", "kv_lens", "query_starts", "query_lens")


def buffers(seed: int, n: int, width: int, device: str):
    from dscale_runtime.runner import StepBuffers

    gen = torch.Generator().manual_seed(seed)
    buf = StepBuffers(n, PAGES, 8, PAGE, torch.device(device))
    buf.ctx.copy_(torch.randint(0, PAGES * PAGE - width + 1, (n,), generator=gen))
    buf.block_tables.copy_(torch.randint(1, 99, (n, PAGES), generator=gen))
    buf.anchor.copy_(torch.randint(0, 90, (n,), generator=gen))
    return buf


def check_metadata(seed: int, n: int, width: int, causal: bool, device: str = "cpu") -> None:
    from dscale_runtime.kernels.triton_step import block_metadata_triton
    from dscale_runtime.runner import block_metadata

    buf = buffers(seed, n, width, device)
    want = block_metadata(buf, width, causal, max_kv=77)
    got, block = block_metadata_triton(buf.ctx, buf.block_tables, PAGE, width, causal, 77, buf.anchor, 93)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), (seed, n, width, name)
    assert (got.max_q, got.max_kv, got.causal) == (want.max_q, want.max_kv, want.causal)
    drafted = torch.full((n, width), 93, device=device)
    drafted[:, 0] = buf.anchor
    assert torch.equal(block, drafted)
    assert block_metadata_triton(buf.ctx, buf.block_tables, PAGE, width, causal, 77)[1] is None


@needs_triton
@pytest.mark.parametrize("n,width", [(1, 1), (32, 1), (3, W), (13, W), (40, 8)])
def test_triton_block_metadata_equals_the_reference(interpreter, n, width):
    """Every row's request, slot, position and cache slot, every request's keys and query bounds, and the block
    the drafter fills (anchor, then mask tokens), equal `runner.block_metadata` (W = 1: target-only steps)."""
    check_metadata(n, n, width, causal=width == 1)


def acceptance_case(seed: int, n: int, dscale: bool, device: str = "cpu"):
    """A step's verification over block [n, W]: full width, or DScale's packed layout (verify lens 0..W, padding
    requests with k = 0, placeholder rows past the live ones); target tokens that match each request's drafts up to
    a random slot (or all of them), then differ."""
    from dscale_runtime.runner import block_metadata

    gen = torch.Generator().manual_seed(seed)
    buf = buffers(seed, n, W, "cpu")
    block = torch.randint(0, 50, (n, W), generator=gen)
    live = (torch.rand(n, generator=gen) > 0.2).long()
    live[0] = 1
    if dscale:
        lens = torch.where(live > 0, torch.randint(1, W + 1, (n,), generator=gen), 0)
        rows = int(lens.sum()) + int(torch.randint(0, 9, (1,), generator=gen))
        packed = flat_pack(lens, block, buf.ctx, buf.block_tables, rows, PAGE)
        meta = {"row_req": packed.row_req, "row_local": packed.row_local, "slot_mapping": packed.slot_mapping}
        offsets = packed.verify_offsets
    else:
        full = block_metadata(buf, W, causal=True)
        meta = {name: getattr(full, name) for name in ("row_req", "row_local", "slot_mapping")}
        lens, offsets, rows = full.query_lens, full.query_starts, n * W
    tokens = torch.randint(50, 60, (rows,), generator=gen)  # NOTE: never a draft, unless copied below
    for i in range(n):
        reach = int(torch.randint(0, W, (1,), generator=gen))  # the first draft slot that differs (0: none)
        for s in range(int(lens[i]) - 1):
            if reach == 0 or s + 1 < reach:
                tokens[offsets[i] + s] = block[i, s + 1]
    import types

    meta = types.SimpleNamespace(**{k: v.to(device) for k, v in meta.items()})
    return [t.to(device) for t in (tokens, block, lens, offsets, live)] + [meta]


def reference_result(tokens, block, lens, offsets, live, meta, accepted=None, successor=None, full=None, extra=None):
    """`BucketStep.verify`'s torch path after the target's tokens: the result row and the kept cache slots."""
    n = block.shape[0]
    if accepted is None:
        accepted, successor = accept_greedy(tokens, block, lens, offsets)
    req = meta.row_req.clamp(max=n - 1)
    keep = (meta.row_req < n) & (meta.row_local <= accepted[req]) & (live[req] > 0)
    kept = torch.where(keep, meta.slot_mapping, torch.zeros_like(meta.slot_mapping))
    full = torch.full_like(lens, -1) if full is None else full
    parts = [torch.stack([accepted, successor, lens, full], dim=1), block] + ([extra] if extra is not None else [])
    return torch.cat(parts, dim=1), kept


def check_acceptance(seed: int, n: int, dscale: bool, device: str = "cpu") -> None:
    from dscale_runtime.kernels.triton_step import accept_triton

    tokens, block, lens, offsets, live, meta = acceptance_case(seed, n, dscale, device)
    want, kept_want = reference_result(tokens, block, lens, offsets, live, meta)
    got, kept = accept_triton(tokens, block, lens, offsets, live, meta, PAGE, keep=True)
    assert torch.equal(got, want), (seed, n, dscale)
    assert torch.equal(kept, kept_want), (seed, n, dscale)
    assert len(set(want[:, 0].tolist())) > 2 or n < 8  # NOTE: the cases spread the accepted counts
    # A sampled-drafts step's own counts (strided columns), a retention count and DScale's packed conditionals.
    gen = torch.Generator().manual_seed(seed + 1)
    given = torch.stack([torch.minimum(torch.randint(0, W, (n,), generator=gen), (lens - 1).clamp(min=0).cpu()),
                         torch.randint(0, 90, (n,), generator=gen)], dim=1).to(device)
    full = torch.randint(0, W, (n,), generator=gen).to(device)
    extra = torch.randint(0, 2**60, (n, 4), generator=gen).to(device)
    want, kept_want = reference_result(tokens, block, lens, offsets, live, meta, given[:, 0], given[:, 1], full, extra)
    got, kept = accept_triton(tokens, block, lens, offsets, live, meta, PAGE, keep=True,
                              given=(given[:, 0], given[:, 1]), full_accepted=full, extra=extra)
    assert torch.equal(got, want) and torch.equal(kept, kept_want), (seed, n, dscale)
    got, none = accept_triton(tokens, block, lens, offsets, live, meta, PAGE, keep=False)
    assert none is None and torch.equal(got, reference_result(tokens, block, lens, offsets, live, meta)[0])


@needs_triton
@pytest.mark.parametrize("n,dscale", [(1, False), (9, False), (1, True), (13, True), (40, True)])
def test_triton_acceptance_and_result_equal_the_reference(interpreter, n, dscale):
    """Accepted counts, successors, the kept cache slots of the verified rows and the result row equal the runner's
    torch path, over full-width and packed layouts (padding requests, placeholder rows), with the top-1 rule in
    the kernel or a sampled-drafts step's counts passed in."""
    check_acceptance(n, n, dscale)


def score_cases(device: str = "cpu"):
    """Predictor scores [n, 15] (cumulative products; rows that reach 0; conditionals of exactly 0.5, where the
    15-bit rounding is half to even) and knot maps: none, the identity, a random monotone one."""
    gen = torch.Generator().manual_seed(4)
    raw = torch.rand(37, W - 1, generator=gen)
    raw[3, 5:] = 0.0
    raw[4, 0] = 0.0
    raw[5] = 0.5
    raw[6, ::2] = 1.0
    scores = torch.cumprod(raw, 1)
    knots = torch.cumsum(torch.rand(W - 1, 9, generator=gen), 1)
    knots = (knots - knots[:, :1]) / (knots[:, -1:] - knots[:, :1])
    return scores.to(device), [None, identity_knots(W - 1).to(device), knots.contiguous().to(device)]


def check_conditionals(device: str = "cpu", exact: bool = True) -> None:
    from dscale_runtime.kernels.triton_step import conditionals_triton

    scores, maps = score_cases(device)
    for knots in maps:
        conditionals = conditional_scores(scores)
        packed, calibrated = conditionals_triton(scores, knots)
        assert torch.equal(packed, pack_unit(conditionals))
        if knots is None:
            assert calibrated is scores
            continue
        want = calibrated_scores(conditionals, knots)
        assert torch.equal(calibrated, want) if exact else torch.allclose(calibrated, want, rtol=1e-6, atol=1e-7)
    assert (pack_unit(conditional_scores(scores))[5, 0] & (2**15 - 1)) == 16384  # NOTE: 16383.5 rounds to even
    # the predictor's uncalibrated scores through its artifact's map first: one map for every row (a stride-0 view,
    # as `band_knots` gives for one band) or a map per row (several bands), then with or without the live map
    gen = torch.Generator().manual_seed(5)
    bands = torch.cumsum(torch.rand(3, W - 1, 5, generator=gen), 2)
    bands = ((bands - bands[..., :1]) / (bands[..., -1:] - bands[..., :1])).to(device)
    band = torch.randint(0, 3, (scores.shape[0],), generator=gen).to(device)
    for art in (bands[1].expand(scores.shape[0], -1, -1), bands.index_select(0, band)):
        first = calibrated_scores(conditional_scores(scores), art)  # `AcceptancePredictor.scores`
        for knots in maps:
            packed, calibrated = conditionals_triton(scores, knots, art)
            conditionals = conditional_scores(first)
            want = first if knots is None else calibrated_scores(conditionals, knots)
            if exact:
                assert torch.equal(packed, pack_unit(conditionals)) and torch.equal(calibrated, want)
            else:  # NOTE: torch's CUDA cumprod rounds otherwise: the packed words may differ in the last unit
                assert torch.allclose(calibrated, want, rtol=1e-6, atol=1e-7)


@needs_triton
def test_triton_conditionals_equal_the_reference(interpreter):
    """The packed raw conditionals equal `pack_unit(conditional_scores(...))` bit for bit, and the calibrated
    scores `calibrated_scores(...)` (the same fp32 products, left to right, as torch's CPU cumprod)."""
    check_conditionals()


@needs_triton
def test_step_kernels_compile_for_sm90_without_spills():
    from offline import run_without_interpreter

    lines = run_without_interpreter("""
from dscale_runtime.kernels import stack_usage
from dscale_runtime.kernels.triton_step import compile_offline
for batch in (8, 256):
    for kernel in compile_offline(batch):
        print(batch, stack_usage(kernel))
""")
    assert len(lines) == 6 and all(line.endswith(("STACK:0", "?")) for line in lines), lines  # artifact map on


@pytest.mark.gpu
@needs_cuda
def test_cuda_step_kernels_equal_the_reference():
    for seed, n, width in [(1, 1, 1), (2, 32, 1), (3, 13, W), (4, 256, W)]:
        check_metadata(seed, n, width, width == 1, "cuda")
    for seed, n in enumerate((1, 9, 32, 200)):
        check_acceptance(seed, n, False, "cuda")
        check_acceptance(seed, n, True, "cuda")
    check_conditionals("cuda", exact=False)


@needs_triton
@pytest.mark.parametrize("mode,temperature,rule", [("target", 0.0, "auto"), ("dflash", 0.0, "auto"),
                                                   ("dflash", 1.0, "top1"), ("dflash", 1.0, "sampled")])
def test_engine_steps_through_the_step_kernels_equal_the_reference(  # noqa: F811 - pair: a fixture
        interpreter, pair, mode, temperature, rule, monkeypatch):
    """Target-only and DFlash engines (oracle drafts: every accepted length) whose steps take their metadata,
    acceptance and result rows from the kernels decode exactly what the same engines on the torch path decode,
    step for step, greedy and seeded sampling under both acceptance rules; greedy output equals target-only's."""
    from dscale_runtime.kernels import triton_step

    calls = collections.Counter()
    for name in ("block_metadata_triton", "accept_triton"):
        kernel = getattr(triton_step, name)
        monkeypatch.setattr(triton_step, name, lambda *a, _k=kernel, _n=name, **k: calls.update([_n]) or _k(*a, **k))
    prompts, _ = prompt_set(8, seed=3)
    params = [SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=i) for i in range(8)]
    runs = []
    for backend in ("ref", "triton"):
        if mode == "target":
            engine = make_engine(pair, "target", max_running_requests=4)
        else:
            long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
            continuations = make_engine(pair, "target").generate(prompts, long)
            base = make_engine(pair, max_running_requests=4, sampling_rule=rule)
            engine = OracleDraftEngine(base.target, base.drafter, base.config, base.tokenizer, base.eos_token_ids,
                                       continuations={str(i): o.token_ids for i, o in enumerate(continuations)})
        engine.keep_history, engine.runner.decision_backend = True, backend  # NOTE: read per eager step
        outputs = engine.generate(prompts, params)
        runs.append((outputs, [(s.accepted_lens, s.verify_lens) for s in engine.counters.history]))
    assert_same(runs[1][0], runs[0][0])
    assert runs[1][1] == runs[0][1]
    assert calls["accept_triton"] == calls["block_metadata_triton"] >= len(runs[1][1]), calls
    if temperature == 0:
        assert_same(runs[1][0], make_engine(pair, "target").generate(prompts, params))
        if mode == "dflash":
            assert len({a for accepted, _ in runs[1][1] for a in accepted}) > 4


@needs_triton
@pytest.mark.parametrize("artifact_map", [False, True], ids=["", "artifact-map"])
def test_dscale_engine_with_live_calibration_and_retention_through_the_step_kernels(interpreter, pair,  # noqa: F811
                                                                                     predictors,  # noqa: F811
                                                                                     artifact_map, monkeypatch):
    """DScale with the live map refreshed from its steps (the conditionals kernel's calibrated scores) and
    retention measured (the full-width count in the result row): the kernels' engine decides and decodes as the
    reference's, step for step, and its output equals target-only's. With an artifact calibration of two
    temperature bands, the kernel maps the predictor's uncalibrated scores itself, as `scores` does."""
    from dscale_runtime.kernels import triton_step
    from test_engine_dscale import dscale_engine

    mapped = []
    kernel = triton_step.conditionals_triton
    monkeypatch.setattr(triton_step, "conditionals_triton",
                        lambda scores, knots, art=None: mapped.append(art is not None) or kernel(scores, knots, art))
    prompts, _ = prompt_set(10, seed=5)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    continuations = make_engine(pair, "target").generate(prompts, long)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * len(prompts)
    runs = []
    for backend in ("ref", "triton"):
        engine = dscale_engine(pair, predictors["heuristic"], cls=OracleDraftEngine, max_running_requests=6,
                               budget_ratio=0.5, live_calibration=True, calibration_window=16,
                               measure_retention=True, keep_history=True,
                               continuations={str(i): o.token_ids for i, o in enumerate(continuations)})
        engine.runner.decision_backend = backend
        if artifact_map:  # NOTE: a map that lowers every conditional (greedy requests: band 0 of two)
            grid = torch.linspace(0, 1, 9)
            knots = torch.stack([grid**2, grid]).unsqueeze(1).expand(2, W - 1, 9).contiguous()
            engine.runner.predictor.set_calibration([0.0, 1.0], knots)
        outputs = engine.generate(prompts, params)
        assert engine.calibration.version >= 2  # NOTE: the map changed during the run
        runs.append((outputs, [(s.accepted_lens, s.verify_lens, s.full_accepted) for s in engine.counters.history]))
    assert runs[1][1] == runs[0][1]
    assert_same(runs[1][0], make_engine(pair, "target").generate(prompts, params))
    assert len({k for _, lens, _ in runs[1][1] for k in lens}) > 3
    assert mapped and set(mapped) == {artifact_map}  # the kernel mapped the uncalibrated scores itself
