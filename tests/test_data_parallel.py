"""Data-parallel dscale-serve: two demo-pair replicas behind sglang-router on localhost (`DataParallelServer`, what
`dscale-serve --data-parallel-size N` runs), a replica killed and replaced, and a router-only `dscale-serve`
(the multi-node command) in front of the same replicas.

Oracles: target-only greedy decoding of one in-process engine, one request at a time (every replica's greedy answer
equals it token for token); each replica's own /metrics (how many requests it answered; a restarted replica
counts from zero); the router's worker list; flags parsed back from a replica's command line.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields, replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import stdlib_prompts
from dscale_runtime.engine import Engine
from dscale_runtime.server.app import ROUTER_NO_OP_FIELDS
from dscale_runtime.server.config import DEMO_TARGET, REPO_ROOT, ServeConfig
from dscale_runtime.server.data_parallel import (LAUNCHER_FIELDS, DataParallelServer, answers, free_ports,
                                                 replica_command, replica_devices)
from dscale_runtime.server.flags import parse_config

MAX_TOKENS = 24
NUM_PROMPTS = 4


# ---------------------------------------------------------------------------------------------- flags
def test_replica_command_parses_back_to_the_replica_config():
    argv = ["--mode", "dflash", "--port", "9000", "--max-running-requests", "3", "--budget-ratio", "0.25",
            "--api-key", "k", "--measure-retention", "--step-graphs", "false", "--served-model-name", "demo",
            "--template-timeout", "2.5", "--device", "cuda", "--data-parallel-size", "2", "--data-parallel-gpus",
            "0,0", "--router-policy", "power_of_two", "--router-args", "--queue-size 5"]
    config = parse_config(ServeConfig, "dscale-serve", argv)
    assert config.data_parallel
    command = replica_command(config, 9001, "cuda")
    assert command[:3] == [sys.executable, "-m", "dscale_runtime.server.main"]
    replica = parse_config(ServeConfig, "dscale-serve", command[3:])
    launcher_defaults = {f.name: f.default for f in fields(ServeConfig) if f.name in LAUNCHER_FIELDS}
    assert replica == replace(config, port=9001, **launcher_defaults)
    assert not replica.data_parallel


@pytest.mark.parametrize("options, flag", [
    (dict(data_parallel_size=0), "--worker-urls"),
    (dict(data_parallel_size=-1), "--data-parallel-size"),
    (dict(data_parallel_size=2, data_parallel_gpus="0"), "--data-parallel-gpus"),
    (dict(data_parallel_size=2, data_parallel_gpus="0,gpu1"), "--data-parallel-gpus"),
    (dict(data_parallel_size=2, router_policy="least_load"), "--router-policy"),
    (dict(worker_urls="node1:8000"), "--worker-urls"),
    (dict(worker_urls=" , "), "--worker-urls"),
    (dict(data_parallel_size=2, router=False, worker_urls="http://node1:8001"), "--router false"),
    (dict(router_policy="random"), "--data-parallel-size N"),
    (dict(router_args="--queue-size 5"), "--data-parallel-size N"),
    (dict(data_parallel_size=2, port=65533), "--port 65533"),
])
def test_bad_data_parallel_flags_name_the_flag(options, flag):
    with pytest.raises(ValueError, match=flag):
        ServeConfig(**options)


def test_replica_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,7")
    config = ServeConfig(device="cuda", data_parallel_size=3, data_parallel_gpus="1,1,0")
    assert replica_devices(config) == [("cuda", {"CUDA_VISIBLE_DEVICES": v}) for v in ("7", "7", "4")]
    with pytest.raises(ValueError, match="shows 2 GPUs"):
        replica_devices(ServeConfig(device="cuda", data_parallel_size=1, data_parallel_gpus="2", router=False))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert replica_devices(config) == [("cuda", {"CUDA_VISIBLE_DEVICES": v}) for v in ("1", "1", "0")]
    with pytest.raises(ValueError, match="--data-parallel-gpus"):
        replica_devices(ServeConfig(device="cuda:1", data_parallel_size=2))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    assert replica_devices(ServeConfig(data_parallel_size=2)) == [("cpu", {"OMP_NUM_THREADS": threads})] * 2


# ---------------------------------------------------------------------------------------------- two replicas
@pytest.fixture(scope="module")
def expected():
    """{prompt: greedy text} of target-only decoding, one request at a time."""
    prompts = [p["prompt"] for p in stdlib_prompts() if len(p["prompt"]) < 240][:NUM_PROMPTS]
    engine = Engine.from_pretrained(DEMO_TARGET, config=EngineConfig(mode="target", max_running_requests=1,
                                                                     max_model_len=1024))
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return {prompt: output.text for prompt, output in zip(prompts, outputs)}


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.fail("sglang-router is not installed: pip install -e '.[distributed]'")
    log_path = tmp_path_factory.mktemp("data_parallel") / "children.log"
    config = ServeConfig(port=0, data_parallel_size=2, max_running_requests=4, max_model_len=1024,
                         log_level="warning")
    with log_path.open("w") as output, DataParallelServer(config, output=output) as server:
        yield server


def complete(url: str, prompt: str) -> str:
    body = {"model": "target", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def complete_all(url: str, expected: dict[str, str]) -> None:
    """Every prompt at once (4 clients); each answer equals the one-engine oracle."""
    with ThreadPoolExecutor(len(expected)) as pool:
        texts = list(pool.map(lambda prompt: complete(url, prompt), expected))
    assert texts == list(expected.values())


def requests_received(url: str) -> float:
    """dscale_requests_received_total of the server at `url` (one replica)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "dscale_requests_received")
    return family.samples[0].value


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.2)


