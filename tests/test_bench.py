"""dscale-bench: configuration checks, the fixed manifest, the figures of a pass, a sweep against a server in
this process and a `--launch` sweep through the command line (tiny checkpoints, so it runs in seconds)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from checkpoints import write_drafter, write_target
from dscale_runtime.bench import BenchConfig, manifest, run, summarise, table
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
                        max_tokens=9, output=str(tmp_path / "out"), url="placeholder")
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
        assert p["median"]["e2e_mean"] == pytest.approx(sum(f["e2e_mean"] for f in p["passes"]) / 2)
    out = tmp_path / "out"
    assert len(json.loads((out / "bench.json").read_text())["manifest"]["measured"]) == 5
    rows = list(csv.DictReader((out / "bench.csv").open()))
    assert [(r["mode"], r["concurrency"]) for r in rows] == [("dflash", "1"), ("dflash", "2")]
    assert (out / "bench.png").stat().st_size > 10_000
    assert table(points).count("| dflash |") == 2
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
                        url="placeholder")
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
               "--prompts", str(prompt_file), "--output", str(out), "--temperature", "0.5", "--top-k", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "| target | 2 |" in done.stdout and "| dflash | 1 |" in done.stdout
    assert "Sampling: temperature 0.5, top_p 1.0, top_k 4, seed 0 + request index" in done.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["command"].startswith("dscale-bench --launch")
    assert {p["mode"] for p in report["points"]} == {"target", "dflash"}
    assert {(p["temperature"], p["top_k"]) for p in report["points"]} == {(0.5, 4)}
    assert (out / "server-dflash.log").is_file() and (out / "bench.png").is_file()
