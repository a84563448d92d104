"""GPU checks (run on the device machine): lossless decoding of the demo pair on CUDA in every mode."""

from __future__ import annotations

import pytest
import torch

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
from dscale_runtime.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_demo_pair_lossless_on_cuda(tmp_path, dtype):
    from test_engine_dscale import make_predictor
    from dscale_runtime.dvl.features import hidden_projection
    from dscale_runtime.dvl.predictor import pair_identity, predictor_artifact

    prompts = [p["prompt"] for p in stdlib_prompts()[:24]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base = dict(device="cuda", dtype=dtype, max_running_requests=16, max_model_len=1024)
    target = Engine.from_pretrained(DEMO_DIR / "target", config=EngineConfig(mode="target", **base))
    want = target.generate(prompts, params)
    dflash = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter", config=EngineConfig(**base))
    model = make_predictor("heuristic")
    art = predictor_artifact(model, pair_identity(dflash.target.config, dflash.drafter.config),
                             hidden_projection(model.spec, dflash.target.config.hidden_size))
    torch.save(art, tmp_path / "heuristic.pt")
    dscale = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter", predictor=tmp_path / "heuristic.pt",
                                    config=EngineConfig(mode="dscale", **base))
    for name, engine in (("dflash", dflash), ("dscale", dscale)):
        got = engine.generate(prompts, params)
        same = sum(a.token_ids == b.token_ids for a, b in zip(got, want))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
                      for a, b in zip(got, want)]
        print(f"{dtype} {name}: {same}/{len(prompts)} identical; first differing token per prompt: {first_diff}; "
              f"mean acceptance length {1 + engine.counters.accepted_drafts / engine.counters.request_steps:.3f}")
        if dtype == "float32":
            assert same == len(prompts)
        else:
            assert same >= len(prompts) * 3 // 4  # bf16: near-ties may flip a greedy choice


def _compiled_kernels() -> int:
    """Compiled variants of every Triton kernel of the runtime (Triton's per-device caches), where readable."""
    import importlib

    count = 0
    for name in ("triton_attention", "triton_fused", "triton_features", "triton_sampling"):
        module = importlib.import_module(f"dscale_runtime.kernels.{name}")
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None)
            if isinstance(caches, dict):
                count += sum(len(entry[0]) for entry in caches.values())
    return count


@pytest.mark.parametrize("mode", ["target", "dflash", "dscale"])
def test_captured_prefill_equals_eager_prefill_and_nothing_compiles_after_start_up(tmp_path, mode):
    """Prefill replayed from token-bucket graphs (chunks, prefix-cache hits, first-token draws greedy, sampled
    and filtered) decodes what eager prefill decodes, token for token (fp32); after start-up no request
    captures a graph or compiles a kernel. Target-only runs given buckets up to 128 under a 160-token budget: a
    step's prefill above 128 tokens runs as several replays (`Engine._prefill_groups`), never eagerly."""
    from test_engine_dscale import make_predictor
    from test_prefill import prefill_runs, tokens_per_step
    from dscale_runtime.dvl.features import hidden_projection
    from dscale_runtime.dvl.predictor import pair_identity, predictor_artifact

    base = [p["prompt"] for p in stdlib_prompts()[:12]]
    prompts = [base[i % 4] * 2 + base[4 + i % 8] for i in range(18)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if i % 3 == 0 else
              SamplingParams(temperature=1.0, top_p=0.8 if i % 3 == 1 else 1.0, max_tokens=24, ignore_eos=True,
                             seed=i) for i in range(len(prompts))]
    predictor = None
    if mode == "dscale":
        model = make_predictor("heuristic")
        probe = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter",
                                       config=EngineConfig(device="cuda", dtype="float32", max_model_len=1024))
        torch.save(predictor_artifact(model, pair_identity(probe.target.config, probe.drafter.config),
                                      hidden_projection(model.spec, probe.target.config.hidden_size)),
                   tmp_path / "heuristic.pt")
        predictor, probe = tmp_path / "heuristic.pt", None

    def engine(prefill_graphs: bool) -> Engine:
        config = EngineConfig(mode=mode, device="cuda", dtype="float32", max_model_len=1024, max_running_requests=8,
                              step_graphs=True, prefill_graphs=prefill_graphs, chunked_prefill_tokens=160,
                              target_fallback=False,  # NOTE: the modes' own steps; the prefills are under test
                              prefill_buckets=(16, 32, 64, 128) if mode == "target" else None)
        return Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter" if mode != "target" else None,
                                      predictor, config=config)

    want = [o.token_ids for o in engine(False).generate(prompts, params)]
    captured = engine(True)
    graphs = (len(captured.runner.steps), len(captured.prefiller.steps))
    compiled = _compiled_kernels()
    runs = prefill_runs(captured)
    got = [o.token_ids for o in captured.generate(prompts, params)]
    assert got == want
    assert captured.prefiller.eager_calls == 0 and captured.prefix_cache_stats["hit_tokens"] > 0
    if mode == "target":  # several replays of at most the largest bucket in one step
        assert max(t for _, t in runs) <= 128 < max(tokens_per_step(runs)), runs
    assert (len(captured.runner.steps), len(captured.prefiller.steps)) == graphs, "a request captured a graph"
    assert _compiled_kernels() == compiled, "a request compiled a Triton kernel"
