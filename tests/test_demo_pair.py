"""The shipped demo pair (artifacts/demo): loadable everywhere, small, and our engine equals transformers."""

from __future__ import annotations

import json

import pytest
import torch

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import DEMO_DIR, demo_prompts, humaneval_prompts, stdlib_prompts
from dscale_runtime.engine import Engine
from dscale_runtime.models.loader import load_drafter, load_target


def test_artifacts_are_complete_and_small():
    """Issue 4's 40 MiB for the pair and its DFlash 1 drafter; 12 MiB more for the DFlash 2 drafter (issue 26), so
    the working tree that travels to a GPU machine stays well inside its 64 MiB."""
    sizes = {p: p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file()}
    second = sum(n for p, n in sizes.items() if p.is_relative_to(DEMO_DIR / "drafter2"))
    assert sum(sizes.values()) - second <= 40 * 2**20, f"artifacts/demo holds {sum(sizes.values()) / 2**20:.1f} MiB"
    assert 0 < second <= 12 * 2**20, f"artifacts/demo/drafter2 holds {second / 2**20:.1f} MiB"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"):
        assert (DEMO_DIR / "target" / name).is_file()
    cfg = json.loads((DEMO_DIR / "drafter" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "dflash_config" in cfg
    target = load_target(DEMO_DIR / "target", "float32")
    drafter = load_drafter(DEMO_DIR / "drafter", target.config, "float32")
    assert target.config.num_hidden_layers >= 4 and target.config.num_key_value_heads < target.config.num_attention_heads
    assert drafter.config.block_size == 16 and target.config.vocab_size <= 8192
    cfg2 = json.loads((DEMO_DIR / "drafter2" / "config.json").read_text())
    assert cfg2["architectures"] == ["DFlash2DraftModel"] and cfg2["dflash_config"]["selector_top_k"] == 16
    drafter2 = load_drafter(DEMO_DIR / "drafter2", target.config, "float32")
    assert type(drafter2).__name__ == "DFlash2DraftModel" and drafter2.config.block_size == 16


def test_prompt_sets():
    stdlib = stdlib_prompts()
    assert len(stdlib) >= 128 and all(p["dataset"] == "stdlib-heldout" for p in stdlib)
    assert all(p["prompt"].lstrip().startswith(("def ", "async def ", "@")) for p in stdlib)
    assert len({p["id"] for p in stdlib}) == len(stdlib)
    he = humaneval_prompts()
    assert len(he) == 164 and he[0]["id"] == "HumanEval/0"
    assert len(demo_prompts()) == len(stdlib) + 164


def test_engine_greedy_equals_transformers_generate():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    hf = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    prompts = [p["prompt"] for p in stdlib_prompts()[:16]]
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter",
                                    config=EngineConfig(mode="dflash", max_running_requests=16, max_model_len=1024))
    ours = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=64))
    eos = set(engine.eos_token_ids)
    for prompt, out in zip(prompts, ours):
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            gen = hf.generate(ids, max_new_tokens=64, do_sample=False, attention_mask=torch.ones_like(ids))
        want = gen[0, ids.shape[1]:].tolist()
        cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
        assert out.token_ids == want[:cut]
    assert engine.counters.accepted_drafts > 0


def test_dscale_with_the_demo_predictor_is_lossless():
    prompts = [p["prompt"] for p in stdlib_prompts()[16:32]]
    params = SamplingParams(temperature=0, max_tokens=64)
    base = dict(max_running_requests=16, max_model_len=1024)
    want = Engine.from_pretrained(DEMO_DIR / "target", config=EngineConfig(mode="target", **base)).generate(
        prompts, params)
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter", predictor=DEMO_DIR.parent / "demo.pt",
                                    config=EngineConfig(mode="dscale", measure_retention=True, **base))
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    c = engine.counters
    assert c.verify_rows < 16 * c.request_steps * 0.6  # about half the rows of full width
    assert c.retained_drafts / c.full_width_drafts > 0.9


def greedy_target_only(first: int, last: int) -> tuple[list[str], SamplingParams, dict, list[list[int]]]:
    """Held-out prompts [first:last], 48 greedy tokens, fp32 engine settings, and target-only's tokens: the oracle
    of the lossless tests below."""
    prompts = [p["prompt"] for p in stdlib_prompts()[first:last]]
    params = SamplingParams(temperature=0, max_tokens=48)
    base = dict(max_running_requests=8, max_model_len=1024, dtype="float32")
    want = [o.token_ids for o in Engine.from_pretrained(
        DEMO_DIR / "target", config=EngineConfig(mode="target", **base)).generate(prompts, params)]
    return prompts, params, base, want


