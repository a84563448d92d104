"""The demo-pair recipe: the tiny CPU preset end to end, and train/inference consistency of the drafter."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import yaml

from checkpoints import write_drafter, write_drafter2, write_target
from dscale_runtime.attention import build_metadata
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.build import STAGES, DemoRecipe, build
from dscale_runtime.demo.corpus import is_held_out, split_files, stdlib_root
from dscale_runtime.demo.train import draft_train_forward
from dscale_runtime.engine import Engine
from dscale_runtime.kv_cache import PagedKVCache
from dscale_runtime.models.loader import load_drafter, load_target


def test_build_configs_are_valid_recipes():
    for name in ("demo_build.yaml", "demo_build_tiny.yaml", "demo_build_dflash2.yaml"):
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


@pytest.mark.parametrize("write", [write_drafter, write_drafter2], ids=["dflash", "dflash2"])
def test_draft_train_forward_equals_paged_inference(tmp_path, write):
    """The recipe's dense training forward is the served paged forward, block for block (DFlash 2: with the block
    convolutions, whose random taps reach the slots before)."""
    target = load_target(write_target(tmp_path / "t"), "float32")
    drafter = load_drafter(write(tmp_path / "d"), target.config, "float32")
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


def assert_dflash_equals_target(out, drafter_dir: str) -> None:
    """DFlash with the built drafter `out/<drafter_dir>` decodes the first held-out prompts as target-only does."""
    from dscale_runtime.demo.prompts import load_prompt_file

    prompts = [p["prompt"] for p in load_prompt_file(out / "prompts.jsonl")[:4]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = Engine.from_pretrained(out / "target", config=EngineConfig(mode="target")).generate(prompts, params)
    got = Engine.from_pretrained(out / "target", out / drafter_dir, config=EngineConfig(mode="dflash")).generate(
        prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


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
    assert_dflash_equals_target(out, "drafter")


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


def test_selector_loss_is_the_walks_score_along_its_own_path(tmp_path):
    """Labels = the selector's own greedy walk: teacher forcing reproduces the walk's scores (`walk_ref`), so every
    slot's best score is its label and the loss is the cross-entropy of those scores; a label outside the top k
    takes the last candidate's place."""
    from dscale_runtime.demo.train import selector_slot_loss
    from dscale_runtime.models.dflash2 import walk_ref

    target = load_target(write_target(tmp_path / "t"), "float32")
    drafter = load_drafter(write_drafter2(tmp_path / "d", selector_top_k=8), target.config, "float32")
    selector = drafter.candidate_selector
    gen = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(6, 5, 32, generator=gen), torch.randn(6, 5, 96, generator=gen)
    first = torch.randint(0, 96, (6,), generator=gen)
    unary, candidates = logits.topk(8, dim=-1)
    path, scores, _ = walk_ref(selector, hidden, unary, candidates, first)
    with torch.no_grad():
        loss, picks = selector_slot_loss(selector, hidden, logits, path, first)
    chosen = (candidates == path[..., None]).long().argmax(-1)
    assert picks.all()
    torch.testing.assert_close(loss, -torch.log_softmax(scores, -1).gather(-1, chosen[..., None])[..., 0])
    outside = logits.argmin(-1)  # never among the top 8
    with torch.no_grad():
        loss, picks = selector_slot_loss(selector, hidden, logits, outside, first)
    prev = torch.cat([first[:, None], outside[:, :-1]], dim=1)
    cands = torch.cat([candidates[..., :-1], outside[..., None]], dim=-1)
    proj = selector.hidden_projection(hidden)
    want = logits.gather(-1, cands) + torch.einsum("npr,npkr->npk", selector.predecessor_codebook[prev] * proj,
                                                     selector.successor_codebook[cands])
    torch.testing.assert_close(loss, -torch.log_softmax(want, -1)[..., -1])
    assert not picks.any()  # a label the top k lack is never picked, whatever it scores


def test_tiny_recipe_builds_a_dflash2_drafter_beside_the_dflash1_one(tiny_pair):
    """`drafter_architecture: dflash2` into `drafter2/` of the tiny pair: z-lab's layout (loaded as a DFlash 2
    drafter), the greedy and T = 1 eval beside the DFlash 1 one, and DFlash over it equal to target-only."""
    from dscale_runtime.models.dflash2 import DFlash2DraftModel

    out, _ = tiny_pair
    cfg = yaml.safe_load(open("configs/demo_build_tiny.yaml"))
    recipe = replace(DemoRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}),
                     out=str(out), greedy_cache=str(out / "work" / "greedy.pt"), stages=("drafter", "eval"),
                     drafter_architecture="dflash2", drafter_dir="drafter2", conv_group_size=16, selector_rank=8,
                     selector_top_k=8, eval_temperatures=(0.0, 1.0))
    report = build(recipe)
    config = json.loads((out / "drafter2" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["selector_top_k"] == 8 and config["dflash_config"]["conv_group_size"] == 16
    target = load_target(out / "target", "float32")
    assert isinstance(load_drafter(out / "drafter2", target.config, "float32"), DFlash2DraftModel)
    assert report["drafter2"]["architecture"] == "DFlash2DraftModel"
    assert report["recipe_drafter2"]["drafter_dir"] == "drafter2"
    assert report["recipe"]["drafter_architecture"] == "dflash" and "eval_cpu" in report
    sampled = report["eval_cpu_drafter2"]["sampled"]["1.0"]
    assert sampled["steps"] > 0 and sampled["mean_acceptance_length"] >= 1.0
    assert "`drafter2/`: a DFlash2DraftModel drafter" in (out / "README.md").read_text()
    assert_dflash_equals_target(out, "drafter2")
    # an eval-only rerun of the DFlash 1 drafter adds its T = 1 figures and keeps the recipe it was built with
    again = build(replace(recipe, stages=("eval",), drafter_architecture="dflash", drafter_dir="drafter"))
    assert again["recipe"]["stages"] == list(STAGES) and "1.0" in again["eval_cpu"]["sampled"]
    assert [r["stages"] for r in again["runs"][-2:]] == [["drafter", "eval"], ["eval"]]
    with pytest.raises(ValueError, match="conv_group_size"):
        build(replace(recipe, conv_group_size=48))
    with pytest.raises(ValueError, match="drafter_dir"):
        build(replace(recipe, drafter_dir="target"))
    with pytest.raises(ValueError, match="drafter_dir"):
        build(replace(recipe, drafter_dir="data"))
