"""Tensor parallelism: two gloo processes on the CPU (TP2) against one process (TP1), fp32.

Oracle: the unsharded models and engine of the same checkpoints. Model level: a tiny random target with
q/k/v/o biases and a vocabulary that two ranks split unevenly (a padded LM-head part), and a random drafter:
prefill and decode logits, captured features, draft logits and drafts of TP2 equal TP1's (tight tolerance).
Engine level: the demo pair (trained, so drafts are accepted; tied embeddings, a sharded checkpoint) decodes
the same tokens and accepts the same drafts under TP2 as under TP1 in target, dflash and dscale modes, greedy
and seeded sampling, and both ranks agree exactly. Sharded loading is checked against slices of the whole
weights without any process group (loading never communicates).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

from checkpoints import write_drafter
from dscale_runtime.attention import build_metadata
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import stdlib_prompts
from dscale_runtime.distributed import close_tensor_parallel, engine_from_pretrained, init_tensor_parallel
from dscale_runtime.engine import Engine
from dscale_runtime.kv_cache import PageAllocator, PagedKVCache
from dscale_runtime.models.config import CheckpointError
from dscale_runtime.models.loader import load_drafter, load_target
from dscale_runtime.models.parallel import TensorParallel, shard_dim
from dscale_runtime.models.qwen3 import Qwen3ForCausalLM
from dscale_runtime.server.config import DEMO_DRAFTER, DEMO_PREDICTOR, DEMO_TARGET

WORLD = 2
PAGE = 4
VOCAB = 97  # odd: rank 1's LM-head part holds one padding row
TOL = 2e-5


def write_biased_target(folder, *, vocab: int = VOCAB, seed: int = 3):
    """A random Qwen3 target with q/k/v/o biases (transformers' save_pretrained, sharded files)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True,
                      tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(folder, max_shard_size="20KB")
    return folder


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_pair")
    target = write_biased_target(root / "target")
    drafter = write_drafter(root / "drafter", prefix="model.", vocab=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=(0, 2),
                            num_target_layers=3)
    return target, drafter


# --------------------------------------------------------------------------------------------------
# what every process runs: TP1 in this one, TP2 on both spawned ranks


@torch.no_grad()
def model_forward(target, drafter) -> dict[str, torch.Tensor]:
    """Prefill two ragged prompts, decode a few rows each, inject the drafter's context, propose one block."""
    cfg, dcfg = target.config, drafter.config
    gen = torch.Generator().manual_seed(0)
    prompt_lens, step_lens = [7, 5], [3, 1]
    w = dcfg.block_size
    num_pages = 1 + sum(-(-(p + s + w) // PAGE) for p, s in zip(prompt_lens, step_lens))
    alloc = PageAllocator(num_pages, PAGE)
    tables = [alloc.allocate(-(-(p + s + w) // PAGE)) for p, s in zip(prompt_lens, step_lens)]
    tcache = PagedKVCache(cfg.num_hidden_layers, num_pages, PAGE, cfg.num_key_value_heads, cfg.head_dim,
                          torch.float32, "cpu")
    dcache = PagedKVCache(dcfg.layers.num_hidden_layers, num_pages, PAGE, dcfg.layers.num_key_value_heads,
                          dcfg.layers.head_dim, torch.float32, "cpu")
    capture = tuple(dcfg.target_layer_ids)
    out = {}
    meta = build_metadata(prompt_lens, [0, 0], tables, PAGE, "cpu")
    tokens = torch.randint(0, cfg.vocab_size, (sum(prompt_lens),), generator=gen)
    out["prefill_logits"], out["prefill_features"] = target(tokens, meta, tcache.layers, None, capture)
    drafter.inject_context(out["prefill_features"], meta.positions, meta.slot_mapping, dcache.layers)
    meta = build_metadata(step_lens, prompt_lens, tables, PAGE, "cpu")
    tokens = torch.randint(0, cfg.vocab_size, (sum(step_lens),), generator=gen)
    out["decode_logits"], out["decode_features"] = target(tokens, meta, tcache.layers, None, capture,
                                                          float_logits=False)
    drafter.inject_context(out["decode_features"], meta.positions, meta.slot_mapping, dcache.layers)
    ctx = [p + s for p, s in zip(prompt_lens, step_lens)]
    block = torch.full((2, w), dcfg.mask_token_id, dtype=torch.long)
    last = torch.cumsum(torch.tensor(step_lens), 0) - 1
    block[:, 0] = out["decode_logits"][last].argmax(dim=-1)
    meta = build_metadata([w, w], ctx, tables, PAGE, "cpu", causal=False)
    out["draft_logits"], out["draft_hidden"] = drafter.propose(block, target, meta, dcache.layers)
    out["block"] = block
    out["cache_kv_heads"] = torch.tensor([tcache.k.shape[2], dcache.k.shape[2]])
    return out


ENGINE_RUNS = (("target", 0.0), ("dflash", 0.0), ("dscale", 0.0), ("dflash", 0.9))


def engine_runs(make_engine, device: str = "cpu") -> dict[str, dict]:
    """Demo-pair generations per (mode, temperature): tokens, accepted lengths, accepted drafts, cache heads
    (on CUDA with the runner's captured step graphs)."""
    prompts = [p["prompt"] for p in stdlib_prompts()[:4]]
    results = {}
    for mode, temperature in ENGINE_RUNS:
        config = EngineConfig(mode=mode, device=device, dtype="float32", max_running_requests=4, max_model_len=512,
                              full_width_max_batch=0, step_graphs=device == "cuda",
                              target_fallback=False)  # NOTE: the same steps on both sides, not a timed choice
        engine = make_engine(mode, config)
        params = [SamplingParams(temperature=temperature, max_tokens=24, seed=10 + i) for i in range(len(prompts))]
        outputs = engine.generate(prompts, params)
        results[f"{mode}@{temperature}"] = {
            "tokens": [o.token_ids for o in outputs],
            "accepted": [o.stats.accepted_lens for o in outputs],
            "verify": [o.stats.verify_lens for o in outputs],
            "accepted_drafts": engine.counters.accepted_drafts,
            "cache_kv_heads": engine.target_cache.k.shape[2],
        }
    return results


def demo_engine(mode: str, config: EngineConfig, tp: TensorParallel | None = None) -> Engine:
    drafter = DEMO_DRAFTER if mode != "target" else None
    predictor = DEMO_PREDICTOR if mode == "dscale" else None
    if tp is None:
        return Engine.from_pretrained(DEMO_TARGET, drafter, predictor, config=config)
    return engine_from_pretrained(DEMO_TARGET, drafter, predictor, config, tp)


def agreed_measurements(rank: int) -> dict:
    """What each rank makes of measurements that differ by rank: `agreed_values` (max and min) and an engine's
    chunk-budget timings (`Engine._agree_chunk_timings`, the path CUDA engines take after their start-up timing)."""
    from types import SimpleNamespace

    from dscale_runtime.runner import agreed_values

    own = [1.0 + rank, 5.0 - 2 * rank, 0.25 * rank]
    engine = SimpleNamespace(device=torch.device("cpu"), decode_ms={8: 0.5 + rank, 16: 0.7 - 0.1 * rank},
                             prefiller=SimpleNamespace(bucket_ms={16: (1.0 - 0.5 * rank, 2.0, 4096),
                                                                  32: (1.5, 2.5 + rank, 4000)},
                                                       many_ms={16: (3.0 + rank, 4.0, 4096)},
                                                       group_ms={4: {16: (2.0, 3.0 - rank, 4096)}}))
    Engine._agree_chunk_timings(engine)
    return {"max": agreed_values(own, torch.device("cpu")), "min": agreed_values(own, torch.device("cpu"), "min"),
            "decode_ms": engine.decode_ms, "bucket_ms": engine.prefiller.bucket_ms,
            "many_ms": engine.prefiller.many_ms, "group_ms": engine.prefiller.group_ms}


def rank_job(tp: TensorParallel, tiny) -> dict:
    target = load_target(tiny[0], "float32", tp=tp)
    drafter = load_drafter(tiny[1], target.config, "float32", tp=tp)
    return {"forward": model_forward(target, drafter), "agreed": agreed_measurements(tp.rank),
            "engine": engine_runs(lambda mode, config: demo_engine(mode, config, tp))}


def rank_main(rank: int, port: int, out_dir: str, tiny, device: str) -> None:
    """One spawned rank, in torchrun's environment (so `init_tensor_parallel` reads it as under torchrun)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tp = init_tensor_parallel(device, tensor_parallel_size=WORLD)
    try:
        assert (tp.rank, tp.size) == (rank, WORLD)
        if device == "cpu":
            result = rank_job(tp, tiny)
        else:
            result = {"engine": engine_runs(lambda mode, config: demo_engine(mode, config, tp), device)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_tensor_parallel()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(out, tiny, device: str) -> list[dict]:
    mp.spawn(rank_main, args=(free_port(), str(out), tiny, device), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


@pytest.fixture(scope="module")
def tp2(tiny_pair, tmp_path_factory):
    """Both ranks' results of `rank_job` (gloo, CPU)."""
    return spawn_ranks(tmp_path_factory.mktemp("tp2"), tiny_pair, "cpu")


@pytest.fixture(scope="module")
def tp1(tiny_pair):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = load_target(tiny_pair[0], "float32")
        drafter = load_drafter(tiny_pair[1], target.config, "float32")
        return {"forward": model_forward(target, drafter), "engine": engine_runs(demo_engine)}
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------------------------------
# TP2 == TP1


def test_forward_logits_tp2_equal_tp1(tp1, tp2):
    want = tp1["forward"]
    assert want["cache_kv_heads"].tolist() == [2, 2]
    for rank, result in enumerate(tp2):
        got = result["forward"]
        assert got["cache_kv_heads"].tolist() == [1, 1], "each rank's caches hold its own kv heads"
        for key in ("prefill_logits", "prefill_features", "decode_logits", "decode_features", "draft_logits",
                    "draft_hidden"):
            assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
            torch.testing.assert_close(got[key], want[key], atol=TOL, rtol=TOL, msg=lambda m: f"rank {rank} {key}: {m}")
        assert got["block"].tolist() == want["block"].tolist(), "drafts differ"
    for key, value in tp2[0]["forward"].items():
        assert torch.equal(value, tp2[1]["forward"][key]), f"the ranks disagree on {key}"


@pytest.mark.parametrize("run", [f"{m}@{t}" for m, t in ENGINE_RUNS])
def test_engine_tp2_equals_tp1_token_for_token(tp1, tp2, run):
    want = tp1["engine"][run]
    assert want["cache_kv_heads"] == 2
    for rank, result in enumerate(tp2):
        got = result["engine"][run]
        assert got["cache_kv_heads"] == 1, "the engine sizes each rank's cache from its shard's kv heads"
        assert got["tokens"] == want["tokens"], f"rank {rank}: TP2 decoded other tokens than TP1"
        assert got["accepted"] == want["accepted"] and got["verify"] == want["verify"], f"rank {rank}"
    if not run.startswith("target"):
        assert want["accepted_drafts"] > 0, "no draft was accepted: the comparison would prove nothing"
    if run.startswith("dscale"):
        assert any(k < 16 for v in want["verify"] for k in v), "the DVL decision never shortened a block"
    assert tp2[0]["engine"][run] == tp2[1]["engine"][run]


def test_greedy_dflash_equals_target_under_tp2(tp2):
    for result in tp2:
        assert result["engine"]["dflash@0.0"]["tokens"] == result["engine"]["target@0.0"]["tokens"]
        assert result["engine"]["dscale@0.0"]["tokens"] == result["engine"]["target@0.0"]["tokens"]


# --------------------------------------------------------------------------------------------------
# sharded loading, no process group


def test_rank_measurements_are_agreed_across_ranks(tp2):
    """Measurements that set the schedule (step and prefill times, the KV pool) differ by rank; the ranks schedule
    alike without talking, so each becomes the ranks' maximum (times) or minimum (the pool) on every rank."""
    a, b = tp2[0]["agreed"], tp2[1]["agreed"]
    assert a == b
    assert a["max"] == [2.0, 5.0, 0.25] and a["min"] == [1.0, 3.0, 0.0]
    assert a["decode_ms"] == {8: 1.5, 16: 0.7}
    assert a["bucket_ms"] == {16: (1.0, 2.0, 4096), 32: (1.5, 3.5, 4000)}
    assert a["many_ms"] == {16: (4.0, 4.0, 4096)}  # the full buckets' times (several requests' chunks) too
    assert a["group_ms"] == {4: {16: (2.0, 3.0, 4096)}}  # and the variants' between


def test_chunk_reference_ignores_the_rank_local_cycle_under_tensor_parallelism():
    """The prefill chunk's reference reads the live host cycle (each process's own wall time) only without
    tensor parallelism; under it, the agreed device step alone, so every rank cuts the same chunks."""
    from types import SimpleNamespace

    engine = SimpleNamespace(decode_ms={8: 0.5, 16: 0.8}, cycle_ms=1.2, runner=SimpleNamespace(bucket=lambda n: 8),
                             tensor_parallel=False)
    assert Engine.stall_reference_ms(engine, 5) == 1.2
    engine.tensor_parallel = True
    assert Engine.stall_reference_ms(engine, 5) == 0.5


def test_rank_shards_are_slices_of_the_whole_weights(tiny_pair):
    whole = load_target(tiny_pair[0], "float32")
    whole_d = load_drafter(tiny_pair[1], whole.config, "float32")
    full = dict(whole.named_parameters()) | {f"drafter.{k}": v for k, v in whole_d.named_parameters()}
    parts = {}
    for rank in range(WORLD):
        tp = TensorParallel(None, rank, WORLD)
        target = load_target(tiny_pair[0], "float32", tp=tp)
        drafter = load_drafter(tiny_pair[1], target.config, "float32", tp=tp)
        assert target.config.num_attention_heads == 2 and target.config.num_key_value_heads == 1
        assert target.config.intermediate_size == 32 and target.config.vocab_size == VOCAB
        assert drafter.config.layers.num_key_value_heads == 1 and target.config.tensor_parallel_size == WORLD
        for name, p in list(target.named_parameters()) + [(f"drafter.{k}", v) for k, v in drafter.named_parameters()]:
            parts.setdefault(name, []).append(p)
    for name, pieces in parts.items():
        dim = shard_dim(name.removeprefix("drafter."))
        if dim is None:
            assert all(torch.equal(p, full[name]) for p in pieces), name
            continue
        joined = torch.cat(pieces, dim=dim)
        if name.split(".")[-2] in ("embed_tokens", "lm_head"):
            assert joined.shape[0] == VOCAB + 1 and not joined[VOCAB:].any(), "one zero padding row"
            joined = joined[:VOCAB]
        assert torch.equal(joined, full[name]), name


def test_sharding_errors_name_the_file(tiny_pair):
    with pytest.raises(CheckpointError, match=r"config\.json.*'num_attention_heads' = 4 is not divisible by "
                                              r"tensor_parallel_size=3"):
        load_target(tiny_pair[0], "float32", tp=TensorParallel(None, 0, 3))
    with pytest.raises(CheckpointError, match=r"config\.json.*'num_key_value_heads' = 2 .* tensor_parallel_size=4"):
        load_target(tiny_pair[0], "float32", tp=TensorParallel(None, 0, 4))
    whole = load_target(tiny_pair[0], "float32").config
    with pytest.raises(ValueError, match=r"config\.shard\(2\)"):
        Qwen3ForCausalLM(whole, tp=TensorParallel(None, 0, 2))


def test_sharded_shape_mismatch_names_the_weight(tmp_path, tiny_pair):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "bad"
    folder.mkdir()
    for f in tiny_pair[1].iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.gate_proj.weight"] = torch.zeros(66, 32)
    save_file(tensors, folder / "model.safetensors")
    target_cfg = load_target(tiny_pair[0], "float32").config
    with pytest.raises(CheckpointError, match=r"model\.safetensors: weight 'model\.layers\.1\.mlp\.gate_proj\.weight' has "
                                              r"shape \(66, 32\), the config implies \(64, 32\)"):
        load_drafter(folder, target_cfg, "float32", tp=TensorParallel(None, 1, WORLD))


def test_init_outside_torchrun_says_how_to_launch(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node"):
        init_tensor_parallel("cpu")
    with pytest.raises(ValueError, match="'cuda' \\(NCCL\\) or 'cpu' \\(gloo\\)"):
        init_tensor_parallel("meta")


# --------------------------------------------------------------------------------------------------
# the documented launch, and NCCL with captured steps


def test_torchrun_launch_decodes_what_tp1_decodes(tmp_path, tp1):
    """`torchrun --nproc-per-node 2 -m dscale_runtime.distributed` (readme_tp.md): greedy DFlash of two demo
    prompts == the TP1 engine's (its 24-token outputs, cut to 16: greedy outputs are prefixes of longer ones)."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
           str(free_port()), "-m", "dscale_runtime.distributed", "--mode", "dflash", "--dtype", "float32",
           "--num-prompts", "2", "--max-tokens", "16", "--output", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "tensor parallel 2" in run.stdout and run.stdout.count("--- ") == 2, "rank 0 alone prints"
    got = json.loads(out.read_text())
    want = tp1["engine"]["dflash@0.0"]["tokens"][:2]
    assert [g["token_ids"] for g in got] == [w[:16] for w in want]
    assert any(g["mean_acceptance_length"] > 1 for g in got)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason="needs 2 CUDA devices")
def test_tp2_nccl_captured_equals_tp1(tmp_path, tiny_pair):
    """NCCL, every decode step a captured CUDA graph with its collectives inside: TP2 == TP1 (fp32)."""
    want = engine_runs(demo_engine, "cuda")
    got = spawn_ranks(tmp_path, tiny_pair, "cuda")
    for run in want:
        # NOTE: tokens only: on the GPU the split GEMMs sum in another order, so a near-tied draft may flip
        # (acceptance, never output, would then differ).
        assert got[0]["engine"][run]["tokens"] == want[run]["tokens"], run
        assert got[0]["engine"][run] == got[1]["engine"][run], run
        assert got[0]["engine"][run]["cache_kv_heads"] == 1
    assert want["dflash@0.0"]["accepted_drafts"] > 0