def test_the_dflash2_drafter_and_dscale_over_it_are_lossless():
    """The shipped DFlash 2 drafter (drafter2/) and DScale over it with its predictor (artifacts/demo_dflash2.pt):
    greedy output equals target-only's; DScale verifies about half the rows of full width; the DFlash 2 drafter
    accepts more drafts per step than the DFlash 1 drafter on the same prompts."""
    prompts, params, base, want = greedy_target_only(40, 48)
    accepted = {}
    for drafter, mode, predictor in [("drafter", "dflash", None), ("drafter2", "dflash", None),
                                     ("drafter2", "dscale", DEMO_DIR.parent / "demo_dflash2.pt")]:
        engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / drafter, predictor=predictor,
                                        config=EngineConfig(mode=mode, **base))
        assert [o.token_ids for o in engine.generate(prompts, params)] == want, (drafter, mode)
        c = engine.counters
        accepted[drafter, mode] = c.accepted_drafts / c.request_steps
        if mode == "dscale":
            assert c.verify_rows < 16 * c.request_steps * 0.6
    assert accepted["drafter2", "dflash"] > accepted["drafter", "dflash"] > 0


def test_bf16_drafter_beside_fp32_target_is_lossless():
    """draft_dtype changes what is drafted, never what is emitted; the drafter stays nearly as good."""
    prompts, params, base, want = greedy_target_only(32, 40)
    accepted = {}
    for draft_dtype, mode, graphs in [(None, "dflash", False), ("bfloat16", "dflash", False),
                                      ("bfloat16", "dscale", False), ("bfloat16", "dscale", True)]:
        predictor = DEMO_DIR.parent / "demo.pt" if mode == "dscale" else None
        engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter", predictor=predictor,
                                        config=EngineConfig(mode=mode, draft_dtype=draft_dtype, step_graphs=graphs,
                                                            **base))
        assert engine.target.lm_head.weight.dtype == torch.float32
        want_dtype = torch.bfloat16 if draft_dtype else torch.float32
        assert engine.drafter.dtype == engine.drafter_cache.k.dtype == want_dtype
        assert [o.token_ids for o in engine.generate(prompts, params)] == want, (draft_dtype, mode, graphs)
        accepted[draft_dtype, mode, graphs] = engine.counters.accepted_drafts / engine.counters.request_steps
    assert accepted["bfloat16", "dflash", False] > 0.9 * accepted[None, "dflash", False] > 0
    assert accepted["bfloat16", "dscale", True] == pytest.approx(accepted["bfloat16", "dscale", False])


def test_draft_dtype_is_checked():
    with pytest.raises(ValueError, match="EngineConfig.draft_dtype must be None or one of"):
        EngineConfig(draft_dtype="int8")
    with pytest.raises(ValueError, match="EngineConfig.dtype must be one of"):
        EngineConfig(dtype="float64")


