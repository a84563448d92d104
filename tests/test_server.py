"""dscale-serve: the official openai client against the server, bad inputs, disconnects, a load test.

Oracles: `engine.generate` of a target-only engine that decodes one request at a time (greedy answers of a
lossless server equal it token for token), computed in the test, so nothing depends on the shipped weights.
Servers run in a thread of the test process (`BackgroundServer`), so tests can read the engine's cache.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from checkpoints import write_drafter, write_target
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import stdlib_prompts
from dscale_runtime.engine import Engine
from dscale_runtime.server.config import DEMO_DRAFTER, DEMO_PREDICTOR, DEMO_TARGET, ServeConfig
from dscale_runtime.server.detokenize import IncrementalDetokenizer, text_decoder
from dscale_runtime.server.flags import parse_config
from dscale_runtime.server.main import BackgroundServer

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")
TINY_LEN = 128
KEY = "sekret"


class GatedEngine(Engine):
    """An engine whose steps wait on `gate` and last at least `delay` seconds (queue and disconnect tests)."""

    gate: threading.Event
    delay: float = 0.0

    def step(self):
        self.gate.wait()
        time.sleep(self.delay)
        return super().step()


# ---------------------------------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def demo_reference():
    """Target-only greedy decoding, one request at a time: every greedy answer's oracle."""
    cfg = EngineConfig(mode="target", max_running_requests=1, max_model_len=1024)
    return Engine.from_pretrained(DEMO_TARGET, config=cfg)


@pytest.fixture(scope="module")
def demo_server():
    cfg = EngineConfig(mode="dscale", max_running_requests=8, max_model_len=1024)
    engine = Engine.from_pretrained(DEMO_TARGET, DEMO_DRAFTER, DEMO_PREDICTOR, config=cfg)
    with BackgroundServer(engine, ServeConfig(port=0, max_waiting_requests=256)) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    write_target(root / "target", tokenizer=True)
    write_drafter(root / "drafter")
    config_file = root / "target" / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": CHAT_TEMPLATE}))
    return root / "target", root / "drafter"


@pytest.fixture(scope="module")
def tiny_server(tiny_pair):
    """dflash on the tiny pair: one running + one waiting request at most, an API key, 4 KiB bodies."""
    cfg = EngineConfig(mode="dflash", max_running_requests=1, max_model_len=TINY_LEN)
    engine = GatedEngine.from_pretrained(tiny_pair[0], tiny_pair[1], config=cfg)
    engine.gate = threading.Event()
    engine.gate.set()
    config = ServeConfig(port=0, max_waiting_requests=1, api_key=KEY, max_request_bytes=4096,
                         served_model_name="tiny")
    with BackgroundServer(engine, config) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_reference(tiny_pair):
    return Engine.from_pretrained(tiny_pair[0], config=EngineConfig(mode="target", max_model_len=TINY_LEN))


def short_prompts(n: int) -> list[str]:
    prompts = [p["prompt"] for p in stdlib_prompts() if len(p["prompt"]) < 240]
    assert len(prompts) >= n
    return prompts[:n]


def client(server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def all_pages_free(engine) -> bool:
    return not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.num_pages - 1


# ---------------------------------------------------------------------------------------------- openai client
def test_openai_completions_equal_engine_generate(demo_server, demo_reference):
    prompts = short_prompts(3)
    want = demo_reference.generate(prompts, SamplingParams(temperature=0, max_tokens=24))
    api = client(demo_server)
    model = api.models.list().data[0].id
    card = api.models.retrieve(model)
    assert card.id == model == "target" and card.object == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        api.models.retrieve("gpt-4")
    for prompt, ref in zip(prompts, want):
        answer = api.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        assert answer.choices[0].text == ref.text
        assert answer.choices[0].finish_reason == ref.finish_reason
        assert answer.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert answer.usage.completion_tokens == len(ref.token_ids)
        assert answer.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)
        chunks = list(api.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
        assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stream_respects_stop_strings(demo_server, demo_reference):
    candidates = short_prompts(8)
    texts = [o.text for o in demo_reference.generate(candidates, SamplingParams(temperature=0, max_tokens=32))]
    prompt, full = next((p, t) for p, t in zip(candidates, texts) if len(t) >= 12)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want = demo_reference.generate([prompt], SamplingParams(temperature=0, max_tokens=32, stop=(stop,)))[0]
    assert want.finish_reason == "stop" and stop not in want.text
    api = client(demo_server)
    chunks = list(api.completions.create(model="target", prompt=prompt, max_tokens=32, temperature=0, stop=[stop],
                                         stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == want.text and chunks[-1].choices[0].finish_reason == "stop"
    assert not any("\ufffd" in t for t in texts)
    plain = api.completions.create(model="target", prompt=prompt, max_tokens=32, temperature=0, stop=stop)
    assert plain.choices[0].text == want.text


def test_chat_without_a_template_is_a_clear_400(demo_server):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(demo_server).chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}])


