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


def test_manifest_is_fixed_and_cycles_a_short_prompt_set(tiny):
    _, prompt_file = tiny
    cfg = BenchConfig(launch=True, prompts=str(prompt_file), num_requests=10, warmup=2, max_tokens=7)
    warmup, measured = manifest(cfg)
    assert (warmup, measured) == manifest(cfg)
    assert len(warmup) == 2 and len(measured) == 10
    assert {r["max_tokens"] for r in measured} == {7} and {r["temperature"] for r in measured} == {0}
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


def test_launch_sweep_from_the_command_line(tiny, tmp_path):
    root, prompt_file = tiny
    out = tmp_path / "launch"
    command = [sys.executable, "-m", "dscale_runtime.bench", "--launch", "--modes", "target,dflash",
               "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--concurrency", "1,2",
               "--num-requests", "3", "--warmup", "0", "--repetitions", "1", "--max-tokens", "6",
               "--prompts", str(prompt_file), "--output", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "| target | 2 |" in done.stdout and "| dflash | 1 |" in done.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["command"].startswith("dscale-bench --launch")
    assert {p["mode"] for p in report["points"]} == {"target", "dflash"}
    assert (out / "server-dflash.log").is_file() and (out / "bench.png").is_file()
