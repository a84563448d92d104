"""Prefill in token buckets (issue 24): the bucket buffers index what `build_metadata` indexes, padded prefill
(what CUDA graphs replay, run eagerly here) decodes target-only's tokens, and the chunk budget beside decoding
follows the measured step times. Oracle: target-only decoding with unpadded prefill, chunks and caching off."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from test_engine import assert_same, make_engine, pair  # noqa: F401 - fixtures
from dscale_runtime.attention import build_metadata
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.prefill import PrefillBuffers, PrefillChunk, default_prefill_buckets


def test_default_buckets_step_by_at_most_a_half_and_end_at_the_largest():
    sizes = default_prefill_buckets(8192)
    assert sizes[:5] == [16, 32, 64, 128, 256] and sizes[-1] == 8192
    assert all(b % 16 == 0 for b in sizes)
    assert all(b / a <= 2 for a, b in zip(sizes, sizes[1:]))
    assert all(b / a <= 1.5 for a, b in zip(sizes, sizes[1:]) if a >= 256)
    assert default_prefill_buckets(100) == [16, 32, 64, 112]


def test_bucket_buffers_index_what_build_metadata_indexes():
    rng = random.Random(1)
    page, max_pages = 16, 12
    chunks = []
    for _ in range(5):
        start, n = rng.randrange(0, 60), rng.randrange(1, 40)
        pages = rng.sample(range(1, 200), -(-(start + n) // page))
        chunks.append(PrefillChunk([rng.randrange(50) for _ in range(n)], start, pages))
    buf = PrefillBuffers(256, 8, max_pages, page, torch.device("cpu"))
    buf.fill(chunks, dummy_slot=99)
    want = build_metadata([len(c.tokens) for c in chunks], [c.start for c in chunks], [c.pages for c in chunks], page,
                          "cpu")
    t, n = sum(len(c.tokens) for c in chunks), len(chunks)
    for name in ("row_req", "row_local", "positions", "slot_mapping"):
        assert torch.equal(getattr(buf, name)[:t], getattr(want, name)), name
    assert torch.equal(buf.token_ids[:t], torch.tensor([x for c in chunks for x in c.tokens]))
    assert torch.equal(buf.kv_lens[:n], want.kv_lens) and torch.equal(buf.query_lens[:n], want.query_lens)
    assert torch.equal(buf.query_starts[:n], want.query_starts)
    assert torch.equal(buf.block_tables[:n, : want.block_tables.shape[1]], want.block_tables)
    # Padding: the pseudo request (slot 8) owns every row past t at position 0 of the scratch page; empty slots
    # own nothing; no slot draws (all point at the dummy state row).
    assert (buf.row_req[t:] == 8).all() and (buf.positions[t:] == 0).all() and (buf.slot_mapping[t:] == 0).all()
    assert buf.query_lens[8] == 256 - t and (buf.query_lens[n:8] == 0).all() and (buf.slots == 99).all()
    assert torch.equal(buf.last_rows[:n], want.query_starts + want.query_lens - 1)


def prefill_runs(engine) -> list[tuple[int, int]]:
    """From now on, record (engine step number, tokens) of every prefill the engine runs."""
    steps, runs, real_step, real_run = [0], [], engine.step, engine.prefiller.run

    def counted_step():
        steps[0] += 1
        return real_step()

    def counted_run(chunks):
        runs.append((steps[0], sum(len(c.tokens) for c in chunks)))
        return real_run(chunks)

    engine.step, engine.prefiller.run = counted_step, counted_run
    return runs


def tokens_per_step(runs: list[tuple[int, int]]) -> list[int]:
    """Prefilled tokens of each engine step that prefilled (`prefill_runs`)."""
    totals: dict[int, int] = {}
    for step, tokens in runs:
        totals[step] = totals.get(step, 0) + tokens
    return list(totals.values())


@pytest.fixture(scope="module")
def plain(pair):  # noqa: F811
    rng = random.Random(7)
    system = [rng.randrange(94) for _ in range(40)]
    prompts = [(system if i % 2 else []) + [rng.randrange(94) for _ in range(rng.choice([1, 9, 30, 70]))]
               for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(6, 30), ignore_eos=True) if i % 3 else
              SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True, seed=40 + i)
              for i in range(10)]
    engine = make_engine(pair, "target", max_running_requests=10, prefix_caching=False, chunked_prefill_tokens=0,
                         sampling_rule="top1")
    return prompts, params, engine.generate(prompts, params)


@pytest.mark.parametrize("mode,chunk", [("target", 0), ("dflash", 24), ("dflash", 0), ("target", 200)])
def test_padded_bucket_prefill_decodes_target_only_tokens(pair, plain, mode, chunk):  # noqa: F811
    """Prefills padded to 16 / 48-token buckets (what the graphs replay), mixed greedy and seeded top-1 sampling
    (target-only's own draws), with prefix caching: target-only's tokens. A step's prefill runs in groups of at most
    the largest bucket's tokens: with a 200-token budget, several 48-token prefills in one step and none eager; with
    chunking off, a whole prompt above 48 tokens prefills eagerly."""
    prompts, params, want = plain
    engine = make_engine(pair, mode, max_running_requests=5, prefill_buckets=(16, 48), chunked_prefill_tokens=chunk,
                         sampling_rule="top1")
    ran = []
    real_run, real_get = engine.prefiller.run, engine.prefiller.get

    def spy_run(chunks):
        ran.append([len(chunks), None])
        return real_run(chunks)

    def spy_get(tokens, sampled, filtered, slots=None):
        step = real_get(tokens, sampled, filtered, slots)
        ran[-1][1] = step.buf.requests
        return step

    engine.prefiller.run, engine.prefiller.get = spy_run, spy_get
    runs = prefill_runs(engine)
    assert_same(engine.generate(prompts, params), want)
    assert engine.prefiller.pad and engine.prefiller.buckets == [16, 48]
    assert (engine.prefiller.eager_calls > 0) == (chunk == 0)  # whole 70+ token prompts run above the buckets
    if chunk > 48:  # the budget alone would have prefilled several prompts together, above 48 tokens, eagerly
        assert max(t for _, t in runs) <= 48 < max(tokens_per_step(runs)) <= chunk, runs
    # n requests replay the bucket's smallest variant of at least n slots (1, 4, 5 of 5): one request's chunk one
    # slot, a group of 2-4 the four-slot variant
    assert engine.prefiller.slot_counts == (1, 4, 5)
    replays = [(n, slots) for n, slots in ran if slots is not None]
    assert all(slots == (1 if n == 1 else 4 if n <= 4 else 5) for n, slots in replays), replays
    assert {1, 4} <= {slots for _, slots in replays}, replays
    assert engine.prefix_cache_stats["hit_tokens"] > 0


def test_chunk_budget_beside_decoding_follows_the_measured_times(pair, plain):  # noqa: F811
    """With the start-up times a GPU engine measures (here given), a step's chunk beside decoding is the largest
    bucket whose prefill lasts at most prefill_stall_ratio x the decode step; alone it takes the whole budget."""
    prompts, params, want = plain
    engine = make_engine(pair, "dflash", max_running_requests=5, prefill_buckets=(16, 32, 64),
                         chunked_prefill_tokens=64, prefill_stall_ratio=1.0, sampling_rule="top1",
                         prefix_caching=False)  # NOTE: each run below prefills every prompt whole
    engine.prefiller.bucket_ms = {16: (0.2, 0.3, 100), 32: (0.5, 0.9, 100), 64: (1.5, 2.0, 100)}
    engine.decode_ms = {b: 0.6 for b in engine.runner.buckets}
    assert engine.prefiller.budget(0.6, 64, ctx=0) == 32 and engine.prefiller.budget(0.6, 64, ctx=50) == 16
    # Several requests waiting: the full buckets' times bound the chunk (unmeasured: one request's times)
    engine.prefiller.many_ms = {16: (0.35, 0.4, 100), 32: (0.7, 1.0, 100), 64: (1.9, 2.4, 100)}
    assert engine.prefiller.budget(0.6, 64, ctx=0, many=True) == 16 and engine.prefiller.budget(0.6, 64, ctx=0) == 32
    assert engine.prefiller.budget(0.6, 64, requests=5) == 16 and engine.prefiller.budget(0.6, 64, requests=1) == 32
    # ... each bucket's variant for that many requests where measured (slots 1, 4, 5: two to four requests replay
    # the 4-slot variant), else the full bucket's times
    engine.prefiller.group_ms = {4: {16: (0.25, 0.3, 100), 32: (0.55, 0.8, 100), 64: (1.6, 2.1, 100)}}
    assert [engine.prefiller.budget(0.6, 64, requests=n) for n in (1, 2, 3, 4, 5)] == [32, 32, 32, 32, 16]
    assert engine.prefiller.budget(0.6, 64, ctx=50, requests=3) == 16  # 0.55 + 0.25 x 50 / 100 > 0.6
    del engine.prefiller.group_ms[4][32]
    assert engine.prefiller.budget(0.6, 64, requests=3) == 16
    engine.prefiller.group_ms = {}
    engine.prefiller.many_ms = {}
    assert engine.prefiller.budget(0.6, 64, ctx=0, many=True) == 32
    # Below the cheapest chunk's time the bound is 1.5 x that time (weight-bound prefill: tokens come cheap)
    assert engine.prefiller.budget(0.1, 64, ctx=100) == 16
    weight_bound = {16: (4.0, 4.1, 100), 32: (4.2, 4.3, 100), 64: (5.5, 5.6, 100)}
    saved, engine.prefiller.bucket_ms = engine.prefiller.bucket_ms, weight_bound
    assert engine.prefiller.budget(3.0, 64) == 64 and engine.prefiller.budget(3.0, 48) == 48
    engine.prefiller.bucket_ms = saved
    # The reference is the device step, or the driving loop's live cycle where longer, capped at 8 device steps
    engine.cycle_ms = None
    assert engine.stall_reference_ms(2) == 0.6
    engine.cycle_ms = 3.0
    assert engine.stall_reference_ms(2) == 3.0
    engine.cycle_ms = 60.0
    assert engine.stall_reference_ms(2) == pytest.approx(8 * 0.6)
    chunks = []
    real = engine._prefill

    def spy(requests):
        decoding = sum(1 for r in engine.scheduler.running if not r.prefilling)
        chunks.append((decoding, sum(r.prefill_chunk for r in requests)))
        return real(requests)

    engine._prefill = spy
    asked, real_budget = [], engine.prefiller.budget

    def budget_spy(*args, **kwargs):  # the engine names how many requests wait to prefill
        asked.append((kwargs.get("requests"), sum(1 for r in engine.scheduler.running if r.prefilling)))
        return real_budget(*args, **kwargs)

    engine.prefiller.budget = budget_spy
    engine._time_cycle = lambda: None  # NOTE: the CPU's own cycles (tens of ms) would lift the bound
    for cycle_ms, n in ((None, len(prompts)), (3.0, 5)):  # a host-bound loop (3 ms cycles): 64-token chunks
        chunks.clear()
        engine.cycle_ms = cycle_ms
        assert_same(engine.generate(prompts[:n], params[:n]), want[:n])
        beside = [tokens for decoding, tokens in chunks if decoding]
        alone = [tokens for decoding, tokens in chunks if not decoding]
        assert beside and max(alone) > 32 and (max(beside) <= 32) == (cycle_ms is None), (cycle_ms, beside)
    assert asked and all(given == waiting for given, waiting in asked) and max(given for given, _ in asked) > 1, asked


def test_the_chunk_budgets_decode_times_are_the_served_steps(pair, monkeypatch):  # noqa: F811
    """`Engine._time_decode_steps` (CUDA engines, at start-up): a bucket's time from the measured policy is reused
    only while the policy's graphs are the served ones; after the policy dropped them (a DScale engine on DFlash
    steps only) the served step is timed, as in a DFlash engine. Here the CUDA timer is replaced by fixed samples."""
    import dscale_runtime.runner as runner_module

    engine = make_engine(pair, "dflash", max_running_requests=4, sampling_rule="top1")
    runner = engine.runner
    timed = []
    # NOTE: the timer `BucketStep.timed_ms` reads
    monkeypatch.setattr(runner_module, "cuda_times", lambda step, reps: timed.append(step) or [3.0, 1.0, 2.0])
    runner.policy_ms = {b: {"dflash": 9.0, "dscale": 8.0} for b in runner.buckets}
    assert runner.policy_steps_served and engine._time_decode_steps() == {b: 9.0 for b in runner.buckets}
    assert not timed
    runner.policy_steps_served = False
    assert engine._time_decode_steps() == {b: 2.0 for b in runner.buckets}
    assert [s.buf.size for s in timed] == runner.buckets and all(s.kind.mode == "dflash" for s in timed)


def test_cycle_time_follows_the_driving_loop(pair):  # noqa: F811
    """`Engine.cycle_ms`: the wall time between `step` calls while requests decode, cycles near a prefill left
    out; a loop that sleeps 30 ms between steps (a busy server) reads >= 30 ms, an idle gap counts nothing."""
    import time

    engine = make_engine(pair, "dflash", max_running_requests=2, sampling_rule="top1")
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        time.sleep(0.03)
    assert steps > 5 and engine.cycle_ms is not None and 30 <= engine.cycle_ms < 1000
    seen = engine.cycle_ms
    time.sleep(0.3)  # idle: the next run's first cycles follow an admission, the gap is no cycle
    engine.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.cycle_ms == seen


def test_prefill_options_are_checked():
    with pytest.raises(ValueError, match="prefill_buckets"):
        EngineConfig(prefill_buckets=(0, 16))
    with pytest.raises(ValueError, match="prefill_stall_ratio"):
        EngineConfig(prefill_stall_ratio=-1)
    assert EngineConfig(prefill_buckets=(64, 16, 16)).prefill_buckets == (16, 64)


def test_admission_in_groups_holds_only_while_the_queue_fills_a_group(pair, plain):  # noqa: F811
    """admission_group=3: while requests decode and 3 or more wait, admission waits for 3 free slots (at most
    ADMISSION_HOLD_STEPS steps); a shorter queue is admitted at once; the tokens are target-only's."""
    from dscale_runtime.scheduler import ADMISSION_HOLD_STEPS

    prompts, params, want = plain
    outputs = {}
    for group in (1, 3):
        engine = make_engine(pair, "dflash", max_running_requests=4, admission_group=group, sampling_rule="top1")
        scheduler, events = engine.scheduler, []
        real = scheduler.admit

        def admit(real=real, scheduler=scheduler, events=events):
            before = (len(scheduler.waiting), scheduler.max_running - len(scheduler.running), scheduler._held,
                      any(not r.prefilling for r in scheduler.running))
            admitted = real()
            events.append((*before, len(admitted)))
            return admitted

        scheduler.admit = admit
        outputs[group] = engine.generate(prompts, params)
        assert_same(outputs[group], want)
        admissions = [e for e in events if e[-1]]
        if group == 3:
            for waiting, free, held, decoding, count in admissions:
                if decoding and waiting >= 3 and free < 3:
                    assert held == ADMISSION_HOLD_STEPS, (waiting, free, held, count)
                if waiting < 3 or not decoding:
                    assert count == min(waiting, free), "a short queue is never held"
            assert any(e[-1] == 0 and e[1] > 0 and e[0] > 0 for e in events), "admission was held at times"
        else:
            assert all(e[-1] == min(e[0], e[1]) for e in events if e[0] and e[1] > 0)