def test_openai_chat_with_a_template(tiny_server, tiny_reference):
    api = client(tiny_server, KEY)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    prompt = tiny_reference.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<system>be brief<user>def f(x):<assistant>"
    want = tiny_reference.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    answer = api.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert answer.choices[0].message.content == want.text
    assert answer.choices[0].finish_reason == want.finish_reason
    assert answer.usage.completion_tokens == len(want.token_ids)
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


# ---------------------------------------------------------------------------------------------- errors
# The table of bad inputs is in tests/test_server_hardening.py.
AUTH = {"Authorization": f"Bearer {KEY}"}


def assert_still_answers(server, reference, key: str = KEY, model: str = "tiny") -> None:
    want = reference.generate(["class A:"], SamplingParams(temperature=0, max_tokens=12))[0]
    again = client(server, key).completions.create(model=model, prompt="class A:", max_tokens=12, temperature=0)
    assert again.choices[0].text == want.text and again.usage.completion_tokens == len(want.token_ids)
    wait_until(lambda: all_pages_free(server.state.engine) and server.state.num_pending == 0)


def test_openai_client_sees_auth_and_chat_errors(tiny_server):
    with pytest.raises(openai.AuthenticationError):
        client(tiny_server, "nope").completions.create(model="tiny", prompt="x")
    with pytest.raises(openai.BadRequestError, match="messages.0.role"):
        client(tiny_server, KEY).chat.completions.create(model="tiny", messages=[{"role": "bot", "content": "x"}])


def test_queue_full_is_429_and_the_queued_requests_still_finish(tiny_server, tiny_reference):
    """The engine thread is held: one request is admitted, one waits, the third is refused."""
    engine, state = tiny_server.state.engine, tiny_server.state
    prompts = ["def f(x):", "class A:"]
    want = tiny_reference.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    answers = {}

    def post(body):
        return httpx.post(tiny_server.url + "/v1/completions", json=body, headers=AUTH, timeout=60)

    def send(i):
        answers[i] = post({"prompt": prompts[i], "max_tokens": 12, "temperature": 0, "model": "tiny"})

    engine.gate.clear()
    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: state.num_pending == 2)
        refused = post({"prompt": "x"})
        assert refused.status_code == 429 and "queue is full" in refused.json()["error"]["message"]
        assert refused.headers["retry-after"] == "1" and refused.json()["error"]["type"] == "rate_limit_error"
    finally:
        engine.gate.set()
    for t in threads:
        t.join(60)
    for i, ref in enumerate(want):
        assert answers[i].status_code == 200 and answers[i].json()["choices"][0]["text"] == ref.text
    assert_still_answers(tiny_server, tiny_reference)


def test_client_disconnect_aborts_the_request_and_frees_its_cache(tiny_server, tiny_reference):
    engine, state = tiny_server.state.engine, tiny_server.state
    aborted = state.worker.stats.finished["abort"]
    body = {"prompt": "def f(x):", "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    engine.delay = 0.1  # 100 tokens take at least 7 steps (seconds in practice): the abort comes first
    try:
        with httpx.Client(headers=AUTH, timeout=60) as http:
            with http.stream("POST", tiny_server.url + "/v1/completions", json=body) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        break
                assert engine.has_unfinished()
        wait_until(lambda: all_pages_free(engine), timeout=10)
        assert state.worker.stats.finished["abort"] == aborted + 1
        # A non-streaming client that gives up is aborted too.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(tiny_server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.5,
                       headers=AUTH)
        wait_until(lambda: all_pages_free(engine), timeout=10)
        assert state.worker.stats.finished["abort"] == aborted + 2
    finally:
        engine.delay = 0.0
    assert_still_answers(tiny_server, tiny_reference)