def test_requests_spread_over_replicas_and_equal_one_engine(dp_server, expected):
    models = httpx.get(dp_server.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == ["target"]
    before = [requests_received(r.url) for r in dp_server.replicas]
    complete_all(dp_server.url, expected)
    served = [requests_received(r.url) - b for r, b in zip(dp_server.replicas, before)]
    assert served == [NUM_PROMPTS / 2] * 2  # round robin: half each, nothing retried

    merged = httpx.get(dp_server.url + "/engine_metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(merged) if f.name == "dscale_requests_received")
    by_replica = {s.labels["worker_addr"]: s.value for s in family.samples}
    assert by_replica == {r.url: requests_received(r.url) for r in dp_server.replicas}
    router_metrics = httpx.get(dp_server.metrics_url, timeout=10).text
    health = next(f for f in text_string_to_metric_families(router_metrics) if f.name == "smg_worker_health")
    assert {s.labels["worker"]: s.value for s in health.samples} == {r.url: 1.0 for r in dp_server.replicas}


def test_replica_answers_what_the_router_asks(dp_server, expected):
    url = dp_server.replicas[1].url
    info = httpx.get(url + "/server_info", timeout=10).json()
    assert info["served_model_name"] == "target" and info["max_running_requests"] == 4 and "model_path" not in info
    assert httpx.get(url + "/model_info", timeout=10).json()["architectures"] == ["Qwen3ForCausalLM"]
    idle = [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    assert httpx.get(url + "/get_load", timeout=10).json() == idle

    prompt, text = next(iter(expected.items()))
    body = {"model": "target", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **ROUTER_NO_OP_FIELDS}
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == text
    for name, no_op in ROUTER_NO_OP_FIELDS.items():
        for value in (not no_op, int(no_op)):
            refused = httpx.post(url + "/v1/completions", json={**body, name: value}, timeout=30)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == name, refused.text


def test_killed_replica_leaves_rotation_and_is_restarted(dp_server, expected):
    victim = dp_server.replicas[0]
    pid = victim.process.pid
    os.kill(pid, signal.SIGKILL)
    victim.process.wait(10)
    complete_all(dp_server.url, expected)  # the router retries the dead replica's share on the other one

    wait_until(lambda: victim.restarts == 1 and answers(victim.url + "/health"), 120, "replica 0 restarted")
    assert victim.process.pid != pid

    def served_by_victim() -> bool:
        complete_all(dp_server.url, expected)
        return requests_received(victim.url) > 0  # a fresh process: counting from zero

    wait_until(served_by_victim, 60, "the restarted replica back in rotation")
    workers = httpx.get(dp_server.url + "/workers", timeout=10).json()["workers"]
    assert sorted(w["url"] for w in workers if w["is_healthy"]) == sorted(r.url for r in dp_server.replicas)
    assert dp_server.replicas[1].restarts == 0 and dp_server.router.restarts == 0


def test_router_only_dscale_serve_in_front_of_running_replicas(dp_server, expected, tmp_path):
    """The multi-node command: `dscale-serve --data-parallel-size 0 --worker-urls ...`; SIGTERM stops it."""
    port, metrics_port = free_ports(2, "127.0.0.1")
    urls = ",".join(r.url for r in dp_server.replicas)
    command = [sys.executable, "-m", "dscale_runtime.server.main", "--data-parallel-size", "0", "--worker-urls", urls,
               "--port", str(port), "--router-metrics-port", str(metrics_port), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "router.log").open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: answers(url + "/readiness"), 60, "the router-only dscale-serve")
            complete_all(url, expected)
            process.send_signal(signal.SIGTERM)
            assert process.wait(60) == 0, (tmp_path / "router.log").read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert not answers(url + "/liveness")  # its router stopped with it
