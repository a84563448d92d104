"""Engine tests: DFlash (and later DScale) decoding must reproduce target-only decoding exactly.

Oracle: `mode="target"` greedy decoding of the same checkpoints. Random drafters are almost never
accepted, so a drafter stand-in that proposes the target's own greedy continuation with injected errors
makes every accepted length 0..W-1 occur.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch

from checkpoints import write_drafter, write_target
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.engine import Engine

MAX_LEN = 160


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    write_target(root / "target", tokenizer=True)
    write_drafter(root / "drafter")
    return root / "target", root / "drafter"


def make_engine(pair, mode="dflash", **kwargs) -> Engine:
    cfg = EngineConfig(mode=mode, max_model_len=MAX_LEN, **kwargs)
    return Engine.from_pretrained(pair[0], pair[1] if mode != "target" else None, config=cfg)


def prompt_set(n=36, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(94) for _ in range(rng.choice([1, 2, 5, 17, 33, 60, 90]))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 48)) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="session")
def reference(pair):
    """Target-only greedy outputs; every 4th request also gets a stop string cut from its own output."""
    prompts, params = prompt_set()
    target = make_engine(pair, "target", max_running_requests=32)
    first = target.generate(prompts, params)
    for i in range(0, len(prompts), 4):
        text = first[i].text
        if len(text) > 6:
            params[i] = SamplingParams(temperature=0, max_tokens=params[i].max_tokens, stop=(text[3:5],))
    outputs = make_engine(pair, "target", max_running_requests=32).generate(prompts, params)
    assert any(o.finish_reason == "stop" for o in outputs[::4]), "the stop strings must fire in the reference"
    return prompts, params, outputs


def assert_same(outputs, reference_outputs):
    for got, want in zip(outputs, reference_outputs, strict=True):
        assert got.token_ids == want.token_ids, f"request {got.request_id} diverged"
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason


@pytest.mark.parametrize("max_running", [1, 4, 32])
def test_dflash_greedy_equals_target_greedy(pair, reference, max_running):
    prompts, params, want = reference
    engine = make_engine(pair, max_running_requests=max_running)
    outputs = engine.generate(prompts, params)
    assert_same(outputs, want)
    assert engine.allocator.num_free == engine.allocator.num_pages - 1, "all pages return to the pool"
    for out in outputs:
        assert out.stats.verify_lens and set(out.stats.verify_lens) == {16}


def test_requests_arriving_while_others_run(pair, reference):
    prompts, params, want = reference
    engine = make_engine(pair, max_running_requests=8)
    done, pending = {}, list(range(len(prompts)))
    while pending or engine.has_unfinished():
        for _ in range(min(len(pending), 3)):  # a few arrivals before every step
            i = pending.pop(0)
            engine.add_request(prompts[i], params[i], request_id=str(i))
        for out in engine.step():
            done[int(out.request_id)] = out
    assert_same([done[i] for i in range(len(prompts))], want)


class OracleDrafter:
    """Drafts the target's own greedy continuation, corrupted at a random slot (or not at all): stands in for the
    drafter inside the step runner (`propose`), the real drafter keeps its cache (`inject_context`)."""

    def __init__(self, base, continuations):
        self.base, self.config = base, base.config
        self.continuations = continuations  # request id -> target greedy output, long enough
        self.rng = random.Random(0)
        self.requests = []  # the live requests of the step being drafted, in batch order

    def inject_context(self, *args):
        self.base.inject_context(*args)

    def propose(self, block, target, meta, caches, float_logits=True):
        w = block.shape[1]
        rows = []
        for i, r in enumerate(self.requests):
            # The anchor's index in the request's tokens, from the step's own positions: under the overlap
            # schedule the host has not committed the previous step yet.
            done = int(meta.positions[i * w]) + 1 - len(r.prompt_token_ids)
            proposal = self.continuations[r.request_id][done : done + w - 1]
            proposal += [0] * (w - 1 - len(proposal))  # past the reference's end (max_model_len)
            error_at = self.rng.randrange(w)  # slot 1..w-1 gets a wrong token; 0 means none
            if error_at:
                proposal[error_at - 1] = (proposal[error_at - 1] + 1) % 94
            rows.append(proposal)
        rows += [[0] * (w - 1)] * (block.shape[0] - len(rows))  # bucket padding
        block[:, 1:] = torch.tensor(rows, device=block.device)
        vocab, hidden = target.config.vocab_size, self.config.layers.hidden_size
        # Per-slot confidence drawn at random, so features (and a predictor reading them) vary between requests.
        scale = torch.tensor([[self.rng.uniform(0.5, 8.0) for _ in range(w - 1)] for _ in range(block.shape[0])])
        logits = torch.nn.functional.one_hot(block[:, 1:], vocab).float() * scale[..., None]
        return logits, torch.zeros(block.shape[0], w - 1, hidden, device=block.device)


class OracleDraftEngine(Engine):
    """An engine whose runner drafts with `OracleDrafter`."""

    def __init__(self, *args, continuations, **kwargs):
        super().__init__(*args, **kwargs)
        self.oracle = self.runner.drafter = OracleDrafter(self.drafter, continuations)

    def _decode(self, requests):
        self.oracle.requests = requests
        return super()._decode(requests)


def oracle_setup(pair, num_prompts: int, reach: int):
    """An `OracleDraftEngine` (6 running) drafting the target's greedy continuations of `reach` tokens, the
    prompts, 60-token greedy params and target-only's outputs for them."""
    prompts, _ = prompt_set(num_prompts, seed=3)
    long = SamplingParams(temperature=0, max_tokens=reach, ignore_eos=True)
    continuations = make_engine(pair, "target").generate(prompts, long)
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * len(prompts)
    want = make_engine(pair, "target").generate(prompts, params)
    base = make_engine(pair, max_running_requests=6)
    engine = OracleDraftEngine(base.target, base.drafter, base.config, base.tokenizer, base.eos_token_ids,
                               continuations={str(i): o.token_ids for i, o in enumerate(continuations)})
    return engine, prompts, params, want


