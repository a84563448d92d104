"""DScale (DVL compact verification) in the engine: lossless against target-only decoding.

Oracle: target-only greedy output (and sampling distribution). Predictors: untrained (random weights),
constant, and all-ones; drafts: the random drafter and the oracle stand-in from test_engine.
"""

from __future__ import annotations

import collections

import pytest
import torch

from test_engine import (
    MAX_LEN,
    OracleDraftEngine,
    assert_same,
    make_engine,
    prompt_set,
    pair,  # noqa: F401 - fixtures
    reference,  # noqa: F401
)
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.dvl.features import FeatureSpec, hidden_projection
from dscale_runtime.dvl.predictor import AcceptancePredictor, pair_identity, predictor_artifact
from dscale_runtime.engine import Engine
from dscale_runtime.models.config import load_drafter_config, load_target_config


def make_predictor(kind: str, seed: int = 0) -> AcceptancePredictor:
    torch.manual_seed(seed)
    spec = FeatureSpec()
    model = AcceptancePredictor(spec)
    if kind == "heuristic":
        # Hand-set weights: logit_j = top1_logit_j - 3, routed through the MLP (a confidence heuristic).
        first, second, last = model.mlp[0], model.mlp[2], model.mlp[4]
        with torch.no_grad():
            for layer in (first, second, last):
                layer.weight.zero_()
                layer.bias.zero_()
            for j in range(spec.num_positions):
                first.weight[j, j * spec.per_position] = 1.0
                second.weight[j, j] = 1.0
                last.weight[j, j] = 1.0
            last.bias.fill_(-3.0)
    elif kind != "untrained":
        last = model.mlp[-1]
        with torch.no_grad():
            last.weight.zero_()
            last.bias.fill_({"constant": -0.4, "ones": 100.0}[kind])  # sigmoid(-0.4) ~ 0.4; sigmoid(100) == 1
    return model


def save_predictor(folder, pair_paths, kind, seed=0):
    tcfg, dcfg = load_target_config(pair_paths[0]), load_drafter_config(pair_paths[1])
    model = make_predictor(kind, seed)
    path = folder / f"{kind}-{seed}.pt"
    torch.save(predictor_artifact(model, pair_identity(tcfg, dcfg), hidden_projection(model.spec, tcfg.hidden_size)),
               path)
    return path


