"""Engine capacity features (issue 17): prefix caching and chunked prefill keep the output lossless.

Oracle: target-only greedy decoding with prefix caching and chunking off (the whole prompt in one forward,
nothing shared); the chunked and cached engines, target-only and speculative, must decode the same tokens.
"""

from __future__ import annotations

import random

import pytest

from test_engine import MAX_LEN, assert_same, make_engine, pair  # noqa: F401 - fixtures
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.engine import Engine


def shared_prefix_prompts(n: int = 12, seed: int = 4) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts drawn from three system prompts (48 tokens, exactly three pages, then 40-70 tokens) plus short
    tails; every fourth prompt is a system prompt alone, repeated."""
    rng = random.Random(seed)
    systems = [[rng.randrange(94) for _ in range(48 if i == 0 else rng.randrange(40, 70))] for i in range(3)]
    prompts = []
    for i in range(n):
        tail = [] if i % 3 == 0 and i % 2 else [rng.randrange(94) for _ in range(rng.randrange(1, 12))]
        prompts.append(systems[i % 3] + tail)
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(8, 40), ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def plain_reference(pair):  # noqa: F811
    prompts, params = shared_prefix_prompts()
    engine = make_engine(pair, "target", max_running_requests=16, prefix_caching=False, chunked_prefill_tokens=0)
    return prompts, params, engine.generate(prompts, params)


@pytest.mark.parametrize("mode", ["target", "dflash"])
def test_prefix_caching_reuses_pages_and_changes_no_token(pair, plain_reference, mode):  # noqa: F811
    prompts, params, want = plain_reference
    engine = make_engine(pair, mode, max_running_requests=4, prefix_caching=True, chunked_prefill_tokens=0)
    assert_same(engine.generate(prompts, params), want)
    stats = engine.prefix_cache_stats
    assert stats["hit_tokens"] >= 2 * 16 * 6, stats  # later requests of each system prompt start from its pages
    prompt_tokens = sum(len(p) for p in prompts)
    assert engine.counters.prefill_tokens == prompt_tokens - stats["hit_tokens"]
    # Everything is released again (cached pages are evictable, hence free).
    assert engine.allocator.num_free == engine.allocator.num_pages - 1 and engine.allocator.num_cached > 0
    again = engine.generate(prompts[:3], params[:3])  # a repeat: only the last page's tokens are recomputed
    assert_same(again, want[:3])
    assert engine.counters.prefill_tokens - prompt_tokens + stats["hit_tokens"] <= sum(
        len(p) - (len(p) - 1) // 16 * 16 for p in prompts[:3])


def best_shared_tokens(prompts: list[list[int]], page: int = 16) -> list[int]:
    """Brute force: the tokens each prompt can take from an earlier one's full pages (leading pages in common,
    within the earlier prompt's full pages and short of this prompt's last token)."""
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    return [max([min(common(p, q) // page, len(q) // page, (len(p) - 1) // page) * page for q in prompts[:i]],
                default=0) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("chunk", [0, 24])
def test_requests_admitted_together_share_their_prefix(pair, plain_reference, chunk):  # noqa: F811
    """All 12 prompts fit at once: a prompt whose pages another running request is still prefilling waits for
    them (the prompts behind it go on), so each prompt computes only what no earlier prompt holds."""
    prompts, params, want = plain_reference
    engine = make_engine(pair, "dflash", max_running_requests=16, prefix_caching=True, chunked_prefill_tokens=chunk)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    engine.step()
    first = {r.request_id for r in engine.scheduler.running}
    assert first == set(ids[:3]), "one request per system prompt runs first; its repeats wait for its pages"
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step())
    assert_same([done[i] for i in ids], want)
    shared = best_shared_tokens(prompts)
    assert sum(shared) >= 16 * 2 * 9
    hits = engine.prefix_cache_stats["hit_tokens"]
    assert engine.counters.prefill_tokens == sum(len(p) for p in prompts) - hits
    if chunk == 0:
        assert hits == sum(shared)
    else:  # NOTE: a request waits for pending pages only when they are 32 tokens or more (IN_BATCH_SHARE_TOKENS)
        assert sum(shared) - 16 * len(prompts) < hits <= sum(shared)


def test_chunked_prefill_interleaves_decode_and_changes_no_token(pair, plain_reference):  # noqa: F811
    prompts, params, want = plain_reference
    engine = make_engine(pair, "dflash", max_running_requests=16, prefix_caching=False, chunked_prefill_tokens=24)
    first = engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    engine.step()
    engine.step()  # the short request decodes
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    produced, steps_with_prefill = [], 0
    done = {}
    while engine.has_unfinished():
        before = len(engine.generated_token_ids(first)) if first in engine.requests else None
        prefilling = any(r.prefilling for r in engine.scheduler.running)
        for out in engine.step():
            done[out.request_id] = out
        if prefilling and before is not None and first in engine.requests:
            steps_with_prefill += 1
            produced.append(len(engine.generated_token_ids(first)) - before)
    assert_same([done[i] for i in ids], want)
    assert engine.counters.prefill_tokens == 3 + sum(len(p) for p in prompts)
    # 12 prompts of 41-81 tokens take about 30 steps of 24 tokens; the running request gains tokens in each.
    assert steps_with_prefill >= 20 and min(produced[1:]) >= 1, produced


def test_chunks_and_cache_together_under_preemption(pair, plain_reference):  # noqa: F811
    prompts, params, want = plain_reference
    # Room for about three requests while 12 may run: preemption, re-admission from the cache, chunked recompute.
    engine = make_engine(pair, "dflash", max_running_requests=12, kv_cache_tokens=3 * (MAX_LEN + 32),
                         prefix_caching=True, chunked_prefill_tokens=20)
    assert_same(engine.generate(prompts, params), want)
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.num_free == engine.allocator.num_pages - 1
    # The hit rate counts admissions (a preempted request is admitted again), not attempts that found no room.
    assert engine.prefix_cache_stats["queries"] == len(prompts) + engine.scheduler.num_preemptions


def test_seeded_sampling_is_the_same_with_cache_and_chunks(pair):  # noqa: F811
    prompts, _ = shared_prefix_prompts(8, seed=9)
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=70 + i)
              for i in range(len(prompts))]
    plain = make_engine(pair, "dflash", max_running_requests=8, prefix_caching=False, chunked_prefill_tokens=0)
    cached = make_engine(pair, "dflash", max_running_requests=3, prefix_caching=True, chunked_prefill_tokens=16)
    assert [o.token_ids for o in cached.generate(prompts, params)] == [o.token_ids for o in
                                                                        plain.generate(prompts, params)]
    assert cached.prefix_cache_stats["hit_tokens"] > 0


def test_capacity_options_are_checked():
    with pytest.raises(ValueError, match="chunked_prefill_tokens"):
        EngineConfig(chunked_prefill_tokens=-1)


def fallback_engine(engine, target_ms: float, spec_ms: float):
    """Give a CPU engine the start-up step times a GPU engine measures, so that its target fallback runs."""
    engine.runner.target_fallback = True
    mode = engine.config.mode
    engine.runner.policy_ms = {b: {"target": target_ms, mode: spec_ms} for b in engine.runner.buckets}
    return engine


@pytest.mark.parametrize("mode", ["dflash", "dscale"])
def test_target_fallback_switches_by_live_acceptance_and_changes_no_token(pair, plain_reference, mode):  # noqa: F811
    """A random drafter is almost never accepted: with a speculative step costing 1.5 target steps, the engine
    falls back to target-only steps (speculating 3 steps in a row every 128th to keep measuring); output equals
    target-only."""
    from test_engine_dscale import predictors  # noqa: F401
    from test_engine_dscale import dscale_engine, make_predictor  # noqa: F401

    prompts, params, want = plain_reference
    if mode == "dscale":
        import tempfile
        from pathlib import Path

        from test_engine_dscale import save_predictor

        predictor = save_predictor(Path(tempfile.mkdtemp()), pair, "untrained", 0)
        engine = dscale_engine(pair, predictor, max_running_requests=6, chunked_prefill_tokens=0)
    else:
        engine = make_engine(pair, mode, max_running_requests=6, chunked_prefill_tokens=0)
    fallback_engine(engine, 1.0, 1.5)
    assert_same(engine.generate(prompts, params), want)
    steps = engine.counters.steps_by_mode
    assert steps.get("target", 0) > 5 * steps.get(mode, 0) > 0, steps
    assert engine.live_acceptance[mode] < 0.5
    # Speculation that costs no more than a target step pays at any acceptance: the engine speculates again.
    fallback_engine(engine, 1.0, 1.0)  # as fast as a target step: any acceptance pays
    before = dict(steps)
    assert_same(engine.generate(prompts, params), want)
    # (+1: the first run's last launched step, all of whose rows had finished, is committed in this run)
    assert steps["target"] <= before["target"] + 1 and steps[mode] > before[mode] + 20


def timed_steps(engine, device_ms: dict[str, float]):
    """Let a CPU engine's committed steps report these device times per step mode (what CUDA events measure on a
    GPU), so that the live choice compares them instead of the start-up times."""
    engine.time_live_steps = True
    launch = engine.runner.launch

    def timed(*args, **kwargs):
        pending = launch(*args, **kwargs)
        pending.started = device_ms[args[4].mode]  # kind: the fifth positional argument
        return pending

    engine.runner.launch = timed
    return engine


def test_target_fallback_follows_live_step_times_and_changes_no_token(pair, plain_reference):  # noqa: F811
    """Start-up times say a DFlash step costs a target step, so any acceptance would pay; the live times say it
    costs four (sampled kinds, longer contexts): with a random drafter the engine falls back to target-only steps
    by the live times, its estimates shown as `live_step_ms`, and the output is target-only's."""
    prompts, params, want = plain_reference
    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=6, chunked_prefill_tokens=0), 1.0, 1.0)
    timed_steps(engine, {"dflash": 4.0, "target": 1.0})
    assert_same(engine.generate(prompts, params), want)
    steps = engine.counters.steps_by_mode
    assert steps.get("target", 0) > 4 * steps.get("dflash", 0) > 0, steps
    assert {m for _, m in engine.live_step_ms} == {"dflash", "target"}
    assert all(engine.live_step_ms[b, m] == pytest.approx(4.0 if m == "dflash" else 1.0) for b, m in engine.live_step_ms)
    bucket = next(b for b, _ in engine.live_step_ms)
    assert engine.step_costs(bucket, ["dflash", "target"]) == pytest.approx({"dflash": 4.0, "target": 1.0})