def test_oracle_drafts_cover_every_accepted_length(pair):
    engine, prompts, params, want = oracle_setup(pair, 24, 100)
    outputs = engine.generate(prompts, params)
    assert_same(outputs, want)
    seen = collections.Counter(a for o in outputs for a in o.stats.accepted_lens)
    assert set(seen) == set(range(16)), f"accepted lengths seen: {sorted(seen)}"
    assert engine.counters.accepted_drafts > 0


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    write_target(root / "target", vocab=8, hidden=32, seed=5)
    write_drafter(root / "drafter", vocab=8, mask_token_id=7, seed=6)
    return root / "target", root / "drafter"


def test_seeded_requests_reproduce_whatever_the_batch(small_vocab_pair):
    cfg = EngineConfig(mode="dflash", max_model_len=32, max_running_requests=8)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    alone = Engine.from_pretrained(*small_vocab_pair, config=cfg).generate([[1, 2, 3]], seeded)[0]
    crowd = Engine.from_pretrained(*small_vocab_pair, config=cfg).generate(
        [[3, 2, 1]] * 5 + [[1, 2, 3]], [SamplingParams(temperature=1.0, max_tokens=12)] * 5 + [seeded])[-1]
    assert alone.token_ids == crowd.token_ids


def test_cache_smaller_than_demand_queues_preempts_and_empties(pair, reference):
    prompts, params, want = reference
    # Room for about three full-length requests while 16 may run: requests wait and get preempted.
    engine = make_engine(pair, max_running_requests=16, kv_cache_tokens=3 * (MAX_LEN + 16))
    outputs = engine.generate(prompts, params)
    assert_same(outputs, want)
    assert engine.scheduler.num_preemptions > 0 or max(len(p) for p in prompts) < 0
    assert engine.allocator.num_free == engine.allocator.num_pages - 1
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_abort_frees_pages(pair):
    engine = make_engine(pair, max_running_requests=4)
    ids = [engine.add_request([5, 6, 7] * 10, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
           for _ in range(3)]
    engine.step()
    engine.step()
    assert engine.allocator.num_free < engine.allocator.num_pages - 1
    for i in ids:
        engine.abort(i)
    assert engine.allocator.num_free == engine.allocator.num_pages - 1
    assert not engine.has_unfinished()


def test_generate_64_prompts_reports_acceptance_and_steps(pair):
    prompts, params = prompt_set(64, seed=7)
    engine = make_engine(pair, max_running_requests=16)
    outputs = engine.generate(prompts, params)
    assert len(outputs) == 64
    for out in outputs:
        stats = out.stats
        assert stats.num_steps == len(stats.accepted_lens) >= (1 if len(out.token_ids) > 1 else 0)
        if stats.accepted_lens:
            assert stats.mean_acceptance_length == pytest.approx(1 + sum(stats.accepted_lens) / stats.num_steps)
    assert engine.counters.steps > 0 and engine.counters.request_steps >= sum(o.stats.num_steps for o in outputs)
    assert max(s for s in (engine.last_step.num_live,)) <= 16


def test_bad_requests_raise_clear_errors(pair):
    engine = make_engine(pair)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * MAX_LEN)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match=r"\[0, 96\)"):
        engine.add_request([1000])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        make_engine(pair, kv_cache_tokens=10)
    with pytest.raises(ValueError, match="mode"):
        EngineConfig(mode="medusa")


