"""KV-pool sizing from a memory fraction (`dscale_runtime/memory.py`): the arithmetic against hand-computed
figures, at Qwen3-8B shape."""

from __future__ import annotations

import pytest
import torch

from dscale_runtime.config import EngineConfig
from dscale_runtime.memory import RESERVE_MIN_BYTES, kv_bytes_per_token, pool_tokens
from test_engine import pair  # noqa: F401 - fixture
from test_engine_dscale import dscale_engine, predictors  # noqa: F401 - fixture

GIB = 1 << 30


def test_qwen3_8b_bytes_per_token():
    # Target: 36 layers x 8 KV heads x 128 x (K, V) x bf16; DFlash drafter: 5 layers of the same heads.
    assert kv_bytes_per_token((36, 8, 128, torch.bfloat16)) == 147_456
    assert kv_bytes_per_token((36, 8, 128, torch.bfloat16), (5, 8, 128, torch.bfloat16)) == 147_456 + 20_480
    assert kv_bytes_per_token((2, 2, 16, torch.float32)) == 2 * 2 * 2 * 16 * 4


def test_pool_gets_what_weights_and_reserve_leave():
    per_token = 167_936
    total, weights, reserve = 141 * GIB, 17 * GIB, 3 * GIB
    tokens = pool_tokens(0.85, total, weights, reserve, per_token, 16, 40_960 + 32)
    budget = int(0.85 * total) - weights - reserve
    assert tokens == budget // per_token // 16 * 16 and tokens % 16 == 0
    assert (tokens + 16) * per_token > budget >= tokens * per_token
    # 64 requests of 40,960 tokens would ask for ~440 GB; the pool holds what fits (~630K tokens here).
    assert 600_000 < tokens < 700_000
    # Another process's memory counts: the free bytes bound the pool too.
    assert pool_tokens(0.85, total, weights, reserve, per_token, 16, 1, free_bytes=20 * GIB) == (
        (20 * GIB - reserve) // per_token // 16 * 16)
    # A tiny reserve is raised to the minimum.
    assert pool_tokens(0.5, 10 * GIB, GIB, 0, 1 << 20, 16, 1) == (5 * GIB - GIB - RESERVE_MIN_BYTES) // (1 << 20) // 16 * 16


def test_a_fraction_too_small_names_what_to_change():
    with pytest.raises(ValueError, match="memory_fraction=0.1 leaves room for .* raise memory_fraction"):
        pool_tokens(0.1, 141 * GIB, 17 * GIB, 3 * GIB, 167_936, 16, 4096)
    with pytest.raises(ValueError, match="memory_fraction"):
        EngineConfig(memory_fraction=1.5)
    with pytest.raises(ValueError, match="memory_fraction"):
        EngineConfig(memory_fraction=0)


@pytest.mark.parametrize("mode", ["target", "dflash", "dscale"])
def test_the_engine_profiles_one_step_and_one_chunk_and_sizes_the_pool(pair, predictors, monkeypatch,  # noqa: F811
                                                                       mode):
    """`Engine._pool_from_memory` on the CPU with the CUDA memory queries stood in for: the profiling step and
    prefill chunk run through the real runner and model on a temporary cache, and the pool is the arithmetic
    of `pool_tokens` over the figures reported."""
    import dscale_runtime.memory as memory
    from test_engine import make_engine

    if mode == "dscale":
        engine = dscale_engine(pair, predictors["untrained"], max_running_requests=8, chunked_prefill_tokens=40)
    else:
        engine = make_engine(pair, mode, max_running_requests=8, chunked_prefill_tokens=40)
    calls = []
    fake = {"synchronize": lambda device=None: None, "empty_cache": lambda: None,
            "reset_peak_memory_stats": lambda device=None: calls.append("reset"),
            "memory_allocated": lambda device=None: 3 * GIB,
            "max_memory_allocated": lambda device=None: 3 * GIB + 400 * (1 << 20),
            "mem_get_info": lambda device=None: (20 * GIB, 24 * GIB)}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    ran = []
    run = memory.transient_peak

    def watched(device, work):
        ran.append(work)
        return run(device, work)

    monkeypatch.setattr("dscale_runtime.engine.transient_peak", watched)
    object.__setattr__(engine.config, "memory_fraction", 0.5)
    tokens = engine._pool_from_memory(engine.config.max_model_len + engine.block_size)
    per_token = kv_bytes_per_token(*engine._kv_layout())
    assert ran and calls == ["reset"]
    assert tokens == pool_tokens(0.5, 24 * GIB, 3 * GIB, 800 * (1 << 20), per_token, 16, 1, free_bytes=20 * GIB)
