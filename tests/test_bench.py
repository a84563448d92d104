"""dscale-bench: configuration checks, the fixed manifest, the figures of a pass, a sweep against a server in
this process and a `--launch` sweep through the command line (tiny checkpoints, so it runs in seconds); a pass
held to a duration target (closed loop with a stand-in request, and against the server) and the spread figures
checked against the raw per-request data."""

from __future__ import annotations

import asyncio
import csv
import http.server
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

from checkpoints import write_drafter, write_target
from dscale_runtime import bench as bench_module
from dscale_runtime.bench import (BenchConfig, closed_loop, manifest, point_figures, request_stream, run, summarise,
                                  table)
from dscale_runtime.server.flags import parse_config
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.engine import Engine
from dscale_runtime.server.config import ServeConfig
from dscale_runtime.server.main import BackgroundServer

PROMPTS = ["def f(x):", "class A:", "import os", "x = [", "for i in range(", "while True:", "return a +"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    write_target(root / "target", tokenizer=True)
    write_drafter(root / "drafter")
    prompt_file = root / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    return root, prompt_file


def test_config_names_the_flag_to_fix():
    with pytest.raises(ValueError, match="--url URL"):
        BenchConfig()
    with pytest.raises(ValueError, match="--url URL"):
        BenchConfig(url="http://x", launch=True)
    with pytest.raises(ValueError, match="--modes"):
        BenchConfig(launch=True, modes="dflash,fast")
    with pytest.raises(ValueError, match="--concurrency"):
        BenchConfig(launch=True, concurrency="1,x")
    with pytest.raises(ValueError, match="--num-requests"):
        BenchConfig(launch=True, num_requests=0)
    with pytest.raises(ValueError, match="--client-processes"):
        BenchConfig(launch=True, client_processes=0)
    assert BenchConfig(launch=True, concurrency="1, 4,16").concurrency_list == [1, 4, 16]


def test_sampling_flags_parse():
    cfg = parse_config(BenchConfig, "dscale-bench", ["--launch", "--temperature", "0.7", "--top-p", "0.9",
                                                      "--top-k", "5", "--sampling-seed", "100"])
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.sampling_seed) == (0.7, 0.9, 5, 100)
    assert cfg.sampling == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "sampling_seed": 100}
    default = parse_config(BenchConfig, "dscale-bench", ["--launch"])
    assert default.sampling == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 0}
    edge = parse_config(BenchConfig, "dscale-bench", ["--launch", "--top-p", "1", "--top-k", "1"])
    assert (edge.top_p, edge.top_k) == (1.0, 1)


@pytest.mark.parametrize("flag, value", [("--temperature", "-0.1"), ("--temperature", "nan"),
                                         ("--temperature", "inf"), ("--top-p", "0"), ("--top-p", "1.01"),
                                         ("--top-p", "nan"), ("--top-k", "0"), ("--top-k", "-2")])