def test_admission_groups_follow_the_concurrency_by_default(pair):  # noqa: F811
    """admission_group 0 (the default): speculative engines admit in groups of max_running_requests // 8 (none
    below 16 running), target-only ones at once; an explicit group wins; a negative one names the field."""
    for mode, running, group, want in [("dflash", 32, 0, 4), ("dscale", 16, 0, 2), ("dflash", 8, 0, 1),
                                       ("dflash", 15, 0, 1), ("target", 32, 0, 1), ("dflash", 32, 3, 3)]:
        assert EngineConfig(mode=mode, max_running_requests=running, admission_group=group).admission == want
    assert make_engine(pair, "dflash", max_running_requests=24).scheduler.admission_group == 3
    with pytest.raises(ValueError, match="admission_group"):
        EngineConfig(admission_group=-1)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_step_never_writes_past_a_requests_pages(pair, overlap):  # noqa: F811
    """Target-only (one row a step), prompts of whole pages, chunks that end a prompt in the step that decodes
    it: every launched row's pages hold the positions it writes (the anchor one past the prompt included), and
    the tokens are those of unchunked, uncached decoding (before the fix one request diverged on the GPU)."""
    rng = random.Random(3)
    system = [rng.randrange(94) for _ in range(48)]
    prompts = [system + [rng.randrange(94) for _ in range(16 * (1 + i % 3))] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = make_engine(pair, "target", max_running_requests=6, prefix_caching=False,
                       chunked_prefill_tokens=0).generate(prompts, params)
    engine = make_engine(pair, "target", max_running_requests=3, chunked_prefill_tokens=40, overlap_schedule=overlap)
    short, real = [], engine.runner.launch

    def launch(anchors, ctx, pages, sampling, kind, context=None, slots=None, host=None):
        for c, table, current in zip(ctx, pages, host or [True] * len(ctx)):
            if current and len(table) * engine.config.page_size < c + engine.block_size:
                short.append((c, len(table)))
        return real(anchors, ctx, pages, sampling, kind, context, slots, host)

    engine.runner.launch = launch
    assert_same(engine.generate(prompts, params), want)
    assert not short, f"rows launched with too few pages (ctx, pages): {short}"


def test_bucket_timings_use_distinct_free_pages_and_leave_decoding_exact(pair, plain, monkeypatch):  # noqa: F811
    """Start-up times each bucket (`PrefillRunner.measure`, CUDA events; here one eager call each) with its keys on
    distinct pool pages, as a live request's lie, not all on the scratch page (kept in L2, so a long context read
    fast): every page it writes is a free pool page, and the junk it leaves there changes no request's tokens."""
    import dscale_runtime.prefill as prefill_module

    prompts, params, want = plain
    engine = make_engine(pair, "target", max_running_requests=10, prefix_caching=False, chunked_prefill_tokens=0,
                         sampling_rule="top1", prefill_buckets=(16, 48))
    free = engine.allocator.num_pages - 1
    tables, fill = [], prefill_module.PrefillBuffers.fill

    def spy(buf, chunks, dummy_slot):
        tables.extend((c.start, len(c.tokens), list(c.pages)) for c in chunks)
        return fill(buf, chunks, dummy_slot)

    monkeypatch.setattr(prefill_module.PrefillBuffers, "fill", spy)
    monkeypatch.setattr(prefill_module, "cuda_times", lambda fn, reps: [fn(), 1.0][1:])
    before = engine.target_cache.k.clone()
    engine.prefiller.measure(long_context=60, free_pages=free)
    assert set(engine.prefiller.bucket_ms) == set(engine.prefiller.many_ms) == {16, 48}
    # One request's chunk timed on every variant of every bucket: one slot, four, the full ten
    assert {(s[0], s[1]) for s in engine.prefiller.steps} == {(b, r) for b in (16, 48) for r in (1, 4, 10)}
    assert set(engine.prefiller.group_ms) == {4} and set(engine.prefiller.group_ms[4]) == {16, 48}
    assert tables and all(len(pages) == -(-(start + n) // engine.config.page_size) for start, n, pages in tables)
    assert all(len(set(pages)) == len(pages) and min(pages) >= 1 and max(pages) <= free for _, _, pages in tables)
    assert any(start == 60 for start, _, _ in tables)
    assert not torch.equal(before, engine.target_cache.k)  # the pages hold junk now
    monkeypatch.undo()
    assert_same(engine.generate(prompts, params), want)
