"""The engine's fixed per-bucket decode step (`EngineConfig.step_graphs`, dscale_runtime/step_graphs.py).

CPU: the same step functions run eagerly, so the engine with step_graphs must decode exactly the tokens of
the ordinary engine (and of target-only greedy decoding) while batches shrink through the buckets, in
dflash and dscale mode, with the full-width threshold, and with sampled requests taking the ordinary path.
GPU (marker `gpu`): the captured graphs give the same tokens as the eager engine on the demo pair.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import write_drafter, write_target
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.engine import Engine
from dscale_runtime.step_graphs import bucket_sizes


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


def run(pair, predictor, mode, step_graphs, params=None, **config):
    cfg = EngineConfig(mode=mode, max_running_requests=8, max_model_len=96, dtype="float32",
                       step_graphs=step_graphs, **config)
    engine = Engine.from_pretrained(pair[0], pair[1], predictor=predictor if mode == "dscale" else None,
                                    config=cfg, keep_history=True)
    params = params or [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in LENGTHS]
    outputs = engine.generate(PROMPTS, params)
    return [o.token_ids for o in outputs], engine


def test_bucket_sizes():
    assert bucket_sizes(8) == [1, 2, 4, 8] and bucket_sizes(6) == [1, 2, 4, 6] and bucket_sizes(1) == [1]


@pytest.mark.parametrize("mode,config", [("dflash", {}), ("dscale", {}), ("dscale", {"full_width_max_batch": 2})],
                         ids=["dflash", "dscale", "dscale-full-width-2"])
def test_bucketed_step_equals_the_ordinary_step(pair, predictor, mode, config):
    torch.set_num_threads(1)
    want, plain = run(pair, predictor, mode, False, **config)
    got, fast = run(pair, predictor, mode, True, **config)
    target, _ = run(pair, predictor, "dflash", False)  # dflash greedy == target greedy (tests/test_engine.py)
    assert got == want == target
    sizes = {key[0] for key in fast.step_graphs.steps}
    assert len(sizes) >= 3, sizes  # the batch walked through several buckets
    hist_fast, hist_plain = fast.counters.history, plain.counters.history
    assert [h.verify_lens for h in hist_fast] == [h.verify_lens for h in hist_plain]
    assert [h.accepted_lens for h in hist_fast] == [h.accepted_lens for h in hist_plain]
    assert fast.counters.verify_rows == plain.counters.verify_rows
    if mode == "dscale" and not config:
        assert any(len(set(h.verify_lens)) > 1 for h in hist_fast)  # ragged: the decision really ran


def test_sampled_requests_take_the_ordinary_step(pair, predictor):
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=m, ignore_eos=True) for i, m in enumerate(LENGTHS)]
    want, _ = run(pair, predictor, "dscale", False, params)
    got, fast = run(pair, predictor, "dscale", True, params)
    assert got == want and not fast.step_graphs.steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["dflash", "dscale"])
def test_captured_steps_equal_the_eager_engine_on_the_demo_pair(mode):
    from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts

    prompts = [p["prompt"] for p in stdlib_prompts()[:24]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for graphs in (False, True):
        cfg = EngineConfig(mode=mode, max_running_requests=16, device="cuda", dtype="float32", max_model_len=1024,
                           step_graphs=graphs)
        engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter",
                                        DEMO_DIR.parent / "demo.pt" if mode == "dscale" else None, config=cfg)
        tokens[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        if graphs:
            assert engine.step_graphs.steps and all(p.graph is not None for s in engine.step_graphs.steps.values()
                                                    for p in s.parts.values())
    assert tokens[True] == tokens[False]


@pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="triton is not installed")
def test_bucketed_dscale_step_through_the_interpreted_kernels(pair, predictor, monkeypatch):
    """Buckets leave more placeholder rows than W (M fixed per bucket, M_live per batch): the Triton paths
    (interpreter on CPU) must skip them and decode what the portable paths decode."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA run of this comparison is the gpu test above")
    params = [SamplingParams(temperature=0, max_tokens=m // 4 + 1, ignore_eos=True) for m in LENGTHS]  # n: 6, 5, ..
    want, _ = run(pair, predictor, "dscale", True, params)
    for var in ("DSCALE_ATTENTION", "DSCALE_FUSED", "DSCALE_FEATURES"):
        monkeypatch.setenv(var, "triton")
    got, fast = run(pair, predictor, "dscale", True, params)
    assert got == want
    assert any(size > 2 for size, _ in fast.step_graphs.steps)


def test_prepare_builds_every_bucket_and_mode_a_batch_can_need(pair, predictor):
    cfg = EngineConfig(mode="dscale", max_running_requests=6, max_model_len=96, dtype="float32", step_graphs=True,
                       full_width_max_batch=3)
    engine = Engine.from_pretrained(pair[0], pair[1], predictor=predictor, config=cfg)
    runner = engine.step_graphs
    assert runner.buckets == [1, 2, 4, 6]
    assert [runner.mode_for(n) for n in range(1, 7)] == ["dflash"] * 3 + ["dscale"] * 3
    runner.prepare()
    assert set(runner.steps) == {(1, "dflash"), (2, "dflash"), (4, "dflash"), (4, "dscale"), (6, "dscale")}
    assert runner.steps[(6, "dscale")].num_rows == 48 and runner.steps[(4, "dflash")].num_rows == 64