def test_string_prompts_use_the_target_tokenizer(pair):
    engine = make_engine(pair, "target")
    by_text = engine.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=8))[0]
    by_ids = engine.generate([engine.tokenizer.encode("def f(x):", add_special_tokens=False)],
                             SamplingParams(temperature=0, max_tokens=8))[0]
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == engine.tokenizer.decode(by_text.token_ids, skip_special_tokens=True)


def test_generate_decodes_texts_as_step_does(pair):
    """`generate` decodes its outputs' texts in one batch at the end (`Engine._set_texts`): the texts (cut before a
    stop string) that `step()` gives the same requests one by one."""
    engine = make_engine(pair, "target")
    prompts = ["def f(x):", "import os", "class A:", [3, 4, 5]]
    params = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0, max_tokens=12)]
    batch = engine.generate(prompts, params)
    params[0] = SamplingParams(temperature=0, max_tokens=12, stop=(batch[0].text[3:5],))  # cut inside the text
    batch = engine.generate(prompts, params)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    by_step = {}
    while len(by_step) < len(ids):
        by_step.update((o.request_id, o) for o in engine.step())
    assert [o.token_ids for o in batch] == [by_step[i].token_ids for i in ids]
    assert [o.text for o in batch] == [by_step[i].text for i in ids]
    assert len(batch[0].text) <= 3 and all(o.text is not None for o in batch)