def test_step_costs_scale_start_up_times_of_steps_not_run_live(pair):  # noqa: F811
    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=6), 1.0, 2.0)
    bucket = engine.runner.buckets[0]
    assert engine.step_costs(bucket, ["dflash", "target"]) == {"dflash": 2.0, "target": 1.0}  # nothing live yet
    engine.live_step_ms[bucket, "dflash"] = 3.0  # 1.5x its start-up time: the target step's estimate scales alike
    assert engine.step_costs(bucket, ["dflash", "target"]) == pytest.approx({"dflash": 3.0, "target": 1.5})
    # A host-bound loop: a step costs at least the host's work per cycle of its mode (unmeasured: the others' mean)
    engine.host_ms[bucket, "dflash"] = 5.0
    assert engine.step_costs(bucket, ["dflash", "target"]) == pytest.approx({"dflash": 5.0, "target": 5.0})
    engine.host_ms[bucket, "target"] = 2.0
    assert engine.step_costs(bucket, ["dflash", "target"]) == pytest.approx({"dflash": 5.0, "target": 2.0})
    engine.host_ms[bucket, "target"] = 1.0
    assert engine.step_costs(bucket, ["dflash", "target"]) == pytest.approx({"dflash": 5.0, "target": 1.5})
    # A target-only cycle's host work is a part of a speculative one's: its estimate (from probes that read high)
    # counts at most the speculative modes' least
    engine.host_ms[bucket, "target"] = 6.0
    assert engine.step_costs(bucket, ["dflash", "target"]) == pytest.approx({"dflash": 5.0, "target": 5.0})