# ---------------------------------------------------------------------------------------------- load
def run_clients(url: str, jobs: list, one, clients: int, timeout: float) -> None:
    """`clients` concurrent HTTP clients (one connection each) take jobs off the list until it is empty:
    `await one(http, job)` per job."""

    async def worker(http: httpx.AsyncClient) -> None:
        while jobs:
            await one(http, jobs.pop(0))

    async def main() -> None:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
            await asyncio.gather(*(worker(http) for _ in range(clients)))

    asyncio.run(main())


def test_256_requests_from_64_clients_equal_sequential_greedy(demo_server, demo_reference):
    prompts = short_prompts(32)
    limits = [8 + 4 * (i % 2) for i in range(len(prompts))]  # NOTE: 2-4 steps each, enough to mix batches; CI's time
    want = demo_reference.generate(prompts, [SamplingParams(temperature=0, max_tokens=m) for m in limits])
    jobs = list(range(256))
    results: dict[int, tuple[int, str, str | None]] = {}

    async def one(http: httpx.AsyncClient, j: int) -> None:
        i = j % len(prompts)
        body = {"prompt": prompts[i], "max_tokens": limits[i], "temperature": 0, "stream": j % 2 == 1}
        if not body["stream"]:
            response = await http.post("/v1/completions", json=body)
            choice = response.json()["choices"][0] if response.status_code == 200 else {}
            results[j] = (response.status_code, choice.get("text"), choice.get("finish_reason"))
            return
        text, reason = [], None
        async with http.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["text"])
                    reason = choice["finish_reason"] or reason
        results[j] = (response.status_code, "".join(text), reason)

    run_clients(demo_server.url, jobs, one, clients=64, timeout=300)
    assert len(results) == 256
    for j, (status, text, reason) in sorted(results.items()):
        ref = want[j % len(prompts)]
        assert status == 200, f"request {j}: HTTP {status}"
        assert (text, reason) == (ref.text, ref.finish_reason), f"request {j} differs from its sequential answer"
    wait_until(lambda: all_pages_free(demo_server.state.engine))
    assert demo_server.state.num_pending == 0


