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

    prompts = [p["prompt"] for p in stdlib_prompts()[:32]]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
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