def test_a_steps_cost_is_at_least_the_wall_time_of_its_cycles(pair):  # noqa: F811
    """`Engine.wall_ms`: a step costs the loop its cycle's wall time (device, host and the gaps between them), which
    can exceed both other estimates. Numbers from an H100 (demo pair, T = 1, the tail buckets of a concurrency-8 run,
    2026-12-06): DFlash's device floor 0.493 ms and host work 0.281 ms, target-only's 0.276 / 0.295 ms, 0.81 accepted
    drafts a step: by those DFlash looks faster (1.81 / 0.493 = 3.67 tokens per ms against 1 / 0.281 = 3.56), while
    its steps cost the loop ~0.64 ms (2.8 tokens per ms) and target-only's ~0.28 (3.6)."""
    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    bucket = engine.runner.bucket(1)
    engine.live_acceptance["dflash"] = 0.81
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 0.493, 0.276
    engine.host_ms[bucket, "dflash"], engine.host_ms[bucket, "target"] = 0.281, 0.295
    assert engine._mode_for(1, probe=False) == "dflash"
    engine.wall_ms[bucket, "dflash"] = 0.64  # target-only's not measured yet: the measured ones' mean
    assert engine.step_costs(bucket, ["dflash", "target"]) == pytest.approx({"dflash": 0.64, "target": 0.64})
    engine.wall_ms[bucket, "target"] = 0.28
    assert engine.step_costs(bucket, ["dflash", "target"]) == pytest.approx({"dflash": 0.64, "target": 0.281})
    assert engine._mode_for(1, probe=False) == "target"
    # target-only's wall time, read high between speculative steps, counts at most the speculative modes' least
    engine.wall_ms[bucket, "target"] = 0.9
    assert engine.step_costs(bucket, ["dflash", "target"])["target"] == pytest.approx(0.64)


def test_host_work_per_cycle_is_measured_per_bucket_and_mode(pair):  # noqa: F811
    """`Engine.host_ms`: each cycle's wall time less its waits for the device, keyed by the (bucket, mode) of the
    step it launched; cycles that wait on nothing (the CPU) count their whole wall time."""
    import time

    engine = make_engine(pair, "dflash", max_running_requests=2, sampling_rule="top1")
    engine.time_host = True  # NOTE: on by itself only with captured CUDA steps
    engine.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        time.sleep(0.02)
    assert set(engine.host_ms) == set(engine.wall_ms) == {(engine.runner.bucket(1), "dflash")}
    assert engine.host_ms[engine.runner.bucket(1), "dflash"] >= 20
    assert engine.wall_ms[engine.runner.bucket(1), "dflash"] >= engine.host_ms[engine.runner.bucket(1), "dflash"]


