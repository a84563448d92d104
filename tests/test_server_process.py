"""dscale-serve with the engine in a process of its own (`--engine-process`, `server/engine_process.py`).

Oracle: target-only greedy decoding of the same checkpoint in the test process (`Engine.generate`), as in
test_server.py. The server runs in a thread of the test process; its engine in a spawned child.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest

from checkpoints import write_drafter, write_target
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.engine import Engine
from dscale_runtime.models.loader import load_tokenizer
from dscale_runtime.server.config import ServeConfig
from dscale_runtime.server.engine_process import EngineProcessClient
from dscale_runtime.server.main import BackgroundServer

LEN = 128
PROMPTS = [[5, 17, 33, 2], [40, 41, 42, 43, 44, 45], [7, 7, 7], [90, 3, 61, 12, 8]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_process")
    write_target(root / "target", tokenizer=True)
    write_drafter(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="module")
def reference(pair):
    engine = Engine.from_pretrained(pair[0], config=EngineConfig(mode="target", max_model_len=LEN))
    return engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))


def serve(pair, **flags):
    config = ServeConfig(target=str(pair[0]), drafter=str(pair[1]), mode="dflash", port=0, max_model_len=LEN,
                         max_running_requests=4, log_level="warning", engine_process=True, **flags)
    client = EngineProcessClient(config)
    return BackgroundServer(client.start_process(load_tokenizer(pair[0])), config, client), client


def complete(url: str, prompt, **extra) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def streamed(url: str, prompt) -> tuple[str, dict]:
    body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["text"])
                usage = chunk.get("usage") or usage
    return "".join(text), usage


def metric(url: str, name: str, labels: str = "") -> float:
    """A sample of /metrics by name (and a label=value filter such as 'finished_reason="abort"')."""
    from prometheus_client.parser import text_string_to_metric_families

    key, _, value = labels.partition("=")
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and (not key or sample.labels.get(key) == value.strip('"')):
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_engine_process_serves_greedy_equal_to_target_only(pair, reference):
    server, client = serve(pair)
    with server:
        url = server.url
        assert client.process.pid != os.getpid() and client.process.is_alive()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # four at once: one batch in the engine process
            answers = list(pool.map(lambda p: complete(url, p).json(), PROMPTS))
            streams = list(pool.map(lambda p: streamed(url, p), PROMPTS))
        for ref, answer, (text, usage) in zip(reference, answers, streams):
            assert answer["choices"][0]["text"] == ref.text == text
            assert answer["usage"]["completion_tokens"] == len(ref.token_ids) == usage["completion_tokens"]
        # /metrics: the engine process's counters and histograms, current after the requests
        assert metric(url, "dscale_generation_tokens_total") == 2 * sum(len(r.token_ids) for r in reference)
        assert metric(url, "dscale_time_to_first_token_seconds_count") == 2 * len(PROMPTS)
        assert metric(url, "dscale_time_to_first_chunk_seconds_count") == len(PROMPTS)
        assert metric(url, "dscale_request_success_total", 'finished_reason="length"') == 2 * len(PROMPTS)
        assert metric(url, "dscale_decode_steps_total") > 0
        load = httpx.get(url + "/get_load").json()[0]
        assert load["num_reqs"] == 0 and load["num_tokens"] >= 0
        assert httpx.get(url + "/model_info").json()["architectures"] == ["Qwen3ForCausalLM"]
        # a client that leaves mid-stream: its request is aborted in the engine process
        body = {"prompt": PROMPTS[0], "max_tokens": LEN - 8, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            next(response.iter_lines())
        deadline = time.monotonic() + 30
        while metric(url, "dscale_request_success_total", 'finished_reason="abort"') < 1:
            assert time.monotonic() < deadline, "the abort did not reach the engine process"
            time.sleep(0.05)
        assert metric(url, "dscale_num_requests_running") == 0
    assert not client.process.is_alive(), "the engine process outlived the server"


@pytest.mark.parametrize("reader", ["loop", "thread"])
def test_a_dead_engine_process_fails_requests_fast_and_health_says_so(pair, reference, reader):
    """Whether the app's loop reads the pipe (the default) or a thread does (loops that cannot watch a pipe)."""
    server, client = serve(pair)
    client.read_on_loop = reader == "loop"
    with server:
        url = server.url
        readers = [t for t in threading.enumerate() if t.name == "dscale-engine-pipe"]
        assert (client._reader is None, len(readers)) == ((True, 0) if reader == "loop" else (False, 1))
        assert complete(url, PROMPTS[0]).json()["choices"][0]["text"] == reference[0].text
        os.kill(client.process.pid, signal.SIGKILL)
        client.process.join(30)
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health did not notice the dead engine process"
            time.sleep(0.05)
        started = time.monotonic()
        answer = complete(url, PROMPTS[1])
        assert answer.status_code == 503 and "engine process" in answer.json()["error"]["message"]
        assert time.monotonic() - started < 10
        assert httpx.get(url + "/metrics").status_code == 200  # the last snapshot


def test_an_engine_that_cannot_load_names_the_error(pair, tmp_path):
    bad = tmp_path / "predictor.pt"
    bad.write_bytes(b"not a predictor")
    config = ServeConfig(target=str(pair[0]), drafter=str(pair[1]), mode="dscale", predictor=str(bad), port=0,
                         max_model_len=LEN, log_level="critical", engine_process=True)
    client = EngineProcessClient(config)
    with pytest.raises(ValueError) as failure:
        client.start_process(load_tokenizer(pair[0]))
    assert str(failure.value)  # the child's exception, named (its type and message)
    client.process.join(30)
    assert not client.process.is_alive()