def test_bad_sampling_flag_is_named(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(BenchConfig, "dscale-bench", ["--launch", flag, value])
    assert exit_info.value.code == 2
    assert f"{flag} must" in capsys.readouterr().err


def test_manifest_is_fixed_and_cycles_a_short_prompt_set(tiny):
    _, prompt_file = tiny
    cfg = BenchConfig(launch=True, prompts=str(prompt_file), num_requests=10, warmup=2, max_tokens=7)
    warmup, measured = manifest(cfg)
    assert (warmup, measured) == manifest(cfg)
    assert len(warmup) == 2 and len(measured) == 10
    assert {r["max_tokens"] for r in measured} == {7} and {r["temperature"] for r in measured} == {0}
    assert {(r["top_p"], r["top_k"]) for r in measured} == {(1.0, -1)}
    assert [r["seed"] for r in measured] == list(range(10)) and [r["seed"] for r in warmup] == [10, 11]
    sampled = BenchConfig(launch=True, prompts=str(prompt_file), num_requests=10, warmup=2, max_tokens=7,
                          temperature=0.5, top_p=0.8, top_k=3, sampling_seed=40)
    warmup_s, measured_s = manifest(sampled)
    assert [r["id"] for r in measured_s] == [r["id"] for r in measured]  # the sampling seed leaves the draw alone
    assert [r["seed"] for r in measured_s] == list(range(40, 50)) and [r["seed"] for r in warmup_s] == [50, 51]
    assert {(r["temperature"], r["top_p"], r["top_k"]) for r in measured_s + warmup_s} == {(0.5, 0.8, 3)}
    assert {r["id"] for r in measured[: len(PROMPTS)]} == {f"p{i}" for i in range(len(PROMPTS))}
    assert manifest(BenchConfig(launch=True, prompts=str(prompt_file), seed=1))[1] != measured[:4]
    with pytest.raises(ValueError, match="--prompts"):
        manifest(BenchConfig(launch=True, prompts="nowhere.jsonl"))


def test_summarise_one_pass():
    records = [{"start": 0.0, "first": 0.5, "end": 2.5, "tokens": 5},
               {"start": 1.0, "first": 1.25, "end": 2.0, "tokens": 4},
               {"start": 2.0, "first": 2.5, "end": 4.0, "tokens": 1}]
    before = {"dscale_request_steps_total": 10, "dscale_accepted_drafts_total": 4}
    after = {"dscale_request_steps_total": 14, "dscale_accepted_drafts_total": 10}
    s = summarise(records, before, after)
    assert s["output_throughput"] == pytest.approx(10 / 4.0) and s["duration"] == 4.0
    assert s["e2e_mean"] == pytest.approx((2.5 + 1.0 + 2.0) / 3)
    assert s["ttft_mean"] == pytest.approx((0.5 + 0.25 + 0.5) / 3)
    assert s["tpot_mean"] == pytest.approx((2.0 / 4 + 0.75 / 3) / 2)  # single-token answers have no TPOT
    assert s["e2e_p99"] <= 2.5 and s["e2e_p95"] >= 2.0
    assert s["mean_acceptance_length"] == pytest.approx(1 + 6 / 4)


def test_sweep_against_a_running_server(tiny, tmp_path):
    root, prompt_file = tiny
    cfg = EngineConfig(mode="dflash", max_running_requests=2, max_model_len=128)
    engine = Engine.from_pretrained(root / "target", root / "drafter", config=cfg)
    bench = BenchConfig(prompts=str(prompt_file), concurrency="1,2", num_requests=5, warmup=1, repetitions=2,
                        max_tokens=9, output=str(tmp_path / "out"), url="placeholder", min_duration_s=0)
    reference = Engine.from_pretrained(root / "target", config=EngineConfig(mode="target", max_model_len=128))
    want = reference.generate([r["prompt"] for r in manifest(bench)[1]], SamplingParams(temperature=0, max_tokens=9))
    with BackgroundServer(engine, ServeConfig(port=0)) as server:
        report = run(BenchConfig(**{**bench.__dict__, "url": server.url}))
    points = report["points"]
    assert [(p["mode"], p["concurrency"], len(p["passes"])) for p in points] == [("dflash", 1, 2), ("dflash", 2, 2)]
    for p in points:
        for figures in p["passes"]:
            assert figures["completion_tokens"] == sum(len(o.token_ids) for o in want)
            assert figures["output_throughput"] > 0 and figures["e2e_p99"] >= figures["e2e_mean"] > 0
            assert figures["mean_acceptance_length"] >= 1.0
            assert 0 < figures["client_cpu"] <= 1.01  # the closed loop's thread: CPU seconds per second of the pass
        assert p["median"]["e2e_mean"] == pytest.approx(sum(f["e2e_mean"] for f in p["passes"]) / 2)
    out = tmp_path / "out"
    assert len(json.loads((out / "bench.json").read_text())["manifest"]["measured"]) == 5
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("dflash", "1"), ("dflash", "2")]
    assert [float(r["client_cpu"]) for r in rows] == pytest.approx([p["median"]["client_cpu"] for p in points])
    assert (out / "bench.png").stat().st_size > 10_000
    main_table, spread_table = table(points).split("\nSpread: ")
    assert main_table.count("| dflash |") == 2 and spread_table.count("| dflash |") == 2
    assert spread_table.startswith("each pass exactly --num-requests (no duration target)")
    assert table(points).startswith("Sampling: temperature 0.0 (greedy), top_p 1.0, top_k -1 (off), seed 0")
    assert {(r["temperature"], r["top_p"], r["top_k"], r["sampling_seed"]) for r in rows} == {("0.0", "1.0", "-1", "0")}