def test_host_work_counts_only_in_cycles_that_committed_their_own_mode(pair):  # noqa: F811
    """With the overlap schedule a cycle commits the step before the one it launches: a cycle that launched a
    target step but committed a DFlash one is not the target step's host work, so it is not sampled; a target
    probe runs PROBE_RUN steps in a row, so its later cycles are."""
    import time

    from dscale_runtime.engine import PROBE_RUN

    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    engine.time_host = engine.time_live_steps = True
    bucket = engine.runner.buckets[0]
    for committed, sampled in (({"dflash"}, False), (set(), True), ({"target"}, True)):
        engine.host_ms.clear()
        engine._cycle = [time.perf_counter() - 0.004, 0, 0.0, (bucket, "target"), committed]
        engine._time_cycle()
        assert ((bucket, "target") in engine.host_ms) == ((bucket, "target") in engine.wall_ms) == sampled, committed
    # a cycle that prefilled, or one of the two after (a run's first two count so), holds no decode step's host work
    for bits in (0b001, 0b010, 0b100, 0b110):
        engine.host_ms.clear()
        engine._cycle = [time.perf_counter() - 0.004, bits, 0.0, (bucket, "target"), {"target"}]
        engine._time_cycle()
        assert (bucket, "target") not in engine.host_ms, bits
    # the probe: DFlash is the best step (its live time is known, target's is not): target runs PROBE_RUN in a row
    engine._cycle = None
    engine.live_acceptance["dflash"] = 2.0
    engine.live_step_ms[bucket, "dflash"] = 1.0
    assert engine._mode_for(1) == "target"
    engine.live_step_ms[bucket, "target"] = 1.0  # its first commit: its live time is known, the run goes on
    assert [engine._mode_for(1) for _ in range(PROBE_RUN - 1)] == ["target"] * (PROBE_RUN - 1)
    assert [engine._mode_for(1) for _ in range(3)] == ["dflash"] * 3


def test_a_fallen_back_bucket_speculates_in_runs_that_show_their_host_work(pair):  # noqa: F811
    """Where target-only steps are best, the speculative step is probed PROBE_RUN steps in a row every
    TARGET_PROBE steps (not one step in FALLBACK_PROBE: cheaper where speculation loses), so that the run's later
    cycles, which commit only its own steps, update its host work: a single probed step never would, and an
    estimate of its host work that started high would keep the bucket on target-only steps."""
    import time

    from dscale_runtime.engine import PROBE_RUN, TARGET_PROBE

    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    engine.time_host = engine.time_live_steps = True
    bucket = engine.runner.bucket(1)
    engine.live_acceptance["dflash"] = 0.5
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 1.0, 0.25
    engine.host_ms[bucket, "dflash"] = 4.0  # e.g. a first sample that held a request's arrival
    engine.host_ms[bucket, "target"] = 0.3  # target-only: 1 / 0.3 tokens per ms against DFlash's 1.5 / 4
    period = TARGET_PROBE
    engine._live_steps = 0
    runs = [engine._mode_for(1) for _ in range(2 * period + PROBE_RUN - 1)]
    assert runs.count("dflash") == 2 * PROBE_RUN and runs.count("target") == 2 * period - PROBE_RUN - 1
    first = runs.index("dflash")
    assert first == period - 1 and runs[first : first + PROBE_RUN] == ["dflash"] * PROBE_RUN
    # A later cycle of the run commits only a DFlash step: it is sampled, and the estimate comes down
    engine._cycle = [time.perf_counter() - 0.0002, 0, 0.0, (bucket, "dflash"), {"dflash"}]
    engine._time_cycle()
    assert engine.host_ms[bucket, "dflash"] < 4.0
    # Once its host work reads right, drafts that pay win the bucket back: (1 + 3) / 1.0 against 1 / 0.3 per ms
    engine.live_acceptance["dflash"] = 3.0
    engine.host_ms[bucket, "dflash"] = 0.2
    assert engine._mode_for(1, probe=False) == "dflash"


def test_a_fallen_back_bucket_probes_less_often_while_target_only_steps_stay_best(pair):  # noqa: F811
    """Each probe that finds target-only steps still best doubles the bucket's probe period, from TARGET_PROBE up to
    TARGET_PROBE_MAX (a probe costs its speculative steps and the drafter context's catch-up); once speculation wins
    the bucket back, the period starts again from TARGET_PROBE."""
    from dscale_runtime.engine import PROBE_RUN, TARGET_PROBE, TARGET_PROBE_MAX

    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    bucket = engine.runner.bucket(1)
    engine.live_acceptance["dflash"] = 0.1
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 1.0, 0.25
    engine._live_steps = 0
    runs = [engine._mode_for(1) for _ in range(4 * TARGET_PROBE_MAX)]
    starts = [i + 1 for i, m in enumerate(runs) if m == "dflash" and (i == 0 or runs[i - 1] != "dflash")]
    assert TARGET_PROBE_MAX == 8 * TARGET_PROBE
    assert starts == [TARGET_PROBE * k for k in (1, 2, 4, 8, 16, 24, 32)], starts
    assert runs.count("dflash") == PROBE_RUN * (len(starts) - 1) + 1  # the last run starts at the last call
    # New traffic (as many requests started as the bucket holds: one) is probed at the next multiple of TARGET_PROBE
    engine._probe_run = None
    engine._admitted += 1
    runs = [engine._mode_for(1) for _ in range(TARGET_PROBE)]
    assert runs.count("dflash") == 1 and runs[-1] == "dflash"
    engine._probe_run = None
    engine.live_acceptance["dflash"] = 5.0  # the traffic changed: speculation pays again
    assert engine._mode_for(1) == "dflash" and not engine._target_period
    engine.live_acceptance["dflash"] = 0.1
    engine._live_steps = 0
    runs = [engine._mode_for(1) for _ in range(TARGET_PROBE)]
    assert runs.count("dflash") == 1 and runs[-1] == "dflash"