@pytest.fixture(scope="module")
def predictors(pair, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("predictors")
    return {"untrained": save_predictor(folder, pair, "untrained", 0),
            "heuristic": save_predictor(folder, pair, "heuristic"),
            "constant": save_predictor(folder, pair, "constant"),
            "ones": save_predictor(folder, pair, "ones")}


ENGINE_ARGS = ("keep_history", "continuations")


def dscale_engine(pair_paths, predictor, cls=Engine, **kwargs):  # noqa: F811
    extra = {k: kwargs.pop(k) for k in ENGINE_ARGS if k in kwargs}
    cfg = EngineConfig(mode="dscale", max_model_len=MAX_LEN, **kwargs)
    return cls.from_pretrained(pair_paths[0], pair_paths[1], predictor=predictor, config=cfg, **extra)


@pytest.mark.parametrize("ratio", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("max_running", [1, 4, 32])
def test_dscale_greedy_equals_target_greedy(pair, reference, predictors, ratio, max_running):  # noqa: F811
    prompts, params, want = reference
    kind = "untrained" if max_running != 4 else "constant"
    engine = dscale_engine(pair, predictors[kind], budget_ratio=ratio, max_running_requests=max_running,
                           keep_history=True)
    outputs = engine.generate(prompts, params)
    assert_same(outputs, want)
    for step in engine.counters.history:
        w = engine.block_size
        assert step.num_verify_rows == max(step.num_live, min(int(ratio * w * step.num_live + 0.5), w * step.num_live))
        assert sum(step.verify_lens) == step.num_verify_rows
    assert engine.allocator.num_free == engine.allocator.num_pages - 1


def test_dscale_with_oracle_drafts_is_lossless_and_retains(pair, predictors):  # noqa: F811
    prompts, _ = prompt_set(16, seed=11)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    continuations = make_engine(pair, "target").generate(prompts, long)
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * len(prompts)
    want = make_engine(pair, "target").generate(prompts, params)
    engine = dscale_engine(pair, predictors["heuristic"], cls=OracleDraftEngine, max_running_requests=8,
                           measure_retention=True, keep_history=True,
                           continuations={str(i): o.token_ids for i, o in enumerate(continuations)})
    outputs = engine.generate(prompts, params)
    assert_same(outputs, want)
    lens = collections.Counter(k for step in engine.counters.history for k in step.verify_lens)
    assert len(lens) > 3, f"the predictor must spread verify lengths, got {dict(lens)}"
    for step in engine.counters.history:
        # Greedy: compact verification keeps exactly the part of the full-width accepted run it verified.
        assert step.accepted_lens == [min(y, k - 1) for y, k in zip(step.full_accepted, step.verify_lens)]
    c = engine.counters
    assert 0 < c.retained_drafts <= c.full_width_drafts


def test_dscale_decisions_through_the_triton_kernels_equal_the_reference(pair, predictors, interpreter,  # noqa: F811
                                                                          monkeypatch):
    """The allocation, flat pack and v3 agreement columns through their Triton kernels (the interpreter; what a CUDA
    runner uses) decide every step as the torch reference does: the same verify lengths step by step, over a
    predictor that spreads them, with grow and shrink budgets, output equal to target-only's."""
    from dscale_runtime.kernels import triton_agreement, triton_pack

    calls = collections.Counter()
    for module, name in ((triton_pack, "allocate_triton"), (triton_pack, "flat_pack_triton"),
                         (triton_agreement, "agreement_columns_triton")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name: calls.update([_n]) or _k(*a))
    prompts, _ = prompt_set(12, seed=11)
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    continuations = make_engine(pair, "target").generate(prompts, long)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    want = make_engine(pair, "target").generate(prompts, params)
    runs = []
    for backend in ("ref", "triton"):
        for ratio in (0.25, 0.75):
            engine = dscale_engine(pair, predictors["heuristic"], cls=OracleDraftEngine, max_running_requests=6,
                                   budget_ratio=ratio, keep_history=True,
                                   continuations={str(i): o.token_ids for i, o in enumerate(continuations)})
            assert engine.feature_spec.num_agreement
            engine.runner.decision_backend = backend  # NOTE: read per eager step
            assert_same(engine.generate(prompts, params), want)
            runs.append([step.verify_lens for step in engine.counters.history])
    assert runs[:2] == runs[2:]
    assert len({k for steps in runs for lens in steps for k in lens}) > 3
    assert len(set(calls.values())) == 1 and calls["allocate_triton"] >= sum(map(len, runs[2:])), calls


def test_full_budget_and_certain_predictor_reproduce_dflash(pair, reference, predictors):  # noqa: F811
    prompts, params, _ = reference
    dflash = make_engine(pair, max_running_requests=8).generate(prompts, params)
    dscale = dscale_engine(pair, predictors["ones"], budget_ratio=1.0, max_running_requests=8).generate(
        prompts, params)
    for a, b in zip(dflash, dscale, strict=True):
        assert a.token_ids == b.token_ids
        assert a.stats.accepted_lens == b.stats.accepted_lens
        assert set(b.stats.verify_lens) == {16}


def test_dscale_needs_a_matching_predictor(pair, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="predictor"):
        Engine.from_pretrained(pair[0], pair[1], config=EngineConfig(mode="dscale"))
    with pytest.raises(ValueError, match="only used by mode='dscale'"):
        Engine.from_pretrained(pair[0], pair[1], predictor="x.pt", config=EngineConfig(mode="dflash"))
    with pytest.raises(ValueError, match="budget_ratio"):
        EngineConfig(mode="dscale", budget_ratio=0)


def test_small_batches_verify_full_width_without_deciding(pair, predictors):  # noqa: F811
    """full_width_max_batch: steps with few live requests run the DFlash step (k = W for all, no decision),
    larger ones the DVL budget; output stays target-only greedy, and no draft is lost in the small steps."""
    prompts, _ = prompt_set(12, seed=5)
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    continuations = make_engine(pair, "target").generate(prompts, long)
    params = [SamplingParams(temperature=0, max_tokens=40 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    want = make_engine(pair, "target").generate(prompts, params)
    engine = dscale_engine(pair, predictors["constant"], cls=OracleDraftEngine, max_running_requests=8,
                           full_width_max_batch=3, measure_retention=True, keep_history=True,
                           continuations={str(i): o.token_ids for i, o in enumerate(continuations)})
    assert_same(engine.generate(prompts, params), want)
    w = engine.block_size
    small = [s for s in engine.counters.history if s.num_live <= 3]
    large = [s for s in engine.counters.history if s.num_live > 3]
    assert small and large, "the prompt lengths must leave small batches at the end of the run"
    for step in small:
        assert step.verify_lens == [w] * step.num_live and step.num_verify_rows == w * step.num_live
        assert step.accepted_lens == step.full_accepted
    for step in large:
        assert step.num_verify_rows == int(0.5 * w * step.num_live + 0.5)
    with pytest.raises(ValueError, match="full_width_max_batch"):
        EngineConfig(mode="dscale", full_width_max_batch=-1)


def test_overlap_schedule_steps_start_from_the_committed_state(pair, predictors):  # noqa: F811
    """Under the overlap schedule a step launches before the previous one is committed, its anchors, context
    lengths and DScale context features taken from the device state. Oracle: the host's own record, rebuilt from
    each request's final tokens and accepted counts (prompt + accepted + 1 per earlier step, the last four
    accepted counts most recent first, the step's live count); output equal to the engine without overlap."""
    prompts, params = prompt_set(10, seed=11)
    engine = dscale_engine(pair, predictors["untrained"], max_running_requests=4)
    runner, seen = engine.runner, []
    launch = runner.launch

    def recording(*args):
        pending = launch(*args)
        buf = runner.steps[runner.last_key].buf
        by_slot = {r.slot: r.request_id for r in engine.scheduler.running}
        n = pending.num_live
        seen.append([(by_slot[int(buf.slot[i])], n, int(buf.host[i]), int(buf.anchor[i]), int(buf.ctx[i]),
                      buf.context[i].tolist()) for i in range(n)])
        return pending

    runner.launch = recording
    outputs = engine.generate(prompts, params)
    assert_same(outputs, dscale_engine(pair, predictors["untrained"], max_running_requests=4,
                                       overlap_schedule=False).generate(prompts, params))
    by_id = {o.request_id: o for o in outputs}
    steps_of = collections.Counter()
    ahead = 0
    for rows in seen:
        for request_id, n, host, anchor, ctx, context in rows:
            out = by_id[request_id]
            k = steps_of[request_id]
            steps_of[request_id] += 1
            accepted = out.stats.accepted_lens
            assert k <= len(accepted), "a request ran more than one step past its end"
            tokens = out.prompt_token_ids + out.token_ids
            want_ctx = len(out.prompt_token_ids) + sum(a + 1 for a in accepted[:k])
            recent = list(reversed(accepted[max(0, k - 4):k]))
            assert ctx == want_ctx and (ctx >= len(tokens) or anchor == tokens[ctx])
            assert context == [n, want_ctx, k, len(recent)] + recent + [0] * (4 - len(recent))
            ahead += host == 0
    assert ahead > len(prompts), "the device state was hardly used"