def test_a_batch_of_string_prompts_tokenizes_as_one_prompt_at_a_time():
    """`generate` tokenizes its strings in one batch call (`Engine._encode_batch`): the ids of
    `tokenizer.encode(text, add_special_tokens=False)` for each, on the demo pair's Qwen tokenizer (special tokens,
    code, non-ASCII, whitespace), id prompts left as they are."""
    from types import SimpleNamespace

    from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
    from dscale_runtime.models.loader import load_tokenizer

    tokenizer = load_tokenizer(DEMO_DIR / "target")
    texts = [p["prompt"] for p in stdlib_prompts()[:6]] + [
        "<|im_start|>user\nhi<|im_end|>", "  leading and trailing  ", "naïve café 数据 🙂", "\t\n", "x"]
    prompts = texts[:3] + [[5, 6, 7]] + texts[3:]
    encoded = Engine._encode_batch(SimpleNamespace(tokenizer=tokenizer), prompts)
    assert encoded[3] == [5, 6, 7]
    assert [list(e) for i, e in enumerate(encoded) if i != 3] == [
        tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert Engine._encode_batch(SimpleNamespace(tokenizer=None), prompts) == prompts  # add_request's error, as before


def test_commit_stops_inside_an_accepted_run(pair):
    """Stop rules apply token by token to the accepted drafts + successor: nothing past them is emitted."""
    from dscale_runtime.scheduler import Request

    engine = make_engine(pair)
    eos = engine.tokenizer.convert_tokens_to_ids("<eos>")
    cases = [
        # (params, accepted drafts + successor, kept output, finish reason)
        (SamplingParams(max_tokens=50), [5, 6, eos, 7, 8], [5, 6, eos], "stop"),
        (SamplingParams(max_tokens=50, stop_token_ids=(6,)), [5, 6, 7], [5, 6], "stop"),
        (SamplingParams(max_tokens=3), [5, 6, 7, 8, 9], [5, 6, 7], "length"),
        (SamplingParams(max_tokens=50, ignore_eos=True), [5, eos, 7], [5, eos, 7], None),
        # A stop string ends the output at the token completing it; the text is cut before the string.
        (SamplingParams(max_tokens=50, stop=("CD",)), [33, 34, 35, 36, 37], [33, 34, 35, 36], "stop"),
    ]
    for params, new, kept, reason in cases:
        request = Request("r", [1, 2, 3], params)
        engine.scheduler.running.append(request)
        finished = engine._commit(request, new)
        assert request.output_token_ids == kept
        assert finished == (reason is not None) and request.finish_reason == reason
        if reason is None:
            engine.scheduler.finish(request, "abort")
    out = engine._output(Request("s", [1], SamplingParams(stop=("CD",)), output_token_ids=[33, 34, 35, 36]))
    assert out.text == "AB"


def test_commit_equals_the_rules_applied_token_by_token(pair):
    """The commit without stop strings (one pass over the new tokens) against the rules applied token by token:
    stop ids and EOS (unless ignore_eos) before the length limits (max_tokens, max_model_len), ties included."""
    from dscale_runtime.scheduler import Request

    engine = make_engine(pair)
    eos = sorted(engine.eos_token_ids)[0]
    rng = random.Random(7)
    for trial in range(400):
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=tuple(rng.sample(range(5, 9), rng.randint(0, 2))))
        prompt = [1] * rng.choice([2, MAX_LEN - 9, MAX_LEN - 3])
        request = Request(str(trial), prompt, params, output_token_ids=[9] * rng.randint(0, params.max_tokens - 1))
        new = [rng.choice([5, 6, 7, 8, 10, 11, eos]) for _ in range(rng.randint(0, 8))]
        want, reason = list(request.output_token_ids), None  # NOTE: the oracle, token by token
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {eos})
        for token in new:
            want.append(token)
            if token in stops:
                reason = "stop"
            elif len(want) >= params.max_tokens or len(prompt) + len(want) >= MAX_LEN:
                reason = "length"
            if reason:
                break
        engine.scheduler.running.append(request)
        before, had = engine.counters.generated_tokens, len(request.output_token_ids)
        assert engine._commit(request, new) == (reason is not None), trial
        assert (request.output_token_ids, request.finish_reason) == (want, reason), trial
        assert engine.counters.generated_tokens - before == len(want) - had, trial
        if reason is None:
            engine.scheduler.finish(request, "abort")


@pytest.mark.parametrize("where", ["decode", "prefill", "commit"])
def test_a_fault_of_one_request_aborts_it_alone(pair, monkeypatch, where):
    """A step part that raises whenever one poisoned request (marked by top_k = 77) is in its batch: that
    request finishes with finish_reason 'error', every other request decodes its target-only greedy tokens."""
    prompts, params = prompt_set(8, seed=2)
    engine = make_engine(pair, max_running_requests=8)
    poison = SamplingParams(temperature=0, top_k=77, max_tokens=20, ignore_eos=True)
    if where == "decode":
        launch = engine.runner.launch

        def faulty(anchors, ctx, pages, sampling, *args):
            if any(s[2] == 77 for s in sampling):
                raise RuntimeError("injected fault")
            return launch(anchors, ctx, pages, sampling, *args)

        monkeypatch.setattr(engine.runner, "launch", faulty)
    elif where == "prefill":
        prefill = engine._prefill

        def faulty(requests):
            if any(r.params.top_k == 77 for r in requests):
                raise RuntimeError("injected fault")
            return prefill(requests)

        faulty.__name__ = "_prefill"
        monkeypatch.setattr(engine, "_prefill", faulty)
    else:
        commit = engine._commit

        def faulty(request, tokens):
            if request.params.top_k == 77 and request.output_token_ids:
                raise RuntimeError("injected fault")
            return commit(request, tokens)

        monkeypatch.setattr(engine, "_commit", faulty)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.add_request([5, 6, 7], poison, request_id="poisoned")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    bad = done.pop("poisoned")
    assert bad.finish_reason == "error" and "RuntimeError" in bad.error
    want = make_engine(pair, "target", max_running_requests=8).generate(prompts, params)
    assert [done[i].token_ids for i in ids] == [o.token_ids for o in want]
    assert all(o.finish_reason != "error" for o in done.values())