def test_the_live_choice_computes_its_rates_every_few_steps_once_its_estimates_exist(pair):  # noqa: F811
    """The rates (`step_costs` and the acceptance) are computed at every step until each step of the bucket has a live
    estimate, then every CHOICE_REFRESH steps and whenever a probe run starts or ends; the best step stands in
    between (computing them cost a served fallback ~10% of its host work at concurrency 8)."""
    from dscale_runtime.engine import CHOICE_REFRESH

    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    bucket = engine.runner.bucket(1)
    engine.live_acceptance["dflash"] = 2.0
    calls = []
    costs = engine.step_costs
    engine.step_costs = lambda *args: calls.append(args) or costs(*args)
    engine._live_steps = 1  # NOTE: away from the probes at multiples of FALLBACK_PROBE
    assert [engine._mode_for(1) for _ in range(4)] == ["dflash"] * 4 and len(calls) == 4  # no live times yet
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 0.5, 0.25  # 3 / 0.5 > 1 / 0.25
    calls.clear()
    assert [engine._mode_for(1) for _ in range(CHOICE_REFRESH)] == ["dflash"] * CHOICE_REFRESH and len(calls) == 1
    engine.live_acceptance["dflash"] = 0.1  # drafts stop paying: seen at the next refresh, not before
    runs = [engine._mode_for(1) for _ in range(CHOICE_REFRESH)]
    assert "target" in runs and len(calls) == 2


def test_a_probe_out_of_a_fallen_back_bucket_corrects_a_stale_acceptance(pair):  # noqa: F811
    """The acceptance estimate of a fallen-back bucket is as old as the fallback (one prompt's dip, say): a probe's
    steps weigh PROBE_ACCEPTANCE_WEIGHT, so a probe whose drafts pay wins the bucket back at once, where the running
    mean's 0.05 per step would have kept it on target-only steps until later probes."""
    from dscale_runtime.engine import ACCEPTANCE_WEIGHT, PROBE_ACCEPTANCE_WEIGHT, PROBE_RUN, TARGET_PROBE

    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    bucket = engine.runner.bucket(1)
    engine.live_acceptance["dflash"] = 0.3
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 1.0, 0.25  # pays above 3 drafts
    engine._live_steps = 0
    runs, weights = [], []
    for _ in range(TARGET_PROBE + PROBE_RUN + 2):
        runs.append(engine._mode_for(1))
        if runs[-1] == "dflash":
            weights.append(engine.acceptance_weight(bucket, "dflash"))
            engine.observe_acceptance("dflash", [10], weights[-1])
    assert runs[: TARGET_PROBE - 1] == ["target"] * (TARGET_PROBE - 1)
    assert runs[TARGET_PROBE - 1 :] == ["dflash"] * (PROBE_RUN + 3)
    assert weights == [PROBE_ACCEPTANCE_WEIGHT] * PROBE_RUN + [ACCEPTANCE_WEIGHT] * 3
    assert 0.3 + (1 - (1 - ACCEPTANCE_WEIGHT) ** PROBE_RUN) * 9.7 < 3  # the running mean's weight: still target-only


def test_the_live_acceptance_is_kept_per_kind_of_batch(pair):  # noqa: F811
    """Acceptance follows the sampling more than anything: greedy, sampled and filtered batches each have their own
    estimate, so greedy traffic arriving in a bucket that T = 1 traffic made fall back speculates at once (with one
    estimate it waited for probes up to TARGET_PROBE_MAX steps apart: an H100 run's greedy passes after T = 1 passes
    took a third of their steps target-only, 2026-12-06), and each committed step feeds its own batch's kind."""
    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    bucket = engine.runner.bucket(1)
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 1.0, 0.25  # pays above 3 drafts
    engine._traffic = (True, False)
    engine.observe_acceptance("dflash", [0])
    assert engine._mode_for(1, probe=False) == "target"
    engine._traffic = (False, False)
    engine.observe_acceptance("dflash", [6])
    assert engine._mode_for(1, probe=False) == "dflash"
    engine._traffic = (True, False)
    assert engine._mode_for(1, probe=False) == "target" and engine.live_acceptance == {"dflash": 0.0}
    # Served: the batch's kind comes from its requests' sampling parameters
    fresh = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    prompts = [[5, 6, 7, 8, 9], [9, 8, 7]]
    fresh.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert set(fresh.acceptance_by_traffic) == {(False, False)}
    fresh.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True))
    assert set(fresh.acceptance_by_traffic) == {(False, False), (True, True)} and fresh._traffic == (True, True)


def test_target_only_steps_are_refreshed_rarely_while_speculation_pays(pair):  # noqa: F811
    """While DFlash is best, target-only steps run only to keep their cost current: PROBE_RUN in a row every
    TARGET_REFRESH steps (their cost does not follow acceptance), after the bucket's first probe."""
    from dscale_runtime.engine import PROBE_RUN, TARGET_PROBE, TARGET_REFRESH

    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    engine.time_live_steps = True
    bucket = engine.runner.bucket(1)
    engine.live_acceptance["dflash"] = 2.0
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 1.0, 1.0
    engine._live_steps = 0
    runs = [engine._mode_for(1) for _ in range(2 * TARGET_REFRESH + PROBE_RUN - 1)]
    assert TARGET_REFRESH > TARGET_PROBE
    assert runs.count("target") == 2 * PROBE_RUN, runs.count("target")
    first = runs.index("target")
    assert first == TARGET_REFRESH - 1 and runs[first : first + PROBE_RUN] == ["target"] * PROBE_RUN