def test_sampled_sweep_sends_and_reports_the_settings(tiny, tmp_path):
    """Through the real server: the engine receives every request with the flags' settings and its own seed."""
    root, prompt_file = tiny
    engine = Engine.from_pretrained(root / "target", root / "drafter",
                                    config=EngineConfig(mode="dflash", max_running_requests=2, max_model_len=128))
    received = []  # (prompt token ids, SamplingParams) of every request that reached the engine
    add_request = engine.add_request

    def recording_add_request(token_ids, params=None, request_id=None):
        received.append((tuple(token_ids), params))
        return add_request(token_ids, params, request_id)

    engine.add_request = recording_add_request
    out = tmp_path / "sampled"
    bench = BenchConfig(prompts=str(prompt_file), concurrency="1,2", num_requests=4, warmup=1, repetitions=2,
                        max_tokens=6, temperature=0.8, top_p=0.9, top_k=5, sampling_seed=100, output=str(out),
                        url="placeholder", min_duration_s=0)
    warmup, measured = manifest(bench)
    seed_of = {tuple(engine.tokenizer.encode(r["prompt"], add_special_tokens=False)): r["seed"]
               for r in warmup + measured}
    assert len(seed_of) == 5  # distinct prompts, so a request's tokens name its manifest entry
    with BackgroundServer(engine, ServeConfig(port=0)) as server:
        report = run(BenchConfig(**{**bench.__dict__, "url": server.url}))

    assert len(received) == 2 * (1 + 2 * 4)  # two points, each 1 warmup + 2 passes x 4 requests
    for token_ids, params in received:
        assert (params.temperature, params.top_p, params.top_k) == (0.8, 0.9, 5)
        assert params.seed == seed_of[token_ids]
    seeds = sorted(params.seed for _, params in received)
    assert seeds == sorted([100, 101, 102, 103] * 4 + [104] * 2)

    settings = {"temperature": 0.8, "top_p": 0.9, "top_k": 5, "sampling_seed": 100}
    saved = json.loads((out / "bench.json").read_text())
    assert {k: saved["config"][k] for k in settings} == settings
    assert all({k: p[k] for k in settings} == settings for p in saved["points"] + report["points"])
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert len(rows) == 2 and all({k: r[k] for k in settings} == {k: str(v) for k, v in settings.items()}
                                  for r in rows)
    caption = table(report["points"]).splitlines()[0]
    assert caption == "Sampling: temperature 0.8, top_p 0.9, top_k 5, seed 100 + request index"


