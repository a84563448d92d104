"""The demo-pair recipe: the tiny CPU preset end to end, and train/inference consistency of the drafter."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml

from checkpoints import write_drafter, write_target
from dscale_runtime.attention import build_metadata
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.build import DemoRecipe, build
from dscale_runtime.demo.corpus import is_held_out, split_files, stdlib_root
from dscale_runtime.demo.train import draft_train_forward
from dscale_runtime.engine import Engine
from dscale_runtime.kv_cache import PagedKVCache
from dscale_runtime.models.loader import load_drafter, load_target


def test_build_configs_are_valid_recipes():
    for name in ("demo_build.yaml", "demo_build_tiny.yaml"):
        cfg = yaml.safe_load(open(f"configs/{name}"))
        recipe = DemoRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
        assert recipe.vocab_size <= 8192 and recipe.num_kv_heads < recipe.num_heads and recipe.num_layers >= 4
        assert max(recipe.target_layer_ids) < recipe.num_layers


def test_split_is_by_module_and_deterministic():
    train, held = split_files()
    assert held and train and not set(train) & set(held)
    assert split_files() == (train, held)
    root = stdlib_root()
    assert all(is_held_out(p.relative_to(root).as_posix()) for p in held)
    assert not any(is_held_out(p.relative_to(root).as_posix()) for p in train)
    assert 0.03 < len(held) / (len(held) + len(train)) < 0.2


def test_draft_train_forward_equals_paged_inference(tmp_path):
    target = load_target(write_target(tmp_path / "t"), "float32")
    drafter = load_drafter(write_drafter(tmp_path / "d"), target.config, "float32")
    w, s, b = drafter.config.block_size, 40, 2
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 90, (b, s), generator=gen)
    features = torch.randn(b, s, 2 * 32, generator=gen)
    anchors = torch.tensor([[3, 17], [9, 20]])
    dense = draft_train_forward(drafter, target.model.embed_tokens, features, tokens, anchors)  # [B, nb, W-1, d]
    page = 4
    for i in range(b):
        for j in range(anchors.shape[1]):
            p = int(anchors[i, j])
            cache = PagedKVCache(drafter.config.layers.num_hidden_layers, 32, page, 2, 8, torch.float32, "cpu")
            table = list(range(1, 1 + -(-(p + w) // page)))
            ctx = build_metadata([p], [0], [table], page, "cpu")
            drafter.inject_context(features[i, :p], ctx.positions, ctx.slot_mapping, cache.layers)
            block = torch.full((w,), drafter.config.mask_token_id)
            block[0] = tokens[i, p]
            meta = build_metadata([w], [p], [table], page, "cpu", causal=False)
            paged = drafter(target.embed(block), meta, cache.layers)[1:]
            torch.testing.assert_close(dense[i, j], paged, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    cfg = yaml.safe_load(open("configs/demo_build_tiny.yaml"))
    recipe = DemoRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()})
    report = build(replace(recipe, out=str(out), greedy_cache=str(out / "work" / "greedy.pt")))
    return out, report


def test_greedy_cache_reused_only_for_the_same_target_and_settings(tiny_pair, monkeypatch):
    from dscale_runtime.demo import build as build_mod

    out, report = tiny_pair
    cfg = yaml.safe_load(open("configs/demo_build_tiny.yaml"))
    recipe = replace(DemoRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}),
                     out=str(out), greedy_cache=str(out / "work" / "greedy.pt"))
    saved = torch.load(out / "work" / "greedy.pt", weights_only=True)
    assert saved["sequences"].shape[0] == recipe.gen_sequences
    calls = []
    real = build_mod.generate_sequences
    monkeypatch.setattr(build_mod, "generate_sequences", lambda r, o: calls.append(r) or real(r, o))
    seqs, lens = build_mod.cached_sequences(recipe, out)
    assert calls == [] and torch.equal(seqs, saved["sequences"]) and torch.equal(lens, saved["prompt_lens"])
    other = replace(recipe, gen_new_tokens=recipe.gen_new_tokens // 2)
    seqs, _ = build_mod.cached_sequences(other, out)
    assert len(calls) == 1 and seqs.shape[1] == other.gen_prompt_len + other.gen_new_tokens
    assert torch.load(out / "work" / "greedy.pt", weights_only=True)["sequences"].shape == seqs.shape


def test_tiny_recipe_end_to_end(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, report = tiny_pair
    for key in ("data", "target", "drafter", "eval_cpu"):
        assert key in report
    assert json.loads((out / "build_report.json").read_text())["eval_cpu"]["steps"] == report["eval_cpu"]["steps"]
    tok = AutoTokenizer.from_pretrained(out / "target")
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    assert tok.convert_tokens_to_ids("<|mask|>") == json.loads((out / "drafter/config.json").read_text())[
        "dflash_config"]["mask_token_id"]
    hf = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32)
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads
    prompts = [p["prompt"] for p in json.loads("[" + ",".join((out / "prompts.jsonl").read_text().split("\n")[:-1])
                                               + "]")][:4]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = Engine.from_pretrained(out / "target", config=EngineConfig(mode="target")).generate(prompts, params)
    got = Engine.from_pretrained(out / "target", out / "drafter", config=EngineConfig(mode="dflash")).generate(
        prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_draft_slot_loss_mixes_cross_entropy_and_kl():
    from dscale_runtime.demo.train import draft_slot_loss

    gen = torch.Generator().manual_seed(0)
    logits, teacher = torch.randn(3, 5, 11, generator=gen), torch.randn(3, 5, 11, generator=gen)
    labels = teacher.argmax(-1)
    ce = -torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    p = torch.softmax(teacher, -1)
    kl = (p * (p.log() - torch.log_softmax(logits, -1))).sum(-1)
    torch.testing.assert_close(draft_slot_loss(logits, labels, None, 0.0), ce)
    torch.testing.assert_close(draft_slot_loss(logits, labels, teacher, 1.0), kl)
    torch.testing.assert_close(draft_slot_loss(logits, labels, teacher, 0.25), 0.75 * ce + 0.25 * kl)
    assert draft_slot_loss(teacher, labels, teacher, 1.0).abs().max() < 1e-6  # the teacher itself: no KL