def test_live_costs_follow_the_floor_of_their_samples(pair):  # noqa: F811
    """Time that lands on a step beside its own work only adds: the live choice's cost estimates track each cost's
    floor (`track_cost`). Numbers from an H100 served trace (demo pair, T = 1, concurrency 1): DFlash steps 0.63 ms
    with 1.8 tokens each; target-only steps 0.27 ms of device time and 0.28 ms of host work in their own runs, but
    up to 0.35 / 0.50 ms when probed between DFlash steps. A symmetric mean of those samples (~0.31 / ~0.39) made
    DFlash look faster (1.8 / 0.63 = 2.86 tokens per ms against 1 / 0.39 = 2.56), while target-only served 1.25x its rate."""
    from dscale_runtime.engine import COST_UP_WEIGHT, track_cost

    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    bucket = engine.runner.bucket(1)
    engine.live_acceptance["dflash"] = 0.8
    engine.live_step_ms[bucket, "dflash"], engine.host_ms[bucket, "dflash"] = 0.63, 0.31
    for i in range(60):  # probe samples (high) and samples from target-only runs (low), alternately
        track_cost(engine.live_step_ms, (bucket, "target"), 0.35 if i % 2 else 0.27)
        track_cost(engine.host_ms, (bucket, "target"), 0.50 if i % 2 else 0.28)
    assert engine.live_step_ms[bucket, "target"] < 0.30 and engine.host_ms[bucket, "target"] < 0.33
    assert engine._mode_for(1, probe=False) == "target"
    mean = 0.27
    for i in range(60):  # the same samples' running mean at the old symmetric weight (0.1)
        mean += 0.1 * ((0.50 if i % 2 else 0.28) - mean)
    assert 1.8 / 0.63 > 1 / mean
    # A real rise (sampled traffic's longer steps) is followed over the mode's samples; the first sample sets it
    costs = {}
    track_cost(costs, "k", 1.0)
    assert costs["k"] == 1.0
    track_cost(costs, "k", 2.0)
    assert costs["k"] == pytest.approx(1.0 + COST_UP_WEIGHT)
    for _ in range(150):
        track_cost(costs, "k", 2.0)
    assert costs["k"] > 1.95
    # One stalled cycle is not a rise: an H100 server's target-only cycles read 0.233 ms, then 0.535 after a ~10 ms one
    costs = {"k": 0.233}
    track_cost(costs, "k", 10.0)
    assert costs["k"] == pytest.approx(0.233 * (1 + COST_UP_WEIGHT))


