"""dscale-serve under hostile input (issue 16): a table of bad requests, poisoned load, hostile templates,
faults in the engine thread, auth on every route, /metrics escaping, SGLang's meta_info through z-lab's client.

Oracles: `engine.generate` of a target-only engine decoding one request at a time (test_server.py), and for
templates transformers' own `apply_chat_template`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
import time

import httpx
import pytest

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import stdlib_prompts
from dscale_runtime.engine import Engine
from dscale_runtime.server.app import new_request_id
from dscale_runtime.server.config import DEMO_DRAFTER, DEMO_TARGET, ServeConfig
from dscale_runtime.server.main import BackgroundServer
from dscale_runtime.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS
from dscale_runtime.server.templates import PromptBuilder
from test_server import CHAT_TEMPLATE, KEY, TINY_LEN, assert_still_answers, tiny_pair, tiny_reference  # noqa: F401 (fixtures)
from test_server import all_pages_free, run_clients, wait_until

AUTH = {"Authorization": f"Bearer {KEY}"}
VOCAB = 96  # tests/checkpoints.py write_target's default
SLOW_TEMPLATE = ("{% set ns = namespace(n=0) %}{% for i in range(10000) %}{% for j in range(10000) %}"
                 "{% for k in range(10000) %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{% endfor %}{{ ns.n }}")
"""10^12 loop iterations and no output until the end: only the budget checks inside the sandbox stop it."""
HUGE_TEMPLATE = "{{ 'x' * 6000000 }}"
"""One expression expanding to 6M characters (the issue's 6M-token prompt)."""
LOOP_OUTPUT_TEMPLATE = "{% for i in range(100000) %}{% for m in messages %}{{ m['content'] }}{% endfor %}{% endfor %}"
"""Output piece by piece past any size limit."""
NAME = 'tiny "q" \\ back\nslash'
"""A served model name every metric line must escape."""


@pytest.fixture(scope="module")
def server(tiny_pair):
    """The model's own template only, an API key, dflash on the tiny pair."""
    cfg = EngineConfig(mode="dflash", max_running_requests=8, max_model_len=TINY_LEN)
    engine = Engine.from_pretrained(tiny_pair[0], tiny_pair[1], config=cfg)
    with BackgroundServer(engine, ServeConfig(port=0, api_key=KEY, served_model_name="tiny",
                                              max_waiting_requests=512)) as s:
        yield s


@pytest.fixture(scope="module")
def trusting_server(tiny_pair):
    """--trust-request-chat-template with short template limits, a served name that needs escaping, no key."""
    cfg = EngineConfig(mode="dflash", max_running_requests=8, max_model_len=TINY_LEN)
    engine = Engine.from_pretrained(tiny_pair[0], tiny_pair[1], config=cfg)
    config = ServeConfig(port=0, served_model_name=NAME, trust_request_chat_template=True, template_timeout=0.5,
                         max_prompt_chars=20_000, max_waiting_requests=512)
    with BackgroundServer(engine, config) as s:
        yield s


def short_prompts(n: int) -> list[str]:
    """Prompts of the tiny byte tokenizer's alphabet (printable ASCII)."""
    return [f"def f{i}(x):" if i % 3 else f"class C{i}:" for i in range(n)]


# ---------------------------------------------------------------------------------------------- the table
C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
CASES: dict[str, tuple] = {  # name: (path, body: dict | bytes, status, words the message holds, field named)
    # D1: a top_k that overflowed inside the engine step
    "top_k 2^63": (C, {"prompt": "x", "temperature": 1, "top_k": 9223372036854775808}, 400, "vocabulary size 96",
                   "top_k"),
    "top_k vocab + 1": (C, {"prompt": "x", "top_k": VOCAB + 1}, 400, "vocabulary size", "top_k"),
    "top_k -2": (C, {"prompt": "x", "top_k": -2}, 400, "greater than or equal to -1", "top_k"),
    "top_k float": (C, {"prompt": "x", "top_k": 4.0}, 400, "valid integer", "top_k"),
    # D2: templates and tokenizer options from the client
    "template in kwargs": (CHAT, {"messages": MSG, "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}}, 400,
                           "--trust-request-chat-template", "chat_template_kwargs.chat_template"),
    "template field": (CHAT, {"messages": MSG, "chat_template": HUGE_TEMPLATE}, 400, "--trust-request-chat-template",
                       "chat_template"),
    "kwargs tokenize": (CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400,
                        "tokenizer option", "chat_template_kwargs.tokenize"),
    "kwargs tokenizer_kwargs": (CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenizer_kwargs": {}}}, 400,
                                "tokenizer option", "chat_template_kwargs.tokenizer_kwargs"),
    "kwargs continue_final_message": (CHAT, {"messages": MSG, "chat_template_kwargs": {
        "continue_final_message": True}}, 400, "tokenizer option", "chat_template_kwargs.continue_final_message"),
    "kwargs messages": (CHAT, {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400,
                        "sets 'messages' itself", "chat_template_kwargs.messages"),
    "kwargs add_generation_prompt": (CHAT, {"messages": MSG, "chat_template_kwargs": {
        "add_generation_prompt": False}}, 400, "sets 'add_generation_prompt'", "chat_template_kwargs.add_generation_prompt"),
    "kwargs bad name": (CHAT, {"messages": MSG, "chat_template_kwargs": {"a-b": 1}}, 400, "identifiers",
                        "chat_template_kwargs.a-b"),
    "kwargs dunder name": (CHAT, {"messages": MSG, "chat_template_kwargs": {"__class__": 1}}, 400, "identifiers",
                           "chat_template_kwargs.__class__"),
    "kwargs not an object": (CHAT, {"messages": MSG, "chat_template_kwargs": [1]}, 400,
                             "invalid field 'chat_template_kwargs'", "chat_template_kwargs"),
    # D3, D4: bodies Python's json module chokes on
    "nested 1000 deep": (C, b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "deeper than 32 levels", None),
    "nested 40 deep": (C, b'{"prompt": "x", "metadata": ' + b"[" * 40 + b"]" * 40 + b"}", 400,
                       "deeper than 32 levels", None),
    "5000-digit integer": (C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, "integer of 5000 digits",
                           None),
    "21-digit negative integer": (C, b'{"prompt": "x", "seed": -' + b"1" * 21 + b"}", 400, "integer of 21 digits",
                                  None),
    "lone surrogate in prompt": (C, b'{"prompt": "ab\\ud800cd"}', 400, "lone surrogate", "prompt"),
    "lone surrogate in chat": (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
                               "lone surrogate", "messages.0.content"),
    "lone surrogate in a stop string": (C, b'{"prompt": "x", "stop": ["a", "\\ud83d"]}', 400, "lone surrogate",
                                        "stop.1"),
    "lone surrogate in a key": (C, b'{"prompt": "x", "metadata": {"\\ud800": "v"}}', 400, "a key of 'metadata'",
                                "metadata"),
    "bad UTF-8": (C, b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8", None),
    "truncated UTF-8": (C, b'{"prompt": "\xe6\x97"}', 400, "not valid UTF-8", None),
    "invalid JSON": (C, b'{"prompt": "x",', 400, "not valid JSON", None),
    "empty body": (C, b"", 400, "not valid JSON", None),
    "trailing garbage": (C, b'{"prompt": "x"} {}', 400, "not valid JSON", None),
    "body not an object": (C, b"[1, 2]", 400, "must be a JSON object", None),
    "body a string": (C, b'"prompt"', 400, "must be a JSON object", None),
    # D7-D10: numbers and types
    "seed 2^64": (C, {"prompt": "x", "seed": 1 << 64}, 400, "less than 18446744073709551616", "seed"),
    "seed -1": (C, {"prompt": "x", "seed": -1}, 400, "greater than or equal to 0", "seed"),
    "seed string": (C, {"prompt": "x", "seed": "7"}, 400, "valid integer", "seed"),
    "max_tokens numeric string": (C, {"prompt": "x", "max_tokens": "4"}, 400, "invalid field 'max_tokens'",
                                  "max_tokens"),
    "max_tokens float": (C, {"prompt": "x", "max_tokens": 4.5}, 400, "valid integer", "max_tokens"),
    "max_tokens bool": (C, {"prompt": "x", "max_tokens": True}, 400, "valid integer", "max_tokens"),
    "max_tokens 0": (C, {"prompt": "x", "max_tokens": 0}, 400, "invalid field 'max_tokens'", "max_tokens"),
    "max_tokens at the context": (C, {"prompt": "x", "max_tokens": TINY_LEN}, 400, "must be below it",
                                  "max_tokens"),
    "temperature Infinity": (C, b'{"prompt": "x", "temperature": Infinity}', 400, "finite number", "temperature"),
    "temperature NaN": (C, b'{"prompt": "x", "temperature": NaN}', 400, "finite number", "temperature"),
    "temperature 1e999": (C, b'{"prompt": "x", "temperature": 1e999}', 400, "finite number", "temperature"),
    "temperature -1": (C, {"prompt": "x", "temperature": -1}, 400, "greater than or equal to 0", "temperature"),
    "temperature string": (C, {"prompt": "x", "temperature": "0.5"}, 400, "valid number", "temperature"),
    "top_p 0": (C, {"prompt": "x", "top_p": 0}, 400, "greater than 0", "top_p"),
    "top_p 1.5": (C, {"prompt": "x", "top_p": 1.5}, 400, "less than or equal to 1", "top_p"),
    "stream string": (C, {"prompt": "x", "stream": "true"}, 400, "valid boolean", "stream"),
    "ignore_eos 1": (C, {"prompt": "x", "ignore_eos": 1}, 400, "valid boolean", "ignore_eos"),
    "include_usage string": (C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
                             "valid boolean", "stream_options.include_usage"),
    "stop_token_ids -1": (C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "must lie in [0, 96)", "stop_token_ids"),
    "stop_token_ids vocab": (C, {"prompt": "x", "stop_token_ids": [VOCAB]}, 400, "must lie in [0, 96)",
                             "stop_token_ids"),
    "stop_token_ids too many": (C, {"prompt": "x", "stop_token_ids": [1] * 257}, 400, "at most 256 ids",
                                "stop_token_ids"),
    "stop_token_ids strings": (C, {"prompt": "x", "stop_token_ids": ["1"]}, 400, "valid integer",
                               "stop_token_ids.0"),
    "prompt token id -1": (C, {"prompt": [5, -1]}, 400, "must lie in [0, 96)", "prompt"),
    "prompt token id vocab": (C, {"prompt": [VOCAB]}, 400, "must lie in [0, 96)", "prompt"),
    "prompt token ids bools": (C, {"prompt": [True, False]}, 400, "string or a list of token ids", "prompt"),
    # D11: stop strings that would slow every request
    "60000 stop strings": (C, {"prompt": "x", "stop": ["ab"] * 60000}, 400,
                           f"at most {MAX_STOP_STRINGS} stop strings, got 60000", "stop"),
    "stop string too long": (C, {"prompt": "x", "stop": "y" * (MAX_STOP_CHARS + 1)}, 400,
                             f"at most {MAX_STOP_CHARS} characters", "stop"),
    "empty stop string": (C, {"prompt": "x", "stop": ["a", ""]}, 400, "must not be empty", "stop"),
    "stop not a string": (C, {"prompt": "x", "stop": [1]}, 400, "valid string", "stop.0"),
    # prompts and context
    "missing prompt": (C, {"max_tokens": 4}, 400, "missing field 'prompt'", "prompt"),
    "empty prompt": (C, {"prompt": ""}, 400, "the prompt is empty", "prompt"),
    "empty token list": (C, {"prompt": []}, 400, "the prompt is empty", "prompt"),
    "several prompts": (C, {"prompt": ["a", "b"]}, 400, "one prompt per request", "prompt"),
    "prompt a number": (C, {"prompt": 5}, 400, "string or a list of token ids", "prompt"),
    "prompt over the context": (C, {"prompt": "x" * (TINY_LEN + 5)}, 400, f"context limit is {TINY_LEN} tokens",
                                "prompt"),
    "prompt + max_tokens over the context": (C, {"prompt": "x" * 100, "max_tokens": 60}, 400,
                                             f"lower max_tokens to at most {TINY_LEN - 100}", "max_tokens"),
    # options this server does not implement
    "unknown field": (C, {"prompt": "x", "best_temperature": 1}, 400, "unknown field", "best_temperature"),
    "n 2": (C, {"prompt": "x", "n": 2}, 400, "n=2 is not supported", "n"),
    "logprobs": (C, {"prompt": "x", "logprobs": 2}, 400, "logprobs is not supported", "logprobs"),
    "echo": (C, {"prompt": "x", "echo": True}, 400, "echo=true", "echo"),
    "best_of": (C, {"prompt": "x", "best_of": 3}, 400, "best_of=3", "best_of"),
    "suffix": (C, {"prompt": "x", "suffix": "y"}, 400, "suffix is not supported", "suffix"),
    "presence_penalty": (C, {"prompt": "x", "presence_penalty": 0.5}, 400, "leave it at 0", "presence_penalty"),
    "frequency_penalty out of range": (C, {"prompt": "x", "frequency_penalty": 3}, 400, "less than or equal to 2",
                                       "frequency_penalty"),
    "logit_bias": (C, {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias is not supported", "logit_bias"),
    "stream_options without stream": (C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
                                      "only allowed with stream=true", "stream_options"),
    "return_meta_info with stream": (C, {"prompt": "x", "stream": True, "return_meta_info": True}, 400,
                                     "only supported with stream=false", "return_meta_info"),
    "return_meta_info string": (C, {"prompt": "x", "return_meta_info": "yes"}, 400, "valid boolean",
                                "return_meta_info"),
    # D5's no-op OpenAI fields, bounded
    "metadata 17 keys": (C, {"prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400,
                         "invalid field 'metadata'", "metadata"),
    "metadata long value": (C, {"prompt": "x", "metadata": {"k": "v" * 513}}, 400, "values at most 512",
                            "metadata"),
    "metadata number value": (C, {"prompt": "x", "metadata": {"k": 1}}, 400, "valid string", "metadata.k"),
    "user too long": (C, {"prompt": "x", "user": "u" * 257}, 400, "at most 256 characters", "user"),
    "store string": (C, {"prompt": "x", "store": "no"}, 400, "valid boolean", "store"),
    # chat
    "no messages": (CHAT, {"messages": []}, 400, "invalid field 'messages'", "messages"),
    "messages not a list": (CHAT, {"messages": "hi"}, 400, "invalid field 'messages'", "messages"),
    "unknown role": (CHAT, {"messages": [{"role": "bot", "content": "x"}]}, 400, "invalid field", "messages.0.role"),
    "image part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}, 400,
                   "invalid field", "messages.0.content.0.type"),
    "chat logprobs": (CHAT, {"messages": MSG, "logprobs": True}, 400, "logprobs is not supported", "logprobs"),
    "chat n 3": (CHAT, {"messages": MSG, "n": 3}, 400, "n=3 is not supported", "n"),
    "tools": (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
              "no tool calling", "tools"),
    "tool_choice": (CHAT, {"messages": MSG, "tool_choice": "auto"}, 400, "no tool calling", "tool_choice"),
    "response_format": (CHAT, {"messages": MSG, "response_format": {"type": "json_object"}}, 400,
                        "response_format is not supported", "response_format"),
    "max_completion_tokens 0": (CHAT, {"messages": MSG, "max_completion_tokens": 0}, 400,
                                "invalid field 'max_completion_tokens'", "max_completion_tokens"),
    "max_completion_tokens at the context": (CHAT, {"messages": MSG, "max_completion_tokens": 500}, 400,
                                             "must be below it", "max_completion_tokens"),
    "chat prompt over the context": (CHAT, {"messages": [{"role": "user", "content": "y" * 200}]}, 400,
                                     f"context limit is {TINY_LEN} tokens", "prompt"),
    # model, auth, size, routes
    "unknown model": (C, {"prompt": "x", "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model"),
    "model name too long": (C, {"prompt": "x", "model": "m" * 300}, 400, "at most 256 characters", "model"),
    "body too large": (C, {"prompt": "x" * (1 << 20)}, 413, "limit of 1048576 bytes", None),
}
GET_CASES: dict[str, tuple] = {  # name: (path, headers, status, words, field)
    "route without key": (C, {}, 401, "missing API key", None),  # the key is checked before the route
    "metrics without key": ("/metrics", {}, 401, "missing API key", None),
    "models without key": ("/v1/models", {}, 401, "missing API key", None),
    "docs without key": ("/docs", {}, 401, "missing API key", None),
    "redoc without key": ("/redoc", {}, 401, "missing API key", None),
    "openapi without key": ("/openapi.json", {}, 401, "missing API key", None),
    "wrong key": ("/v1/models", {"Authorization": "Bearer nope"}, 401, "wrong API key", None),
    "basic auth": ("/v1/models", {"Authorization": f"Basic {KEY}"}, 401, "wrong API key", None),
    "docs off": ("/docs", AUTH, 404, "no route GET /docs", None),
    "openapi off": ("/openapi.json", AUTH, 404, "no route GET /openapi.json", None),
    "unknown route": ("/v2/things", AUTH, 404, "no route GET /v2/things", None),
    "unknown model card": ("/v1/models/gpt-4", AUTH, 404, "'gpt-4' does not exist", "model"),
    "GET a POST route": (CHAT, AUTH, 405, "allowed: POST", None),
}


def http_errors(server, status: int) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=30).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "dscale_http_errors")
    return sum(s.value for s in family.samples if s.labels["status"] == str(status))


def check_error(response: httpx.Response, status: int, words: str, field: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert words in error["message"], error["message"]
    assert error["param"] == field
    assert re.fullmatch("[0-9a-f]{32}", response.headers["x-request-id"])


def test_request_ids_are_32_hex_digits_and_do_not_repeat():
    ids = [new_request_id() for _ in range(20000)]
    assert len(set(ids)) == len(ids) and all(re.fullmatch("[0-9a-f]{32}", i) for i in ids)
    if not hasattr(os, "fork"):
        return
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # NOTE: a forked process (a replica, a worker) draws ids of its own, not its parent's next ones
        try:
            os.write(write, new_request_id().encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    theirs = os.read(read, 64).decode()
    os.close(read)
    assert re.fullmatch("[0-9a-f]{32}", theirs) and theirs != new_request_id()


def test_the_table_has_every_case_of_the_issue():
    assert len(CASES) + len(GET_CASES) >= 60


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_gets_a_clear_error_and_the_server_keeps_answering(server, tiny_reference, case):
    path, body, status, words, field = CASES[case]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = http_errors(server, status)
    response = httpx.post(server.url + path, content=raw, timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
    check_error(response, status, words, field)
    assert http_errors(server, status) == before + 1
    assert_still_answers(server, tiny_reference)


@pytest.mark.parametrize("case", list(GET_CASES))
def test_bad_route_or_key_gets_an_openai_error(server, tiny_reference, case):
    path, headers, status, words, field = GET_CASES[case]
    response = httpx.get(server.url + path, headers=headers, timeout=30)
    check_error(response, status, words, field)
    assert_still_answers(server, tiny_reference)


def test_health_needs_no_key_and_docs_can_be_turned_on(server, tiny_pair):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    cfg = EngineConfig(mode="target", max_model_len=TINY_LEN)
    engine = Engine.from_pretrained(tiny_pair[0], config=cfg)
    with BackgroundServer(engine, ServeConfig(port=0, api_key=KEY, enable_docs=True)) as docs:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert httpx.get(docs.url + path).status_code == 401, path
            assert httpx.get(docs.url + path, headers=AUTH).status_code == 200, path


def test_noop_openai_fields_are_accepted(server, tiny_reference):
    want = tiny_reference.generate(["class A:"], SamplingParams(temperature=0, max_tokens=10))[0]
    body = {"prompt": "class A:", "max_tokens": 10, "temperature": 0, "user": "u-1", "store": False,
            "metadata": {"team": "eval", "run": "7"}}
    answer = httpx.post(server.url + C, json=body, headers=AUTH, timeout=60).json()
    assert answer["choices"][0]["text"] == want.text and "meta_info" not in answer


# ---------------------------------------------------------------------------------------------- templates
def test_bounded_rendering_equals_apply_chat_template(tiny_reference):
    tokenizer = tiny_reference.tokenizer
    template = CHAT_TEMPLATE + "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    builder = PromptBuilder(tokenizer, timeout=1.0, max_chars=10_000)
    for variables in ({}, {"enable_thinking": False}):
        want = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=True, **variables)
        assert want.startswith("<system>be brief<user>def f(x):<assistant>")
        got = asyncio.run(builder.chat_token_ids(messages, template, variables))
        assert got == tokenizer.encode(want, add_special_tokens=False)
    builder.close()


HOSTILE = {  # template: words of the error
    SLOW_TEMPLATE: "took longer than 0.5 s",
    HUGE_TEMPLATE: "exceeds 20000 characters",
    LOOP_OUTPUT_TEMPLATE: "exceeds 20000 characters",
    "{{ 'ab' | center(900000000) }}": "exceeds 20000 characters",
    "{{ 'x'.ljust(900000000) }}": "exceeds 20000 characters",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}":
        "exceeds 20000 characters",
    "{{ 7 ** 99999999 }}": "exceeds 20000 characters",
    "{{ raise_exception('roles must alternate') }}": "roles must alternate",
    "{% for %}": "could not render",
}


@pytest.mark.parametrize("template", list(HOSTILE))
def test_hostile_request_templates_are_bounded_and_health_stays_fast(trusting_server, tiny_reference, template):
    """With --trust-request-chat-template a template runs, within its time and size budget, off the loop."""
    result = {}

    def send():
        body = {"messages": MSG, "chat_template": template, "max_tokens": 4}
        result["response"] = httpx.post(trusting_server.url + CHAT, json=body, timeout=60)

    thread = threading.Thread(target=send)
    start = time.perf_counter()
    thread.start()
    health = []
    while thread.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(trusting_server.url + "/health", timeout=5).status_code == 200
        health.append(time.perf_counter() - t0)
        time.sleep(0.02)
    thread.join()
    assert time.perf_counter() - start < 5.0
    check_error(result["response"], 400, HOSTILE[template], "messages")
    # NOTE: a loop blocked by the render makes the checks wait out the render (up to its 0.5 s budget), most of them
    # or the only one; a loaded 2-core machine (server, client and render threads in one process under the GIL)
    # makes single checks slow too (0.55 s seen once in CI), so the median must stay short and no check may take
    # longer than the whole budget and then some
    median = sorted(health)[len(health) // 2]
    assert median < 0.25 and max(health) < 1.0, f"health checks waited {median:.2f} s (median), " \
        f"{max(health):.2f} s (max) on the template"
    assert_still_answers(trusting_server, tiny_reference, key="unused", model=NAME)


def test_trusted_request_template_and_template_variables(trusting_server, tiny_reference):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if flavour %}{{ flavour }}{% endif %}"
    prompt = tiny_reference.tokenizer.apply_chat_template(MSG, chat_template=template, tokenize=False,
                                                          add_generation_prompt=True, flavour="py:")
    assert prompt == "[hi]py:"
    want = tiny_reference.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    for body in ({"chat_template": template, "chat_template_kwargs": {"flavour": "py:"}},
                 {"chat_template_kwargs": {"chat_template": template, "flavour": "py:"}}):
        answer = httpx.post(trusting_server.url + CHAT, json={"messages": MSG, "max_tokens": 10, "temperature": 0,
                                                               **body}, timeout=60).json()
        assert answer["choices"][0]["message"]["content"] == want.text
    both = {"messages": MSG, "chat_template": template, "chat_template_kwargs": {"chat_template": template}}
    check_error(httpx.post(trusting_server.url + CHAT, json=both, timeout=60), 400, "give the chat template once",
                "chat_template_kwargs.chat_template")
    tokenize = {"messages": MSG, "chat_template_kwargs": {"tokenize": False}}
    check_error(httpx.post(trusting_server.url + CHAT, json=tokenize, timeout=60), 400, "tokenizer option",
                "chat_template_kwargs.tokenize")


# ---------------------------------------------------------------------------------------------- load
def poisoned_body(k: int) -> tuple[str, dict | bytes]:
    """The k-th poisoned request: out-of-range fields, hostile templates, junk JSON."""
    kinds = [
        (C, {"prompt": "x", "temperature": 1, "top_k": 9223372036854775808}),
        (CHAT, {"messages": MSG, "chat_template": SLOW_TEMPLATE}),
        (C, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
        (CHAT, {"messages": MSG, "chat_template": HUGE_TEMPLATE}),
        (C, b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
        (C, {"prompt": "x", "seed": 1 << 64, "temperature": 1}),
        (C, b'{"prompt": "\\ud800"}'),
        (C, {"prompt": "x", "stop": ["ab"] * 5000}),
        (C, {"prompt": "x", "stop_token_ids": [-1]}),
        (C, b'{"prompt": "x", "temperature": Infinity}'),
        (C, b'{"prompt": "x",'),
        (CHAT, {"messages": MSG, "chat_template": LOOP_OUTPUT_TEMPLATE}),
        (C, {"prompt": [VOCAB + 5]}),
    ]
    return kinds[k % len(kinds)]


def test_256_requests_from_64_clients_10_percent_poisoned(trusting_server, tiny_reference):
    prompts = short_prompts(16)
    chat_messages = [[{"role": "user", "content": p}] for p in prompts[:4]]
    chat_prompts = [tiny_reference.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                    for m in chat_messages]
    limits = [6 + 2 * (i % 3) for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in limits]
    want = tiny_reference.generate(prompts, params)
    want_chat = tiny_reference.generate(chat_prompts, params[:4])
    jobs = list(range(256))
    poisoned = set(range(5, 256, 10))  # 26 of 256
    results: dict[int, tuple] = {}

    async def one(http: httpx.AsyncClient, j: int) -> None:
        if j in poisoned:
            path, body = poisoned_body(j // 10)
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await http.post(path, content=raw, headers={"content-type": "application/json"})
            results[j] = (response.status_code, response.text)
            return
        i = j % len(prompts)
        if j % 7 == 0:
            c = i % 4
            body = {"messages": chat_messages[c], "max_tokens": limits[c], "temperature": 0}
            response = await http.post(CHAT, json=body)
            answer = response.json()
            results[j] = (response.status_code, answer["choices"][0]["message"]["content"], want_chat[c].text)
            return
        body = {"prompt": prompts[i], "max_tokens": limits[i], "temperature": 0, "stream": j % 2 == 1}
        if not body["stream"]:
            response = await http.post(C, json=body)
            results[j] = (response.status_code, response.json()["choices"][0]["text"], want[i].text)
            return
        text = []
        async with http.stream("POST", C, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        results[j] = (response.status_code, "".join(text), want[i].text)

    run_clients(trusting_server.url, jobs, one, clients=64, timeout=120)
    assert len(results) == 256 and len(poisoned) == 26
    innocent = {j: r for j, r in results.items() if j not in poisoned}
    failed = {j: r[0] for j, r in innocent.items() if r[0] != 200}
    assert not failed, f"{len(failed)} of {len(innocent)} well-formed requests failed: {failed}"
    differ = [j for j, (_, text, expected) in innocent.items() if text != expected]
    assert not differ, f"requests {differ} differ from their sequential answers"
    for j in poisoned:
        status, text = results[j]
        assert status == 400 and "error" in json.loads(text), f"poisoned request {j}: HTTP {status} {text[:200]}"
    wait_until(lambda: all_pages_free(trusting_server.state.engine) and trusting_server.state.num_pending == 0)


# ---------------------------------------------------------------------------------------------- faults
class FaultyEngine(Engine):
    """An engine whose next `fail_steps` steps raise (a fault the edge checks cannot see)."""

    fail_steps: int = 0

    def step(self):
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("injected fault: secret internals")
        return super().step()


def test_a_failing_step_never_kills_the_engine_thread(tiny_pair, tiny_reference, caplog):
    cfg = EngineConfig(mode="dflash", max_running_requests=4, max_model_len=TINY_LEN)
    engine = FaultyEngine.from_pretrained(tiny_pair[0], tiny_pair[1], config=cfg)
    with BackgroundServer(engine, ServeConfig(port=0, served_model_name="tiny")) as s:
        for round_ in range(3):
            engine.fail_steps = 1
            with caplog.at_level(logging.ERROR, logger="dscale.serve"):
                response = httpx.post(s.url + C, json={"prompt": "def f(x):", "max_tokens": 8}, timeout=60)
            assert response.status_code == 500, response.text
            message = response.json()["error"]["message"]
            assert "secret" not in message and "injected" not in message
            request_id = message.split("request id ")[1].split(";")[0]
            assert request_id.startswith("cmpl-") and request_id in caplog.text and "injected fault" in caplog.text
            assert s.state.worker.alive and httpx.get(s.url + "/health").json() == {"status": "ok"}
            assert_still_answers(s, tiny_reference, key="unused")
        assert s.state.worker.stats.step_failures == 3


def test_a_fault_attributed_to_one_request_fails_it_alone(tiny_pair, tiny_reference, caplog):
    """Concurrent requests, one of which (top_k 77) makes every decode step that holds it raise: that client
    gets a 500 naming its request id, the others get 200 and their target-only greedy texts."""
    import concurrent.futures

    cfg = EngineConfig(mode="dflash", max_running_requests=8, max_model_len=TINY_LEN)
    engine = Engine.from_pretrained(tiny_pair[0], tiny_pair[1], config=cfg)
    launch = engine.runner.launch

    def faulty(anchors, ctx, pages, sampling, *args):
        if any(row[2] == 77 for row in sampling):
            raise RuntimeError("injected fault: secret internals")
        return launch(anchors, ctx, pages, sampling, *args)

    engine.runner.launch = faulty
    prompts = ["def f(x):", "class A:", "import os", "for i in"]
    want = [o.text for o in tiny_reference.generate(prompts, SamplingParams(temperature=0, max_tokens=10))]
    bodies = [{"prompt": p, "max_tokens": 10, "temperature": 0} for p in prompts]
    bodies.insert(2, {"prompt": "x = ", "max_tokens": 10, "temperature": 1.0, "top_k": 77})
    with BackgroundServer(engine, ServeConfig(port=0, served_model_name="tiny")) as s:
        with caplog.at_level(logging.ERROR), concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: httpx.post(s.url + C, json=b, timeout=60), bodies))
        poisoned = answers.pop(2)
        assert poisoned.status_code == 500 and "secret" not in poisoned.text
        assert "injected fault" in caplog.text
        assert [a.status_code for a in answers] == [200] * 4
        assert [a.json()["choices"][0]["text"] for a in answers] == want
        assert s.state.worker.alive and s.state.worker.stats.step_failures == 0


def test_an_unhandled_error_is_a_500_with_the_request_id_only(server, tiny_reference, monkeypatch, caplog):
    def broken(text: str):
        raise RuntimeError("secret internals of the tokenizer")

    monkeypatch.setattr(server.state.prompts, "_encode", broken)
    with caplog.at_level(logging.ERROR, logger="dscale.serve"):
        response = httpx.post(server.url + C, json={"prompt": "x"}, headers=AUTH, timeout=30)
    monkeypatch.undo()
    check_error(response, 500, "internal error (request id", None)
    assert "secret" not in response.text
    request_id = response.headers["x-request-id"]
    assert request_id in response.json()["error"]["message"] and request_id in caplog.text
    assert "secret internals of the tokenizer" in caplog.text
    wait_until(lambda: server.state.num_pending == 0)
    assert_still_answers(server, tiny_reference)


@pytest.mark.parametrize("loop,http", [("asyncio", "h11"), ("uvloop", "httptools")])
def test_a_silent_connection_is_closed_after_the_header_timeout(tiny_pair, tiny_reference, loop, http):
    """--header-timeout bounds a request's line and headers: from the connection (nothing sent, or half a request)
    and, on a keep-alive connection, from the first bytes of the next request (half of it sent after an answer,
    which cancels uvicorn's keep-alive timer); an idle keep-alive connection is closed by --timeout-keep-alive.
    A head over --max-header-bytes gets a 4xx and its connection closes (httptools would keep it growing), while
    a long body, a head just under the limit and pipelined requests are answered. Both stacks (--loop / --http)
    hold it, and answer the reference's text through the loop they name."""
    import socket

    from dscale_runtime.server import worker

    def read_until(sock, marker: bytes, count: int = 1) -> bytes:
        answer = b""
        while answer.count(marker) < count:
            chunk = sock.recv(4096)
            assert chunk, f"closed before {marker!r}: {answer[:300]!r}"
            answer += chunk
        return answer

    def answered(sock) -> None:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        read_until(sock, b'{"status":"ok"}')

    pytest.importorskip(loop)
    pytest.importorskip(http)
    engine = Engine.from_pretrained(tiny_pair[0], config=EngineConfig(mode="target", max_model_len=TINY_LEN))
    with BackgroundServer(engine, ServeConfig(port=0, header_timeout=0.5, timeout_keep_alive=2, loop=loop,
                                              http=http)) as s:
        host, port = s.url.removeprefix("http://").split(":")
        loops = set(worker._INBOXES)
        assert_still_answers(s, tiny_reference, model=s.state.model)
        served = [lp for lp in worker._INBOXES if lp not in loops]
        assert len(served) == 1 and type(served[0]).__module__.split(".")[0] == loop
        assert s._server.config.http_protocol_class.__mro__[1].__module__.endswith(f".{http}_impl")
        # NOTE: each interval starts before the server's timer can (before connecting, before the bytes it counts
        # from), so a client slowed by a loaded machine can only read a longer one
        for sent in (b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"):  # nothing, then half a request
            start = time.perf_counter()
            with socket.create_connection((host, int(port)), timeout=8) as sock:
                sock.sendall(sent)
                assert sock.recv(1024) == b"", "the server closes the connection without answering"
                assert 0.45 < time.perf_counter() - start < 1.9  # --header-timeout 0.5, before the keep-alive's 2
        with socket.create_connection((host, int(port)), timeout=8) as sock:  # half of a second request
            answered(sock)
            start = time.perf_counter()
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            assert sock.recv(1024) == b""
            assert 0.45 < time.perf_counter() - start < 1.9
        with socket.create_connection((host, int(port)), timeout=8) as sock:  # keep-alive, idle after an answer
            start = time.perf_counter()
            answered(sock)
            assert sock.recv(1024) == b""
            assert 1.9 < time.perf_counter() - start < 6.0  # --timeout-keep-alive 2, not the header timeout
        with socket.create_connection((host, int(port)), timeout=8) as sock:
            body = json.dumps({"prompt": "a" * 600_000, "max_tokens": 1}).encode()  # one read holds head and body
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n" % len(body) + body)
            assert read_until(sock, b"context limit").startswith(b"HTTP/1.1 400")
            answered(sock)  # the same connection, after a body of 600 KB
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 15_000 + b"\r\n\r\n"
                         b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # 15 KB, then a pipelined request
            read_until(sock, b'{"status":"ok"}', count=2)
        with socket.create_connection((host, int(port)), timeout=8) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            answer, sent = b"", 0
            with pytest.raises(OSError):  # reset once the server has closed
                while sent < 1 << 26:
                    sock.sendall(b"X-Grow: " + b"g" * 4096 + b"\r\n")
                    sent += 4106
            assert sent < 1 << 24  # NOTE: closed near the limit (16 KiB), plus what the sockets' buffers held
            with contextlib.suppress(OSError):
                answer = sock.recv(4096)
            assert answer == b"" or answer.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400"))


# ---------------------------------------------------------------------------------------------- metrics
def test_metrics_parse_under_a_name_with_quotes_backslashes_and_newlines(trusting_server):
    from prometheus_client.parser import text_string_to_metric_families

    httpx.post(trusting_server.url + C, json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0}, timeout=60)
    assert httpx.get(trusting_server.url + "/v1/models").json()["data"][0]["id"] == NAME
    text = httpx.get(trusting_server.url + "/metrics").text
    families = list(text_string_to_metric_families(text))
    samples = [s for f in families for s in f.samples]
    assert len(families) >= 20 and samples
    assert all(s.labels["model_name"] == NAME for s in samples)
    by_name = {s.name: s.value for s in samples if set(s.labels) == {"model_name"}}
    assert by_name["dscale_e2e_request_latency_seconds_count"] >= 1
    assert by_name["dscale_generation_tokens_total"] >= 6


# ---------------------------------------------------------------------------------------------- SGLang / z-lab
@pytest.fixture(scope="module")
def demo_chat_pair(tmp_path_factory):
    """The demo pair with a chat template that passes the user's code prompt through."""
    folder = tmp_path_factory.mktemp("demo_chat") / "target"
    folder.mkdir()
    for item in DEMO_TARGET.iterdir():
        if item.name != "tokenizer_config.json":
            os.symlink(item, folder / item.name)
    config = json.loads((DEMO_TARGET / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}"
                               "{% endfor %}{% if enable_thinking is defined and enable_thinking %}#{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_zlab_send_openai_reads_spec_accept_length(demo_chat_pair):
    """z-lab's DFlash benchmark client (PyPI `dflash`, installed with --no-deps) against dscale-serve."""
    benchmark = pytest.importorskip("dflash.benchmark", reason="pip install --no-deps dflash==0.1.0")
    cfg = EngineConfig(mode="dflash", max_running_requests=2, max_model_len=1024)
    prompt = next(p["prompt"] for p in stdlib_prompts() if len(p["prompt"]) < 240)
    reference = Engine.from_pretrained(demo_chat_pair, DEMO_DRAFTER, config=cfg)
    want = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0]
    engine = Engine.from_pretrained(demo_chat_pair, DEMO_DRAFTER, config=cfg)
    with BackgroundServer(engine, ServeConfig(port=0, mode="dflash", served_model_name="demo")) as s:
        out = benchmark.send_openai(s.url, [{"role": "user", "content": prompt}], model="demo", max_new_tokens=48,
                                    temperature=0.0, top_p=1.0, top_k=0, timeout_s=120, reasoning="off")
    assert out["choices"][0]["message"]["content"] == want.text
    meta = out["meta_info"]
    assert meta == out["choices"][0]["meta_info"]
    assert meta["completion_tokens"] == len(want.token_ids) == out["usage"]["completion_tokens"]
    assert meta["spec_verify_ct"] == want.stats.num_steps >= 1
    assert meta["spec_accept_length"] == pytest.approx(len(want.token_ids) / want.stats.num_steps)
    assert meta["spec_accept_length"] >= 1
    assert meta["spec_accept_length"] > 1.5, "the demo pair accepts drafts: more than one token per verify step"
    assert meta["spec_num_correct_drafts"] == sum(want.stats.accepted_lens) > 0
    assert meta["prompt_tokens"] == len(want.prompt_token_ids) and 0 < meta["e2e_latency"] < 120