# ---------------------------------------------------------------------------------------------- the rest
def test_models_health_and_metrics(demo_server):
    from prometheus_client.parser import text_string_to_metric_families

    assert httpx.get(demo_server.url + "/health").json() == {"status": "ok"}
    models = httpx.get(demo_server.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["target"] and models[0]["mode"] == "dscale"
    client(demo_server).completions.create(model="target", prompt="def add(a, b):", max_tokens=16, temperature=0)
    response = httpx.get(demo_server.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    values = {s.name: s.value for f in families.values() for s in f.samples if not s.labels.keys() - {"model_name"}}
    for name in ("dscale_requests_received_total", "dscale_generation_tokens_total", "dscale_num_requests_waiting",
                 "dscale_spec_accept_length", "dscale_retention", "dscale_step_seconds_sum",
                 "dscale_prompt_tokens_total", "dscale_num_requests_running", "dscale_request_steps_total",
                 "dscale_accepted_drafts_total", "dscale_kv_cache_usage_perc", "dscale_prefix_cache_queries_total",
                 "dscale_prefix_cache_hit_tokens_total", "dscale_prefix_cache_hit_rate"):
        assert name in values, name
    assert values["dscale_prefix_cache_queries_total"] >= 1 and 0 <= values["dscale_prefix_cache_hit_rate"] <= 1
    assert values["dscale_spec_accept_length"] > 1.0, "the demo pair accepts drafts"
    for name in ("dscale_time_to_first_token_seconds", "dscale_time_per_output_token_seconds",
                 "dscale_e2e_request_latency_seconds", "dscale_spec_accept_length_per_step",
                 "dscale_verify_rows_per_step"):
        assert families[name].type == "histogram", name
        assert values[name + "_count"] >= 1, name
    # Acceptance length per request-step: its mean is the counters' mean over the same steps.
    per_step = values["dscale_spec_accept_length_per_step_sum"] / values["dscale_spec_accept_length_per_step_count"]
    assert per_step == pytest.approx(1 + values["dscale_accepted_drafts_total"] / values["dscale_request_steps_total"])
    assert values["dscale_verify_rows_per_step_sum"] == values["dscale_verify_rows_total"]
    # The step each bucket runs: the engine's (EngineConfig defaults, no graphs on the CPU: DScale everywhere).
    # The predictor's watch (DScale steps ran): per position, what the engine's calibration reports.
    report = demo_server.state.engine.calibration.report()
    watched = {(f.name, s.labels["position"]): s.value for f in families.values() for s in f.samples
               if "position" in s.labels}
    for name, key, positions in (("dscale_predictor_predicted_acceptance", "predicted", 15),
                                 ("dscale_predictor_realised_acceptance", "realised", 15),
                                 ("dscale_predictor_raw_predicted_acceptance", "predicted_raw", 15),
                                 ("dscale_predictor_calibration_error", "error", 3),
                                 ("dscale_predictor_raw_calibration_error", "error_raw", 3)):
        got = [watched[name, str(j)] for j in range(1, positions + 1)]
        assert got == pytest.approx(report[key], nan_ok=True), name
    assert report["weight"][0] > 0 and 0 < watched["dscale_predictor_predicted_acceptance", "1"] <= 1
    runs = {s.labels["bucket"]: s.labels["step"] for s in families["dscale_step_policy"].samples}
    assert runs == {"1": "dscale", "2": "dscale", "4": "dscale", "8": "dscale"}


def test_serve_live_choice_reads_the_live_choice_off_metrics(demo_server):
    """benchmarks/serve_live_choice.py's scrape: every sample of the families behind the live step choice on a
    server's /metrics (as the Prometheus parser reads them), keyed by its labels less the model's; nothing else."""
    import importlib.util

    from prometheus_client.parser import text_string_to_metric_families

    path = Path(__file__).parents[1] / "benchmarks" / "serve_live_choice.py"
    spec = importlib.util.spec_from_file_location("serve_live_choice", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    client(demo_server).completions.create(model="target", prompt="def add(a, b):", max_tokens=16, temperature=0)
    wall = demo_server.state.engine.wall_ms  # NOTE: measured with captured CUDA steps only: one entry as they set it
    wall[1, "dflash"] = 0.64
    try:
        text = httpx.get(demo_server.url + "/metrics").text
    finally:
        del wall[1, "dflash"]
    expected = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(module.WATCHED) and not s.name.startswith("dscale_step_policy_ms"):
                labels = ",".join(f'{k}="{v}"' for k, v in s.labels.items() if k != "model_name")
                expected[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    got = module.parse_metrics(text)
    assert got == expected
    assert not any("model_name" in k or k.startswith(("dscale_step_policy_ms", "dscale_requests")) for k in got)
    assert {k for k in got if k.startswith("dscale_step_policy{")} == {
        f'dscale_step_policy{{bucket="{b}",step="dscale"}}' for b in (1, 2, 4, 8)}
    assert any(k.startswith("dscale_decode_steps_by_step") for k in got)
    assert got['dscale_live_wall_ms{bucket="1",step="dflash"}'] == 0.64


def test_detokenizer_never_splits_a_character_and_holds_back_stop_prefixes(demo_reference):
    tokenizer = demo_reference.tokenizer
    text = "def grüße():\n    return '日本語 ✓ 🙂' # ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add([t]) for t in ids]
    assert not any("\ufffd" in d for d in deltas) and "".join(deltas) == text
    assert any(len(tokenizer.decode([t])) and "\ufffd" in tokenizer.decode([t]) for t in ids), \
        "the text must split characters across tokens for this test to mean anything"
    stop = "🙂' #"
    cut = text[: text.index(stop)]
    detok, sent = IncrementalDetokenizer(tokenizer, stop=(stop,)), ""
    for n, t in enumerate(ids, 1):  # the engine stops once the decoded text holds the stop string
        sent += detok.add([t])
        assert cut.startswith(sent), "nothing of the stop string is ever sent"
        if stop in tokenizer.decode(ids[:n]):
            break
    assert sent + detok.finish(cut) == cut
    detok, held = IncrementalDetokenizer(tokenizer, stop=("return 'X",)), []
    for t in ids:  # a stop prefix is held back until the text shows the stop string does not follow
        detok.add([t])
        held.append(detok.text[detok.num_emitted :])
    assert "return '" in held and held[-1] == "" and detok.text == text

def test_streams_decode_through_the_rust_tokenizer_only_where_the_text_is_the_same(demo_reference):
    """`text_decoder`: the demo's fast tokenizer is decoded by the Rust library directly (the transformers method is
    never called) to exactly what `tokenizer.decode(ids, skip_special_tokens=True)` gives, special tokens, split
    characters and windows included; an overridden decode or space clean-up keeps the method."""
    import copy

    tokenizer = demo_reference.tokenizer
    text = "def grüße():\n    return '日本語 ✓ 🙂' # ok<|im_end|>\n<|im_start|>user ,  x !"
    ids = tokenizer.encode(text, add_special_tokens=False) + [t for t in tokenizer.all_special_ids[:3]]
    oracle = {(a, b): tokenizer.decode(ids[a:b], skip_special_tokens=True)
              for a in range(len(ids)) for b in range(a, len(ids) + 1)}
    fast = copy.copy(tokenizer)
    fast.decode = None  # NOTE: the direct path never calls the method
    decode = text_decoder(fast)
    assert {(a, b): decode(ids[a:b]) for a, b in oracle} == oracle
    assert any("\ufffd" in t for t in oracle.values()) and any(t != "" for t in oracle.values())
    cleaned = copy.copy(tokenizer)
    cleaned.clean_up_tokenization_spaces = True
    cleaned.decode = lambda token_ids, **kwargs: "method"
    assert text_decoder(cleaned)(ids) == "method"

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    assert text_decoder(shouting)(ids) == oracle[0, len(ids)].upper()


def test_cli_flags():
    cfg = parse_config(ServeConfig, "dscale-serve", ["--mode", "dflash", "--max-running-requests", "4",
                                                     "--api-key", "k", "--budget-ratio", "0.25",
                                                     "--measure-retention", "--trust-request-chat-template",
                                                     "--enable-docs", "--template-timeout", "0.5",
                                                     "--header-timeout", "3", "--timeout-keep-alive", "2"])
    assert (cfg.mode, cfg.max_running_requests, cfg.api_key, cfg.budget_ratio, cfg.measure_retention) == (
        "dflash", 4, "k", 0.25, True)
    assert (cfg.trust_request_chat_template, cfg.enable_docs, cfg.template_timeout, cfg.header_timeout,
            cfg.timeout_keep_alive) == (True, True, 0.5, 3.0, 2)
    defaults = parse_config(ServeConfig, "dscale-serve", [])
    assert not defaults.trust_request_chat_template and not defaults.enable_docs
    assert defaults.switch_interval_ms == 1.0
    assert defaults.engine_process  # the engine in a process of its own unless `--engine-process false`
    assert not parse_config(ServeConfig, "dscale-serve", ["--engine-process", "false"]).engine_process
    for bad in (["--template-timeout", "0"], ["--api-key", ""], ["--header-timeout", "nan"],
                ["--switch-interval-ms", "0"], ["--loop", "trio"], ["--http", "h2"], ["--max-header-bytes", "10"]):
        with pytest.raises(SystemExit):
            parse_config(ServeConfig, "dscale-serve", bad)
    stack = parse_config(ServeConfig, "dscale-serve", ["--loop", "asyncio", "--http", "h11"])
    assert (stack.loop, stack.http, defaults.loop, defaults.http) == ("asyncio", "h11", "auto", "auto")
    assert cfg.predictor_path is None and cfg.drafter_path == DEMO_DRAFTER
    assert parse_config(ServeConfig, "dscale-serve", []).predictor_path == DEMO_PREDICTOR
    with pytest.raises(SystemExit):
        parse_config(ServeConfig, "dscale-serve", ["--mode", "fast"])


def test_loop_and_http_choices_and_a_missing_one_named_before_loading(monkeypatch):
    """--loop / --http auto take uvloop / httptools where installed, else asyncio / h11; naming one that is not
    installed stops dscale-serve with the package to install before any model loads."""
    from dscale_runtime.server import main as serve_main

    monkeypatch.setattr(serve_main, "load_engine", lambda config: pytest.fail("loaded before checking --loop"))
    for installed in (True, False):
        monkeypatch.setattr(serve_main, "_installed", lambda module, installed=installed: installed)
        assert serve_main.event_loop("auto") == ("uvloop" if installed and sys.platform != "win32" else "asyncio")
        assert serve_main.http_parser("auto") == ("httptools" if installed else "h11")
        assert (serve_main.event_loop("asyncio"), serve_main.http_parser("h11")) == ("asyncio", "h11")
    for flag, package in (("--loop", "uvloop"), ("--http", "httptools")):
        with pytest.raises(SystemExit, match=f"pip install {package}"):
            serve_main.main([flag, package])


def test_accept_length_histogram_filled_per_step_reads_as_prometheus_clients_own():
    """The accept-length histogram takes a step's accepted counts in one call; its exposition equals a
    prometheus_client Histogram observing every value (accepted + 1) with one bucket per value, after every step."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dscale_runtime.server.metrics import AcceptLengthHistogram

    def samples(registry) -> list:
        text = generate_latest(registry).decode()
        return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples
                if not s.name.endswith("_created")]

    name, doc, block = "dscale_spec_accept_length_per_step", "Tokens per request-step.", 16
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    bulk = AcceptLengthHistogram(name, doc, block, 'm "1"')
    ours.register(bulk)
    oracle = Histogram(name, doc, ["model_name"], registry=theirs,
                       buckets=[float(k) for k in range(1, block + 1)]).labels('m "1"')
    assert samples(ours) == samples(theirs)  # empty
    rng = random.Random(0)
    for step in range(40):
        accepted = [rng.choice([0, 0, 1, 2, 3, block - 1]) for _ in range(rng.randint(0, 32))]
        bulk.add(accepted)
        for a in accepted:
            oracle.observe(a + 1)
        assert samples(ours) == samples(theirs), step


def test_engine_thread_events_reach_each_request_in_order_with_one_wake_up():
    """The engine thread's Outbox: each request's events in the order they were put, one loop call per flush
    (however many requests) and none while the loop has not yet run the last one (its events join it), and one
    request's failing `on_done` costs no other request its events; a closed loop takes nothing."""
    from dscale_runtime.server.worker import Aborted, Delta, Outbox, Submission, _inbox

    loop = asyncio.new_event_loop()
    try:
        def boom():
            raise RuntimeError("on_done failed")

        subs = [Submission(f"r{i}", [1], SamplingParams(max_tokens=4), True, asyncio.Queue(), loop,
                           boom if i == 0 else None) for i in range(3)]
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (calls.append(a), real(*a))[1]
        box = Outbox()
        for k in range(3):
            for sub in subs:
                box.put(sub, Delta(f"{sub.request_id}-{k}", k + 1))
        box.put(subs[0], Aborted())  # terminal: its on_done raises
        thread = threading.Thread(target=box.flush)
        thread.start()
        thread.join()
        box.flush()  # nothing left: no call
        box.put(subs[1], Delta("r1-last", 4))
        box.put(subs[2], Delta("r2-last", 4))
        box.flush()  # the loop has not run the first hand-over: these join it
        assert len(calls) == 1
        loop.run_until_complete(asyncio.sleep(0))
        assert len(calls) == 1
        got = {sub.request_id: [] for sub in subs}

        def take():
            for sub in subs:
                while not sub.events.empty():
                    event = sub.events.get_nowait()
                    got[sub.request_id].append(event.text if isinstance(event, Delta) else type(event).__name__)

        take()
        assert got == {"r0": ["r0-0", "r0-1", "r0-2", "Aborted"], "r1": ["r1-0", "r1-1", "r1-2", "r1-last"],
                       "r2": ["r2-0", "r2-1", "r2-2", "r2-last"]}
        box.put(subs[2], Delta("r2-after", 5))
        box.flush()  # the loop ran everything: a new wake-up
        assert len(calls) == 2
        loop.run_until_complete(asyncio.sleep(0))
        take()
        assert got["r2"][-1] == "r2-after"
    finally:
        loop.close()
    box.put(subs[1], Delta("late", 6))
    box.flush()  # a closed loop: dropped, not kept
    assert len(calls) == 2 and _inbox(loop).events == [] and subs[1].events.empty()


def test_engine_options_from_flags():
    """Step graphs default on with a CUDA device only; --draft-dtype reaches the engine."""
    from dscale_runtime.server.main import load_engine

    class Recorder:
        @staticmethod
        def from_pretrained(target, drafter, predictor, config):
            return config

    def engine_config(*flags):
        return load_engine(parse_config(ServeConfig, "dscale-serve", ["--mode", "dflash", *flags]), Recorder)

    assert engine_config().step_graphs is False and engine_config().draft_dtype is None
    assert engine_config("--device", "cuda").step_graphs is True
    assert engine_config("--device", "cuda:1", "--step-graphs", "false").step_graphs is False
    assert engine_config("--step-graphs").step_graphs is True
    assert engine_config("--draft-dtype", "bfloat16").draft_dtype == "bfloat16"
    assert engine_config().sampling_rule == "auto" and engine_config("--sampling-rule", "top1").sampling_rule == "top1"