def test_demo_predictor_refuses_a_different_drafter(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from dscale_runtime.dvl.predictor import PredictorError

    drafter = tmp_path / "drafter"
    shutil.copytree(DEMO_DIR / "drafter", drafter)
    weights = load_file(drafter / "model.safetensors")
    weights["norm.weight"] = weights["norm.weight"] * 1.01  # same shapes and config, other weights
    save_file(weights, str(drafter / "model.safetensors"))
    with pytest.raises(PredictorError, match="model.safetensors"):
        Engine.from_pretrained(DEMO_DIR / "target", drafter, predictor=DEMO_DIR.parent / "demo.pt",
                               config=EngineConfig(mode="dscale", max_model_len=1024))


@torch.no_grad()
def test_near_tie_report_finds_the_first_difference_and_its_margin():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dscale_runtime.demo.ties import near_ties

    prompts = [p["prompt"] for p in stdlib_prompts()[:2]]
    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    hf = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    ids = tok(prompts[1], add_special_tokens=False)["input_ids"]
    greedy = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
    logits = hf(torch.tensor([ids + greedy[:3]])).logits[0, -1]
    top = logits.topk(2)
    swapped = greedy[:3] + [top.indices[1].item()] + greedy[4:]
    same = [[5, 6, 7], greedy]
    report = near_ties(DEMO_DIR / "target", prompts, same, [[5, 6, 7], swapped])
    assert len(report) == 1 and report[0]["prompt"] == 1 and report[0]["first_difference"] == 3
    assert report[0]["fp32_top2_margin"] == pytest.approx((top.values[0] - top.values[1]).item(), abs=1e-3)
    assert near_ties(DEMO_DIR / "target", prompts, same, same) == []


def test_target_only_steps_leave_the_drafter_context_to_a_catch_up_before_drafting(monkeypatch):
    """A speculative engine's target-only steps (the target fallback's) skip the drafter's context, and the engine
    writes it just before the request's next speculative step (`Engine._catch_up_context`). Oracle: the same forced
    pattern of target-only and DFlash steps with every step writing the context (`StepRunner.DEFER_CONTEXT` off):
    every DFlash step accepts the same drafts (the trained demo drafter accepts ~3 of 15 greedily), which it does
    not without the catch-up; the tokens equal target-only decoding's, with the overlap schedule on and off."""
    import itertools

    from dscale_runtime.runner import StepRunner

    prompts = [p["prompt"] for p in stdlib_prompts()[:4]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = dict(max_running_requests=4, max_model_len=512, dtype="float32")
    want = [o.token_ids for o in Engine.from_pretrained(
        DEMO_DIR / "target", config=EngineConfig(mode="target", **base)).generate(prompts, params)]

    def run(defer: bool, overlap: bool, catch_up: bool = True):
        monkeypatch.setattr(StepRunner, "DEFER_CONTEXT", defer)
        engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter",
                                        config=EngineConfig(mode="dflash", overlap_schedule=overlap, **base))
        steps = itertools.count()
        engine._mode_for = lambda n, probe=True: "target" if next(steps) % 7 < 4 else "dflash"
        if not catch_up:
            engine._catch_up_context = lambda requests: [setattr(r, "context_from", None) for r in requests]
        engine.keep_history = True
        outputs = engine.generate(prompts, params)
        assert [o.token_ids for o in outputs] == want
        return engine, [o.stats.accepted_lens for o in outputs]

    def per_draft_step(engine) -> float:  # accepted drafts per request in a DFlash step
        rows = [a for step in engine.counters.history for a, k in zip(step.accepted_lens, step.verify_lens) if k > 1]
        return sum(rows) / len(rows)

    writing, accepted = run(False, overlap=False)
    assert writing.counters.context_tokens == 0 and sum(map(sum, accepted)) > 2 * len(prompts)
    deferred, same = run(True, overlap=False)
    assert same == accepted
    assert deferred.counters.steps_by_mode == writing.counters.steps_by_mode
    # A position a target-only step decoded is written once, before a DFlash step, or never (its request ended)
    assert 0 < deferred.counters.context_tokens <= deferred.counters.steps_by_mode["target"] * len(prompts)
    assert run(True, overlap=False, catch_up=False)[1] != accepted
    # Overlapped, a DFlash step due while a request's target-only step is uncommitted runs target-only instead, and the
    # next step commits first: drafting never reads a missing context.
    overlapped, _ = run(True, overlap=True)
    assert overlapped.counters.context_tokens > 0
    assert per_draft_step(overlapped) >= 0.8 * per_draft_step(writing), (per_draft_step(overlapped),
                                                                       per_draft_step(writing))
    assert all(r.context_from is None for r in overlapped.scheduler.running)


def test_pages_without_their_drafter_context_are_not_offered_to_the_prefix_cache():
    """A request's pages are registered only up to its first position without drafter context (a hit would start
    drafting from a context no step wrote); a preemption forgets the gap with the computed tokens."""
    from dscale_runtime.prefix_cache import PrefixCachingAllocator
    from dscale_runtime.scheduler import Request, Scheduler

    allocator = PrefixCachingAllocator(16, 4)
    scheduler = Scheduler(allocator, max_running=2, lookahead=1)
    tokens = list(range(1, 18))
    request = Request("a", tokens, SamplingParams(max_tokens=4))
    scheduler.add(request)
    scheduler.schedule()
    request.num_computed, request.context_from = 16, 9  # target-only steps from position 9 on
    scheduler.register(request)
    assert len(allocator.match(tokens, count=False)) == 2  # the pages of positions 0-7, not 8-15
    scheduler._preempt(request)
    assert request.context_from is None and request.num_computed == 0