def test_target_only_steps_are_probed_until_their_cycles_have_enough_samples(pair):  # noqa: F811
    """A bucket where DFlash is best probes target-only steps every FALLBACK_PROBE-th step (PROBE_RUN in a row)
    until its host work and wall time there rest on COST_SAMPLES cycles (COST_PROBES probes at most), then every
    TARGET_REFRESH-th step only: a first probe's cold cycle (0.45 ms against 0.29 in target-only runs, an H100 at
    concurrency 8) is not the estimate the bucket keeps."""
    from dscale_runtime.engine import COST_PROBES, COST_SAMPLES, FALLBACK_PROBE, PROBE_RUN, TARGET_REFRESH

    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    engine.time_live_steps = engine.time_host = True
    bucket = engine.runner.bucket(1)
    engine.live_acceptance["dflash"] = 2.0
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 1.0, 1.0
    engine._live_steps = 0
    runs = []
    for _ in range(4 * FALLBACK_PROBE):
        runs.append(engine._mode_for(1))
        if runs[-1] == "target":  # NOTE: each probed step's cycle counts as a sample here
            engine.cost_samples[bucket, "target"] = engine.cost_samples.get((bucket, "target"), 0) + 1
    starts = [i for i, m in enumerate(runs) if m == "target" and (i == 0 or runs[i - 1] != "target")]
    assert [runs[i : i + PROBE_RUN] for i in starts] == [["target"] * PROBE_RUN] * len(starts)
    assert len(starts) == -(-COST_SAMPLES // PROBE_RUN) and starts[0] == FALLBACK_PROBE - 1, runs
    later = [engine._mode_for(1) for _ in range(TARGET_REFRESH)]
    assert later.count("target") == PROBE_RUN  # the refresh only
    # where cycles hold prefills (requests arriving every few steps) no sample may come: COST_PROBES probes at most
    engine = fallback_engine(make_engine(pair, "dflash", max_running_requests=2), 1.0, 1.0)
    engine.time_live_steps = engine.time_host = True
    engine.live_acceptance["dflash"] = 2.0
    engine.live_step_ms[bucket, "dflash"], engine.live_step_ms[bucket, "target"] = 1.0, 1.0
    engine._live_steps = 0
    runs = [engine._mode_for(1) for _ in range(TARGET_REFRESH - 1)]
    assert runs.count("target") == COST_PROBES * PROBE_RUN and engine.cost_samples == {}


def test_target_fallback_keeps_speculating_when_drafts_are_accepted(pair):  # noqa: F811
    from test_engine import oracle_setup

    engine, prompts, params, want = oracle_setup(pair, 12, 80)
    fallback_engine(engine, 1.0, 2.0)  # the oracle's drafts are accepted ~7 per step: 8 tokens for 2 step-costs
    assert_same(engine.generate(prompts, params), want)
    assert engine.counters.steps_by_mode.get("target", 0) == 0 and engine.live_acceptance["dflash"] > 2


def live_engine(engine, dflash_ms: float, dscale_ms: float):
    """Give a CPU DScale engine the start-up step times a GPU engine measures, with the live DScale/DFlash choice."""
    engine.runner.live_policy = True
    engine.runner.policy_ms = {b: {"dflash": dflash_ms, "dscale": dscale_ms} for b in engine.runner.buckets}
    return engine


def test_live_policy_picks_dflash_or_dscale_by_tokens_per_second_and_changes_no_token(pair):  # noqa: F811
    """Oracle drafts are accepted about 7 per step at full width, fewer within DScale's half budget: a DScale
    step at 0.95 of DFlash's cannot pay for the lost drafts, one at 0.3 does. Either way the other step runs
    every 16th step (both estimates stay live) and the output is target-only's."""
    from test_engine import OracleDraftEngine, prompt_set
    from test_engine_dscale import dscale_engine, save_predictor
    import tempfile
    from pathlib import Path

    prompts, _ = prompt_set(12, seed=3)
    long = SamplingParams(temperature=0, max_tokens=130, ignore_eos=True)
    continuations = make_engine(pair, "target").generate(prompts, long)
    params = [SamplingParams(temperature=0, max_tokens=110, ignore_eos=True)] * len(prompts)
    want = make_engine(pair, "target").generate(prompts, params)
    predictor = save_predictor(Path(tempfile.mkdtemp()), pair, "heuristic", 0)
    engine = dscale_engine(pair, predictor, cls=OracleDraftEngine, max_running_requests=6,
                           continuations={str(run * len(prompts) + i): o.token_ids for run in range(2)
                                          for i, o in enumerate(continuations)})  # request ids of two runs
    with pytest.raises(ValueError, match="dscale_policy"):
        EngineConfig(mode="dscale", dscale_policy="fastest")
    runs = []
    for dscale_ms in (0.95, 0.3):
        live_engine(engine, 1.0, dscale_ms)
        before = dict(engine.counters.steps_by_mode)
        assert_same(engine.generate(prompts, params), want)
        runs.append({m: n - before.get(m, 0) for m, n in engine.counters.steps_by_mode.items()})
        accepted = engine.live_acceptance
        assert accepted["dflash"] > accepted["dscale"] > 0, accepted
        rate = {m: (1 + accepted[m]) / t for m, t in (("dflash", 1.0), ("dscale", dscale_ms))}
        assert max(rate, key=rate.get) == engine.step_policy[engine.runner.buckets[-1]]["mode"]
    slow, fast = runs
    assert slow["dflash"] > 4 * slow["dscale"] > 0, slow  # DFlash pays; DScale probed every 16th step
    assert fast["dscale"] > 4 * fast["dflash"] > 0, fast


@pytest.mark.parametrize("agreement", ["ref", "triton"])
def test_agreement_features_follow_each_request_through_chunks_cache_and_preemption(pair, monkeypatch, request,  # noqa: F811
                                                                                   agreement):
    """The v3 agreement columns come from the device's token ring, which the prefill's tail and every step's
    accepted tokens write: traced rows equal the definition over the request's final tokens, with chunked
    prefill, prefix-cache hits (the ring also takes the cached prompt tokens) and preemption with recompute;
    a 24-token window, so the ring wraps around within prompts and outputs. Both paths of the columns: the
    reference over the gathered window, and the one-launch kernel reading the ring (Triton's interpreter)."""
    import dataclasses

    calls = []
    if agreement == "triton":
        request.getfixturevalue("interpreter")
        from dscale_runtime.kernels import triton_agreement

        kernel = triton_agreement.agreement_columns_triton
        monkeypatch.setattr(triton_agreement, "agreement_columns_triton", lambda *a: calls.append(1) or kernel(*a))

    from dscale_runtime import engine as engine_module
    from test_dvl import agreement_brute_force

    spec_of = engine_module.drafter_feature_spec
    monkeypatch.setattr(engine_module, "drafter_feature_spec",
                        lambda config: dataclasses.replace(spec_of(config), agreement_window=24))

    rng = random.Random(8)
    motifs = [[rng.randrange(90) for _ in range(rng.randint(3, 7))] for _ in range(3)]
    prompts = [[m[i % len(m)] for i in range(rng.randint(20, 70))] for m in motifs for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(12, 32), ignore_eos=True) for _ in prompts]
    cfg = EngineConfig(mode="dflash", max_model_len=MAX_LEN, max_running_requests=12,
                       kv_cache_tokens=3 * (MAX_LEN + 32), prefix_caching=True, chunked_prefill_tokens=20)
    assert Engine.from_pretrained(*pair, config=cfg).runner.token_ring == 0  # untraced DFlash: no ring kept
    engine = Engine.from_pretrained(*pair, config=cfg, trace_features=True)
    # NOTE: read per step (eager CPU steps); 'triton' also writes the ring through the state kernel
    engine.runner.decision_backend = agreement
    spec = engine.feature_spec
    assert spec.num_agreement and engine.runner.token_ring == spec.agreement_window
    traces, rings = [], []

    def observe(trace) -> None:  # the ring right after the step: each request's last R committed tokens
        traces.append(trace)
        ring = engine.runner.state.tokens
        slots = [engine.requests[rid].slot for rid in trace.request_ids]  # -1: finished or preempted in this step
        rings.append([(ring[slot].tolist(), trace.context_lens[i] + trace.accepted_lens[i]) if slot >= 0 else None
                      for i, slot in enumerate(slots)])

    engine.step_observers.append(observe)
    outputs = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0 and engine.prefix_cache_stats["hit_tokens"] > 0
    tokens = {o.request_id: list(o.prompt_token_ids) + list(o.token_ids) for o in outputs}
    rows = matched = 0
    for trace in traces:
        got = trace.features[:, spec.width - spec.num_agreement :].tolist()
        for i, rid in enumerate(trace.request_ids):
            want = agreement_brute_force(tokens[rid], trace.context_lens[i], trace.blocks[i], spec)
            assert got[i] == want, (rid, trace.context_lens[i])
            rows += 1
            matched += want[0] > 0
    assert rows > 100 and matched > 0
    assert len(calls) == (len(traces) if agreement == "triton" else 0)
    r = spec.agreement_window
    checked = 0
    for trace, held in zip(traces, rings):
        for rid, entry in zip(trace.request_ids, held):
            if entry is not None:
                ring, last = entry
                assert all(ring[p % r] == tokens[rid][p] for p in range(max(0, last - r + 1), last + 1)), rid
                checked += 1
    assert checked > rows // 2