def test_launch_sweep_from_the_command_line(tiny, tmp_path):
    root, prompt_file = tiny
    out = tmp_path / "launch"
    command = [sys.executable, "-m", "dscale_runtime.bench", "--launch", "--modes", "target,dflash",
               "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--concurrency", "1,2",
               "--num-requests", "3", "--warmup", "0", "--repetitions", "1", "--max-tokens", "6",
               "--prompts", str(prompt_file), "--output", str(out), "--temperature", "0.5", "--top-k", "4",
               "--min-duration-s", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "| target | 2 |" in done.stdout and "| dflash | 1 |" in done.stdout
    assert "Sampling: temperature 0.5, top_p 1.0, top_k 4, seed 0 + request index" in done.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["command"].startswith("dscale-bench --launch")
    assert {p["mode"] for p in report["points"]} == {"target", "dflash"}
    assert {(p["temperature"], p["top_k"]) for p in report["points"]} == {(0.5, 4)}
    assert (out / "server-dflash.log").is_file() and (out / "bench.png").is_file()


def test_serve_args_reach_each_launched_server_last(tmp_path, capsys):
    cfg = parse_config(BenchConfig, "dscale-bench", ["--launch", "--budget-ratio", "0.5", "--serve-args",
                                                     "--engine-process true --budget-ratio 0.25 --log-level 'info'"])
    command = bench_module.LaunchedServer(cfg, "dscale", tmp_path / "log").command
    assert command[-6:] == ["--engine-process", "true", "--budget-ratio", "0.25", "--log-level", "info"]
    assert command.index("--budget-ratio") < len(command) - 6  # the bench's own flags first: the extras override
    assert bench_module.LaunchedServer(BenchConfig(launch=True), "dscale", tmp_path / "log").command[-2:] == \
        ["--log-level", "warning"]
    for argv, message in ((["--launch", "--serve-args", "--target 'a"], "--serve-args must split"),
                          (["--url", "http://x", "--serve-args", "--engine-process true"], "--serve-args is for")):
        with pytest.raises(SystemExit):
            parse_config(BenchConfig, "dscale-bench", argv)
        assert message in capsys.readouterr().err


def test_a_timed_pass_runs_without_the_cyclic_collector_and_restores_it(monkeypatch):
    import gc

    seen = {}

    async def loop(*args):
        seen["enabled"], seen["frozen"] = gc.isenabled(), gc.get_freeze_count()
        return [{"start": 0.0, "first": 0.1, "end": 0.2, "tokens": 2}]

    monkeypatch.setattr(bench_module, "closed_loop", loop)
    frozen_before = gc.get_freeze_count()
    gc.unfreeze()  # NOTE: whatever an earlier test froze: this test starts from nothing frozen, and ends so
    try:
        records, _ = bench_module._timed_loop("http://unused", "m", [], 1, BenchConfig(launch=True))
        assert len(records) == 1 and seen["enabled"] is False and seen["frozen"] > 0
        assert gc.isenabled() and gc.get_freeze_count() == 0
        gc.disable()  # a caller's own settings survive a pass: off stays off
        try:
            bench_module._timed_loop("http://unused", "m", [], 1, BenchConfig(launch=True))
            assert not gc.isenabled() and gc.get_freeze_count() == 0
        finally:
            gc.enable()
        gc.freeze()  # a heap frozen before a pass stays frozen after it
        frozen = gc.get_freeze_count()
        bench_module._timed_loop("http://unused", "m", [], 1, BenchConfig(launch=True))
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()
        if frozen_before:
            gc.freeze()


# ---------------------------------------------------------------------------------------------- sizing, spread
def test_sizing_flags_parse_and_are_checked(capsys):
    default = parse_config(BenchConfig, "dscale-bench", ["--launch", "--num-requests", "8"])
    assert (default.min_duration_s, default.max_requests, default.request_cap) == (5.0, None, 800)
    assert default.sizing == {"min_duration_s": 5.0, "max_requests": 800}
    cfg = parse_config(BenchConfig, "dscale-bench", ["--launch", "--min-duration-s", "0.5", "--max-requests", "40"])
    assert cfg.sizing == {"min_duration_s": 0.5, "max_requests": 40}
    for argv, message in ((["--min-duration-s", "-1"], "--min-duration-s must"),
                          (["--min-duration-s", "inf"], "--min-duration-s must"),
                          (["--num-requests", "8", "--max-requests", "7"], "--max-requests must be >= --num-requests")):
        with pytest.raises(SystemExit):
            parse_config(BenchConfig, "dscale-bench", ["--launch", *argv])
        assert message in capsys.readouterr().err


def test_request_stream_is_the_manifest_then_the_draw_continued(tiny):
    _, prompt_file = tiny
    cfg = BenchConfig(launch=True, prompts=str(prompt_file), num_requests=4, warmup=2, sampling_seed=10)
    warmup, measured = manifest(cfg)
    stream = request_stream(cfg)
    assert [stream(k) for k in range(4)] == measured
    extra = [stream(k) for k in range(4, 4 + 2 * len(PROMPTS))]
    assert [r["seed"] for r in extra] == list(range(16, 16 + 2 * len(PROMPTS)))  # past the warmup's 14, 15
    assert len({r["seed"] for r in warmup + measured + extra}) == 6 + 2 * len(PROMPTS)
    ids = [r["id"] for r in measured + warmup + extra]
    assert ids[len(PROMPTS):] == ids[: -len(PROMPTS)]  # the draw cycles through the whole prompt set
    assert [stream(k) for k in range(4, 10)] == extra[:6]  # the same in every pass


def fake_send(latency: float):
    """A stand-in for the HTTP request: `latency` s, first token halfway, 3 tokens."""
    async def send(http, model, request, start=None):
        start = time.perf_counter() if start is None else start
        await asyncio.sleep(latency)
        end = time.perf_counter()
        return {"start": start, "first": (start + end) / 2, "end": end, "tokens": 3}
    return send


def test_closed_loop_runs_until_the_duration_target(monkeypatch):
    monkeypatch.setattr(bench_module, "_send", fake_send(0.01))
    requests = [{"id": f"m{i}", "seed": i} for i in range(3)]
    more = lambda k: {"id": f"x{k}", "seed": 100 + k}

    def loop(**kwargs):
        return asyncio.run(closed_loop("http://unused", "m", requests, 2, 5.0, **kwargs))

    exact = loop()  # no target: exactly the requests, as before
    assert sorted(r["id"] for r in exact) == ["m0", "m1", "m2"]
    assert len(loop(min_duration_s=0, max_requests=50, more=more)) == 3

    held = loop(min_duration_s=0.25, max_requests=1000, more=more)
    duration = max(r["end"] for r in held) - min(r["start"] for r in held)
    assert 0.25 <= duration < 5 and len(held) > 6  # ~0.25 s / 0.01 s x 2 clients = 50 on an idle machine
    by_index = sorted(held, key=lambda r: r["index"])
    assert [r["index"] for r in by_index] == list(range(len(held)))  # each index sent once, none skipped
    assert [r["id"] for r in by_index] == ["m0", "m1", "m2", *(f"x{k}" for k in range(3, len(held)))]
    assert [r["seed"] for r in by_index[3:]] == [100 + k for k in range(3, len(held))]

    capped = loop(min_duration_s=60, max_requests=7, more=more)  # the cap stops it long before the target
    assert len(capped) == 7 and {r["index"] for r in capped} == set(range(7))
    cycled = loop(min_duration_s=0.3)  # no `more`: the requests cycled
    assert len(cycled) >= 6 and [r["id"] for r in sorted(cycled, key=lambda r: r["index"])][3:6] == ["m0", "m1", "m2"]


def test_closed_loop_shares_its_indices_through_a_counter(monkeypatch):
    """Client processes share a pass through one counter (here two threads, each its own event loop): together they
    send the manifest, then the draw continued, every index once, until the duration target, or the cap."""
    import multiprocessing

    monkeypatch.setattr(bench_module, "_send", fake_send(0.01))
    requests = [{"id": f"m{i}", "seed": i} for i in range(5)]
    more = lambda k: {"id": f"x{k}", "seed": 100 + k}

    def shared(**kwargs):
        counter, out = multiprocessing.Value("q", 0), [None, None]

        def part(j):
            out[j] = asyncio.run(closed_loop("http://unused", "m", requests, 2, 5.0, more=more, counter=counter,
                                             **kwargs))
        threads = [threading.Thread(target=part, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    exact = shared()
    assert sorted(r["id"] for part in exact for r in part) == [f"m{i}" for i in range(5)]
    capped = shared(min_duration_s=60, max_requests=11)
    assert sorted(r["index"] for part in capped for r in part) == list(range(11))
    held = shared(min_duration_s=0.2, max_requests=1000)
    records = held[0] + held[1]
    assert held[0] and held[1] and sorted(r["index"] for r in records) == list(range(len(records)))
    assert all(max(r["end"] for r in part) - min(r["start"] for r in part) >= 0.2 for part in held)
    assert all(r["id"] == f"x{r['index']}" and r["seed"] == 100 + r["index"] for r in records if r["index"] >= 5)


def test_client_processes_share_a_pass_against_a_server(tiny):
    """--client-processes 2 against a fast stand-in server: one pass's requests come from both processes, every
    index once, the manifest then the draw continued (the same seeds as one process sends), lasting the target."""
    _, prompt_file = tiny
    config = BenchConfig(prompts=str(prompt_file), concurrency="3", num_requests=4, warmup=0, max_tokens=3,
                         url="placeholder", min_duration_s=0.5, max_requests=400, client_processes=2)
    stream = request_stream(config)
    with FakeServer() as server, bench_module.Clients(2) as clients:
        records, cpu = clients.run_pass(config, server.url, "fake", 3, manifest(config)[1])
        bodies = list(server.bodies)
    indices = sorted(r["index"] for r in records)
    assert indices == list(range(len(records))) and len(records) > 4
    assert len({r["client"] for r in records}) == 2 and os.getpid() not in {r["client"] for r in records}
    assert sorted((b["seed"], b["prompt"]) for b in bodies) == [(stream(k)["seed"], stream(k)["prompt"])
                                                              for k in indices]
    assert max(r["end"] for r in records) - min(r["start"] for r in records) >= 0.5
    assert 0 < cpu < 2


def test_point_spread_and_pooled_figures_follow_the_requests():
    def records(ttfts, e2e_scale):
        return [{"start": float(i), "first": float(i) + t, "end": float(i) + e2e_scale * (1 + i % 3), "tokens": 1 + i % 4}
                for i, t in enumerate(ttfts)]

    counters = {"dscale_request_steps_total": 1, "dscale_accepted_drafts_total": 0}
    rng = np.random.default_rng(0)
    passes_records = [records(rng.uniform(0.01, 0.2, size=n), scale) for n, scale in ((30, 1.0), (45, 1.5), (20, 0.8))]
    passes = [summarise(r, counters, counters) for r in passes_records]
    point = point_figures(passes, passes_records)
    assert point["passes"] == passes
    for p, rs in zip(passes, passes_records):
        ttft = [r["first"] - r["start"] for r in rs]
        assert p["requests"] == len(rs) and p["request_throughput"] == pytest.approx(len(rs) / p["duration"])
        assert p["ttft_median"] == pytest.approx(np.median(ttft)) and p["ttft_p90"] == pytest.approx(np.percentile(ttft, 90))
        assert p["ttft_p99_over_median"] == pytest.approx(np.percentile(ttft, 99) / np.median(ttft))
        tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in rs if r["tokens"] > 1]
        assert p["tpot_p99"] == pytest.approx(np.percentile(tpot, 99)) and p["tpot_median"] < p["tpot_p90"]
    for k in ("output_throughput", "duration", "requests", "ttft_p99", "ttft_p99_over_median", "e2e_median"):
        values = [p[k] for p in passes]
        assert point["spread"][k] == {"min": min(values), "median": sorted(values)[1], "max": max(values)}
        assert point["median"][k] == sorted(values)[1]
    everything = [r for rs in passes_records for r in rs]
    ttft = [r["first"] - r["start"] for r in everything]
    e2e = [r["end"] - r["start"] for r in everything]
    assert point["pooled"]["requests"] == 95
    assert point["pooled"]["ttft_p99"] == pytest.approx(np.percentile(ttft, 99))
    assert point["pooled"]["e2e_p90"] == pytest.approx(np.percentile(e2e, 90))
    assert point["pooled"]["ttft_p99_over_median"] == pytest.approx(np.percentile(ttft, 99) / np.median(ttft))
    single = summarise([{"start": 0.0, "first": 0.1, "end": 0.1, "tokens": 1}], counters, counters)
    assert math.isnan(single["tpot_median"]) and math.isnan(point_figures([single], [[]])["spread"]["tpot_median"]["min"])


class FakeServer:
    """A fast stand-in for dscale-serve (threaded http.server): /v1/models, /metrics counters and streamed
    /v1/completions answering max_tokens one-character chunks after `latency` s; it keeps every request body."""

    def __init__(self, latency: float = 0.005) -> None:
        self.bodies: list[dict] = []
        self.steps = 0
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, status: int, content_type: str, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                if self.path == "/v1/models":
                    self.reply(200, "application/json", json.dumps({"data": [{"id": "fake", "mode": "fake"}]}).encode())
                else:  # /metrics: 2 steps and 3 accepted drafts per request, so the acceptance length is 2.5
                    text = f"dscale_request_steps_total {fake.steps}\ndscale_accepted_drafts_total {1.5 * fake.steps}\n"
                    self.reply(200, "text/plain", text.encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                time.sleep(latency)
                chunks = [{"choices": [{"text": "x"}]} for _ in range(body["max_tokens"])]
                chunks.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
                fake.steps += 2
                self.reply(200, "text/event-stream",
                           "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "FakeServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# NOTE: well above what the manifest's 3 requests take even on a loaded 2-core CI machine (one pass there took 0.36 s
# with only those 3 against a 0.3 s target), so every pass has to continue the draw
TARGET_S = 1.0


def test_duration_target_against_a_fast_server(tiny, tmp_path, capsys):
    """A duration target longer than the manifest takes: every pass runs more requests (the draw continued) and
    lasts the target; bench.json, bench.csv, bench_requests.csv and the table agree with the raw per-request data.
    A cap below what the target needs stops every pass at the cap and says so."""
    _, prompt_file = tiny
    out = tmp_path / "held"
    bench = BenchConfig(prompts=str(prompt_file), concurrency="1,3", num_requests=3, warmup=1, repetitions=2,
                        max_tokens=4, output=str(out), url="placeholder", min_duration_s=TARGET_S, max_requests=5000)
    with FakeServer() as server:
        report = run(BenchConfig(**{**bench.__dict__, "url": server.url}))
    sent = server.bodies
    assert [p["concurrency"] for p in report["points"]] == [1, 3] and report["sizing"] == bench.sizing
    assert len(sent) == 2 * 1 + sum(p["requests"] for point in report["points"] for p in point["passes"])
    stream = request_stream(bench)
    rows = list(csv.DictReader((out / "bench_requests.csv").open()))
    assert len(rows) == sum(point["pooled"]["requests"] for point in report["points"])
    for point in report["points"]:
        assert (point["min_duration_s"], point["max_requests"]) == (TARGET_S, 5000)
        for i, p in enumerate(point["passes"]):
            assert p["duration"] >= TARGET_S and 3 < p["requests"] < 5000
            assert p["completion_tokens"] == 4 * p["requests"] and p["mean_acceptance_length"] == pytest.approx(2.5)
            own = [r for r in rows if (r["concurrency"], r["pass"]) == (str(point["concurrency"]), str(i + 1))]
            assert [int(r["index"]) for r in own] == list(range(p["requests"]))
            assert [(r["id"], int(r["seed"])) for r in own] == [(stream(k)["id"], stream(k)["seed"]) for k in range(len(own))]
            ttft = [float(r["ttft"]) for r in own]
            assert p["ttft_p99"] == pytest.approx(np.percentile(ttft, 99))
            assert p["ttft_median"] == pytest.approx(np.median(ttft))
            assert max(float(r["start"]) + float(r["e2e"]) for r in own) == pytest.approx(p["duration"])
        for k in ("duration", "requests", "output_throughput"):
            values = [p[k] for p in point["passes"]]
            assert point["spread"][k] == {"min": min(values), "median": statistics.median(values), "max": max(values)}
        pooled = [float(r["ttft"]) for r in rows if r["concurrency"] == str(point["concurrency"])]
        assert point["pooled"]["ttft_p99"] == pytest.approx(np.percentile(pooled, 99))
        assert point["pooled"]["ttft_p99_over_median"] == pytest.approx(np.percentile(pooled, 99) / np.median(pooled))
    # measured 0-2, warmup 3, then request k >= 3 continues the draw past the warmup: seed k + 1
    longest = max(p["requests"] for point in report["points"] for p in point["passes"])
    assert {body["seed"] for body in sent} == set(range(longest + 1))
    assert report["manifest"]["extra"] == [stream(k)["id"] for k in range(3, longest)]

    rows = list(csv.DictReader((out / "bench.csv").open()))
    for row, point in zip(rows, report["points"]):
        tp = [p["output_throughput"] for p in point["passes"]]
        assert float(row["output_throughput_min"]) == pytest.approx(min(tp))
        assert float(row["output_throughput_max"]) == pytest.approx(max(tp))
        assert float(row["pooled_ttft_p99"]) == pytest.approx(point["pooled"]["ttft_p99"])
        assert float(row["requests"]) == point["median"]["requests"]
        assert (row["min_duration_s"], row["max_requests"], row["repetitions"]) == (str(TARGET_S), "5000", "2")
    saved = json.loads((out / "bench.json").read_text())["points"]
    assert [p["spread"] for p in saved] == [p["spread"] for p in report["points"]]
    assert all("records" not in p for p in saved)
    text = table(report["points"])
    assert f"Spread: each pass >= {TARGET_S} s, at most 5000 requests" in text
    assert f"| {report['points'][1]['pooled']['ttft_p99_over_median']:.2f} |" in text

    capsys.readouterr()
    capped = BenchConfig(**{**bench.__dict__, "concurrency": "2", "min_duration_s": 60.0, "max_requests": 5,
                            "output": str(tmp_path / "capped")})
    with FakeServer() as server:
        report = run(BenchConfig(**{**capped.__dict__, "url": server.url}))
    assert [p["requests"] for p in report["points"][0]["passes"]] == [5, 5]
    assert capsys.readouterr().out.count("stopped at --max-requests 5, short of the --min-duration-s target") == 2


def test_serve_paired_takes_each_ratio_within_its_round(monkeypatch, capsys):
    """benchmarks/serve_paired.py: every server runs one pass per round at each point and concurrency, each round
    starting one server later; a server's 'x best' and 'x target' are medians of per-round ratios (a drift of the
    machine between rounds cancels), its tok/s the median of its rounds."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "serve_paired.py"
    spec = importlib.util.spec_from_file_location("serve_paired", path)
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    assert paired.parse_points("a:--temperature 0.7 --top-p 0.8; b:--temperature 0 --top-k 5") == {
        "a": {"temperature": 0.7, "top_p": 0.8}, "b": {"temperature": 0.0, "top_k": 5}}
    for bad, message in (("a:--temperature", "in pairs"), ("a:--seed 3", "unknown flag"), (";", "no point")):
        with pytest.raises(ValueError, match=message):
            paired.parse_points(bad)
    order, speed = [], {"target": 1.0, "fast": 2.0, "slow": 1.9}

    def one_pass(config, url, model, c, measured, clients):  # the machine runs at 1, 3, 2 x in rounds 1, 2, 3
        order.append(url)
        drift = (1.0, 3.0, 2.0)[(len(order) - 1) // 3 % 3]  # NOTE: three servers, three passes a round
        return {"output_throughput": 100 * c * speed[url] * drift, "mean_acceptance_length": 2.0,
                "ttft_median": 0.01, "duration": 1.5, "client_cpu": 0.1 * len(order),
                "steps": {"dflash": 10.0, "target": 1.0} if url == "slow" else {"target": 5.0}}

    monkeypatch.setattr(paired, "one_pass", one_pass)
    monkeypatch.setattr(paired, "server_identity", lambda url: ("m", url))
    monkeypatch.setattr(paired, "closed_loop", lambda *a, **k: asyncio.sleep(0))
    saved = []  # what a sweep stopped early has kept: the rows so far, after each point
    rows = paired.paired({n: n for n in speed}, {"greedy": {"temperature": 0.0}}, [1, 8], 3, 1.0, 4, 1, 8,
                         on_row=lambda rows: saved.append([r["concurrency"] for r in rows]))
    assert saved == [[1], [1, 8]]
    assert order[:9] == ["target", "fast", "slow", "fast", "slow", "target", "slow", "target", "fast"]
    assert [r["concurrency"] for r in rows] == [1, 8]
    for row in rows:
        s = row["servers"]
        assert s["fast"]["vs_best"] == 1.0 and s["target"]["vs_target"] == 1.0
        assert s["slow"]["vs_best"] == pytest.approx(0.95)
        assert s["slow"]["vs_best_range"] == pytest.approx([0.95, 0.95])
        assert s["fast"]["vs_target"] == pytest.approx(2.0) and s["fast"]["tok_s"] == 200 * row["concurrency"] * 2.0
    assert rows[0]["servers"]["target"]["client_cpu_max"] == pytest.approx(0.8)  # its passes: 1st, 6th and 8th
    # a server's steps by step come from its /metrics series (`read_counters` keeps each labelled series by full name)
    from dscale_runtime import bench

    text = ('# HELP x\ndscale_decode_steps_by_step_total{model_name="m",step="dflash"} 7.0\n'
            'dscale_decode_steps_by_step_total{model_name="m",step="target"} 2.0\ndscale_request_steps_total 9.0\n')
    monkeypatch.setattr(bench.httpx, "get", lambda url, timeout: types.SimpleNamespace(text=text))
    counters = bench.read_counters("http://x")
    assert counters["dscale_request_steps_total"] == 9.0
    assert paired.steps_by_step(counters) == {"dflash": 7.0, "target": 2.0}
    # the decode steps each server ran, by step, summed over its passes
    assert rows[0]["servers"]["slow"]["steps_by_step"] == {"dflash": 30.0, "target": 3.0}
    assert rows[0]["servers"]["fast"]["steps_by_step"] == {"target": 15.0}
    assert "| greedy | 8 |" in paired.table(rows)
    # pinned servers trade core sets round by round: each gets each set once in three rounds
    pins = []
    monkeypatch.setattr(paired, "pin_tree", lambda pid, cpus: pins.append((pid, min(cpus))))
    sets = [paired.cpu_list(t) for t in ("0-3", "4,5-7", "8-11")]
    assert sets[1] == {4, 5, 6, 7}
    rows = paired.paired({n: n for n in speed}, {"greedy": {"temperature": 0.0}}, [1], 3, 1.0, 4, 1, 8,
                         {"target": 10, "fast": 11, "slow": 12}, sets)
    assert pins == [(10, 0), (11, 4), (12, 8), (10, 4), (11, 8), (12, 0), (10, 8), (11, 0), (12, 4)]
    assert rows[0]["servers"]["slow"]["cores_rounds"] == [list(range(8, 12)), list(range(4)), list(range(4, 8))]
    with pytest.raises(ValueError, match="at least 3 core sets"):
        paired.paired({n: n for n in speed}, {"greedy": {}}, [1], 3, 1.0, 4, 1, 8,
                      {"target": 10, "fast": 11, "slow": 12}, sets[:2])
    for bad in ("", "3-1", "a"):
        with pytest.raises(ValueError, match="core set"):
            paired.cpu_list(bad)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_serve_paired_pins_a_whole_process_tree():
    """serve_paired.pin_tree moves every thread of a server and of the processes it started (the engine process)
    onto the given cores."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("serve_paired",
                                                  Path(__file__).parents[1] / "benchmarks" / "serve_paired.py")
    paired = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(paired)
    cpu = min(os.sched_getaffinity(0))
    root = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30; wait"])
    try:
        for _ in range(100):
            tree = paired.process_tree(root.pid)
            if len(tree) == 3:
                break
            time.sleep(0.02)
        assert len(tree) == 3 and tree[0] == root.pid
        assert paired.pin_tree(root.pid, {cpu}) == 3
        assert all(os.sched_getaffinity(pid) == {cpu} for pid in tree)
    finally:
        for pid in reversed(paired.process_tree(root.pid)):
            os.kill(pid, 9)
        root.wait()