def test_live_choice_model_runs_the_engines_choice():
    """benchmarks/live_choice_sim.py drives `Engine._mode_for` with simulated steps: on its T = 1-like model (drafts
    that rarely pay, target-only probes that read high between DFlash steps) the floor estimators keep the bucket
    on target-only steps (within ~3% of them: the probes) and do no worse than the symmetric mean (within 0.5%); on
    greedy-like drafts the choice keeps DFlash."""
    import argparse
    import importlib.util
    from pathlib import Path

    import dscale_runtime.engine as engine_module

    path = Path(__file__).parents[1] / "benchmarks" / "live_choice_sim.py"
    spec = importlib.util.spec_from_file_location("live_choice_sim", path)
    sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim)
    base = dict(tokens=128, requests=60, target_ms=0.26, target_host_ms=0.28, dflash_ms=0.63, dflash_host_ms=0.31,
                probe_steps=3, probe_device_extra=0.08, probe_host_extra=0.2)
    t1 = argparse.Namespace(alpha=[0.25, 0.6], **base)
    floor = sim.simulate(t1)
    built = (engine_module.COST_DOWN_WEIGHT, engine_module.COST_UP_WEIGHT)
    try:
        engine_module.COST_DOWN_WEIGHT = engine_module.COST_UP_WEIGHT = 0.1
        symmetric = sim.simulate(t1)
    finally:
        engine_module.COST_DOWN_WEIGHT, engine_module.COST_UP_WEIGHT = built
    assert floor["x_target"] > 0.97 and floor["x_target"] >= symmetric["x_target"] - 0.005, (floor, symmetric)
    greedy = sim.simulate(argparse.Namespace(alpha=[0.6, 0.85], **base))
    assert greedy["x_target"] > 1.4 and greedy["steps"]["target"] < 0.01 * greedy["steps"]["dflash"], greedy
    # DFlash steps that cost the loop more than their device time and host work show (the H100 tail buckets of
    # 2026-12-06): with their cycles' wall time (`Engine.wall_ms`) the choice serves closer to target-only's rate
    # (probing every TARGET_PROBE steps at the running mean's weight, as before probes came rarer and weighed more)
    tail = dict(base, target_ms=0.276, target_host_ms=0.295, dflash_ms=0.493, dflash_host_ms=0.281, dflash_gap_ms=0.15)
    built = engine_module.TARGET_PROBE_MAX, engine_module.PROBE_ACCEPTANCE_WEIGHT
    try:
        engine_module.TARGET_PROBE_MAX = engine_module.TARGET_PROBE
        engine_module.PROBE_ACCEPTANCE_WEIGHT = engine_module.ACCEPTANCE_WEIGHT
        walled = sim.simulate(argparse.Namespace(alpha=[0.25, 0.6], **tail))
        unwalled = sim.simulate(argparse.Namespace(alpha=[0.25, 0.6], wall=False, **tail))
    finally:
        engine_module.TARGET_PROBE_MAX, engine_module.PROBE_ACCEPTANCE_WEIGHT = built
    assert walled["x_target"] > 0.985 and walled["x_target"] > unwalled["x_target"] + 0.005, (walled, unwalled)
    # Probes that find target-only steps still best come 128, 256, ... up to 1,024 steps apart (from 128 again for
    # each new request: one at a time here): within 2% of it
    assert sim.simulate(argparse.Namespace(alpha=[0.25, 0.6], **tail))["x_target"] > 0.98
    assert sim.simulate(argparse.Namespace(alpha=[0.6, 0.85], **tail))["x_target"] > 1.4  # greedy keeps DFlash
