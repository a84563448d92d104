"""The FastAPI application: OpenAI routes, checks in the order a client can fix them, SSE streaming.

Checks before a request reaches the engine thread: API key (401, every route but /health), body size (413),
JSON (400: syntax, UTF-8, nesting, integer size, lone surrogates), fields (400, the field named), model name
(404), unsupported options (400), server queue (429 with Retry-After), then the prompt, rendered and
tokenized in a thread pool (`templates.PromptBuilder`), against the context limit (400). None of these touch
other requests. Every error answer has OpenAI's shape and an `X-Request-Id` header; a 500 names the request
id and never the exception (the log has it, under the same id).

Behind sglang-router (data-parallel serving, `data_parallel.py`) the server also answers what the router asks of
its workers: `/server_info` (the served model name), `/model_info`, `/get_load`; and the SGLang options the
router writes into every body it forwards are accepted at their no-op values (`ROUTER_NO_OP_FIELDS`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import random
import time
from collections import Counter
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dscale_runtime.server import protocol
from dscale_runtime.server.decode import decode_json
from dscale_runtime.server.config import ServeConfig
from dscale_runtime.server.metrics import ServerMetrics
from dscale_runtime.server.protocol import ApiError
from dscale_runtime.server.templates import PromptBuilder
from dscale_runtime.server.worker import Admitted, Delta, EngineWorker, Finished, Rejected, Submission

log = logging.getLogger("dscale.serve")

_REQUEST_IDS = random.Random(os.urandom(32))
"""Request ids: 128 bits from a generator seeded once per process from the OS (again in a forked child, which would
otherwise repeat its parent's ids). `uuid4` asks the OS on every call, and that call lets go of the GIL; the event
loop must then wait for the engine thread's switch interval to go on."""
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _REQUEST_IDS.seed(os.urandom(32)))


def new_request_id() -> str:
    """A fresh request id: 32 hex digits."""
    return f"{_REQUEST_IDS.getrandbits(128):032x}"

OPEN_PATHS = ("/health",)
"""Routes answered without the API key."""
ROUTER_NO_OP_FIELDS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
                       "continue_final_message": False, "separate_reasoning": True, "stream_reasoning": True}
"""SGLang request options sglang-router adds to every body it forwards, at values that describe what this server
does anyway (stop strings trimmed, special tokens skipped, no hidden states, no reasoning parser): dropped before
the strict parse. Any other value is refused, naming the field."""


class ServerState:
    """Loop-thread state: the worker, the request count the queue limit reads, error counts."""

    def __init__(self, engine, config: ServeConfig, worker=None) -> None:
        self.config = config
        self.engine = engine
        self.model = config.model_name
        self.metrics = ServerMetrics(self, self.model, engine.block_size, engine.config.max_running_requests)
        self.worker = worker if worker is not None else EngineWorker(engine, self.metrics)
        """The engine thread of this process, or the client of an engine process (`engine_process.py`)."""
        self.worker.metrics = self.metrics
        self.prompts = PromptBuilder(engine.tokenizer, timeout=config.template_timeout,
                                     max_chars=config.max_prompt_chars)
        self.limits = protocol.Limits(engine.target.config.vocab_size, engine.config.max_model_len)
        self.num_pending = 0
        self.requests_received = 0
        self.http_errors: Counter[int] = Counter()
        self.max_pending = engine.config.max_running_requests + config.max_waiting_requests


class EdgeMiddleware:
    """ASGI middleware around every route: request ids, the API key, error counts, and the last-resort 500.

    Pure ASGI (not BaseHTTPMiddleware), so handlers keep reading `http.disconnect` from the real receive."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        started = False

        async def send_with_id(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.state.http_errors[message["status"]] += 1
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        refused = self._check_key(scope)
        if refused is not None:
            return await refused(scope, receive, send_with_id)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s: unhandled error in %s %s", request_id, scope["method"], scope["path"])
            if not started:
                body = protocol.error_body(500, f"internal error (request id {request_id}; the server log has the "
                                                "details)")
                await JSONResponse(body, status_code=500)(scope, receive, send_with_id)

    def _check_key(self, scope) -> Response | None:
        key = self.state.config.api_key
        if key is None or scope["path"] in OPEN_PATHS:
            return None
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
            return None
        what = "missing" if not header else "wrong"
        return JSONResponse(protocol.error_body(401, f"{what} API key: send the header 'Authorization: Bearer KEY' "
                                                     "with the key dscale-serve was started with (--api-key)"),
                            status_code=401)


def build_app(engine, config: ServeConfig, worker=None) -> FastAPI:
    """The server app around `engine` (started and stopped with the app's lifespan); `worker`: an
    `engine_process.EngineProcessClient` when the engine runs in a process of its own (`engine` is then its
    `EngineProxy`), else the app runs an `EngineWorker` thread here."""
    if engine.tokenizer is None:
        raise ValueError(f"{config.target_path}: the target folder has no tokenizer; dscale-serve needs one "
                         "(tokenizer.json / tokenizer_config.json)")
    state = ServerState(engine, config, worker)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        yield
        await asyncio.to_thread(state.worker.stop)
        state.prompts.close()

    docs = config.enable_docs
    app = FastAPI(title="dscale-serve", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.server = state
    app.add_middleware(EdgeMiddleware, state=state)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = (f"no route {request.method} {request.url.path}; this server answers /v1/completions, "
                       "/v1/chat/completions, /v1/models, /health, /metrics, /server_info, /model_info and "
                       "/get_load")
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
        else:
            message = str(exc.detail)
        return JSONResponse(protocol.error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=exc.headers)

    async def read_json(request: Request):
        limit = config.max_request_bytes
        declared = request.headers.get("content-length")
        too_large = ApiError(413, f"the request body is larger than this server's limit of {limit} bytes "
                                  "(dscale-serve --max-request-bytes)")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
        return decode_json(bytes(body))

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model:
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{state.model}' "
                                "(GET /v1/models)", "model")

    def model_card() -> dict:
        return {"id": state.model, "object": "model", "created": 0, "owned_by": "dscale",
                "max_model_len": engine.config.max_model_len, "mode": engine.config.mode}

    @app.get("/health")
    async def health():
        if not state.worker.alive:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        await state.worker.refresh()
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info():
        # NOTE: no model_path: sglang-router would load a tokenizer from it, and it needs none for HTTP workers.
        return {"served_model_name": state.model, "mode": engine.config.mode, "version": package_version(),
                "max_running_requests": engine.config.max_running_requests,
                "max_total_tokens": engine.allocator.page_size * (engine.allocator.num_pages - 1),
                "max_model_len": engine.config.max_model_len}

    @app.get("/model_info")
    async def model_info():
        architecture = getattr(engine, "target_architecture", None) or type(engine.target).__name__
        return {"is_generation": True, "model_type": "qwen3", "architectures": [architecture]}

    @app.get("/get_load")
    async def get_load():
        """SGLang's load report (one entry per data-parallel rank; one here); power_of_two routing reads it."""
        await state.worker.refresh()
        allocator = engine.allocator
        used_tokens = allocator.page_size * (allocator.num_pages - 1 - allocator.num_free)
        return [{"dp_rank": 0, "num_reqs": engine.num_running + engine.num_waiting,
                 "num_waiting_reqs": engine.num_waiting, "num_tokens": used_tokens}]

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        return model_card()

    async def parse(request: Request, body_type):
        body = protocol.parse_body(body_type, drop_router_no_ops(await read_json(request)))
        check_model(body.model)
        body.refuse_unsupported()
        body.check_limits(state.limits)
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        body = await parse(request, protocol.CompletionRequest)
        prompt = body.prompt_input(state.limits.vocab_size)
        tokenize = state.prompts.token_ids(prompt) if isinstance(prompt, str) else None
        return await run(request, body, prompt if tokenize is None else tokenize, chat=False, arrival=arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        body = await parse(request, protocol.ChatCompletionRequest)
        template, variables = body.template_variables(config.trust_request_chat_template)
        template = template if template is not None else state.prompts.model_template
        if template is None:
            raise ApiError(400, f"model '{state.model}' has no chat template (its tokenizer_config.json has no "
                                "'chat_template'): use /v1/completions with a plain prompt", "messages")
        messages = [m.as_template_input() for m in body.messages]
        return await run(request, body, state.prompts.chat_token_ids(messages, template, variables), chat=True,
                         arrival=arrival)

    async def run(request: Request, body, prompt, chat: bool, arrival: float) -> Response:
        """Queue place, prompt tokens (`prompt`: token ids or a coroutine making them), submission, answer."""
        state.requests_received += 1
        if state.num_pending >= state.max_pending:
            if asyncio.iscoroutine(prompt):
                prompt.close()
            raise ApiError(429, f"the server queue is full ({state.num_pending} requests running or waiting; "
                                f"--max-running-requests {engine.config.max_running_requests} + "
                                f"--max-waiting-requests {config.max_waiting_requests}); retry later",
                           headers={"Retry-After": "1"})
        # NOTE: the place is taken before tokenizing and given back by `release` when the engine thread's last
        # event for the request arrives, or here if the request never reaches the engine thread.
        state.num_pending += 1
        submitted = False
        try:
            token_ids = await prompt if asyncio.iscoroutine(prompt) else prompt
            max_tokens = protocol.check_context(len(token_ids), body.output_limit, state.limits.max_model_len,
                                                body.output_limit_field)
            request_id = ("chatcmpl-" if chat else "cmpl-") + request.state.request_id
            sub = Submission(request_id, token_ids, body.sampling_params(max_tokens), body.stream, asyncio.Queue(),
                             asyncio.get_running_loop(), release, arrival)
            state.worker.submit(sub)
            submitted = True
            first = await sub.events.get()
        except asyncio.CancelledError:
            if submitted:
                state.worker.abort(request_id)
            raise
        finally:
            if not submitted:
                release()
        if isinstance(first, Rejected):
            raise ApiError(first.status, first.message, first.param)
        assert isinstance(first, Admitted)
        if body.stream:
            # Aborts the request if the client leaves, even before the response body starts.
            watcher = asyncio.ensure_future(abort_on_disconnect(request, request_id))
            return StreamingResponse(stream(sub, chat, body.include_usage, watcher), media_type="text/event-stream")
        finished = await wait_finished(request, sub)
        if finished is None:
            return Response(status_code=499)  # the client left; nobody reads this
        meta = protocol.meta_info(request_id, finished.output, finished.e2e_latency) if body.return_meta_info else None
        build = protocol.chat_body if chat else protocol.completion_body
        return JSONResponse(build(request_id, state.model, finished.text, finished.output, meta))

    def release() -> None:
        state.num_pending -= 1

    async def abort_on_disconnect(request: Request, request_id: str) -> None:
        await wait_disconnect(request)
        state.worker.abort(request_id)

    async def wait_finished(request: Request, sub: Submission) -> Finished | None:
        """The request's `Finished`, or None when the client disconnects first (the request is aborted)."""
        answer = asyncio.ensure_future(sub.events.get())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                state.worker.abort(sub.request_id)
                return None
            event = answer.result()
            if isinstance(event, Rejected):
                raise ApiError(event.status, event.message, event.param)
            return event
        except asyncio.CancelledError:
            state.worker.abort(sub.request_id)
            raise
        finally:
            answer.cancel()
            gone.cancel()

    async def stream(sub: Submission, chat: bool, include_usage: bool, watcher: asyncio.Future):
        """SSE events: text deltas, the finish reason, optionally usage, then [DONE]."""
        done = False

        def event(payload: dict) -> str:
            if include_usage and "usage" not in payload:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        def chunk(text: str, finish_reason: str | None = None) -> str:
            if chat:
                delta = {"content": text} if text or finish_reason is None else {}
                return event(protocol.chat_chunk(sub.request_id, state.model, delta, finish_reason))
            return event(protocol.completion_chunk(sub.request_id, state.model, text, finish_reason))

        try:
            if chat:
                yield event(protocol.chat_chunk(sub.request_id, state.model, {"role": "assistant", "content": ""}))
            first_text = True
            while not done:
                # NOTE: everything queued for this request goes out in one write: deltas that piled up while the
                # loop was busy become one chunk, so a loop behind the engine catches up instead of falling
                # further behind (a write is a trip through the GIL that the engine thread holds)
                items = [await sub.events.get()]
                while not sub.events.empty():
                    items.append(sub.events.get_nowait())
                text = "".join(item.text for item in items if isinstance(item, Delta))
                terminal = next((item for item in items if not isinstance(item, Delta)), None)
                out = []
                if isinstance(terminal, Finished):
                    out.append(chunk(text + terminal.text, terminal.output.finish_reason))
                    if include_usage:
                        out.append(event(protocol.usage_chunk(sub.request_id, state.model, chat, terminal.output)))
                elif text:
                    out.append(chunk(text))
                if isinstance(terminal, Rejected):
                    state.http_errors[terminal.status] += 1
                    out.append(f"data: {json.dumps(ApiError(terminal.status, terminal.message).body())}\n\n")
                if terminal is not None:
                    done = True
                    out.append("data: [DONE]\n\n")
                if out:
                    if first_text and (text or isinstance(terminal, Finished)):
                        first_text = False
                        state.metrics.first_chunk.observe(time.perf_counter() - sub.arrival)
                    yield "".join(out)
        finally:
            watcher.cancel()
            if not done:
                state.worker.abort(sub.request_id)

    return app


def package_version() -> str:
    try:
        return version("dscale")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def drop_router_no_ops(body):
    """`body` without the `ROUTER_NO_OP_FIELDS` that hold their no-op value (400 for any other value)."""
    if not isinstance(body, dict):
        return body
    for name, no_op in ROUTER_NO_OP_FIELDS.items():
        if name in body:
            value = body[name]
            if type(value) is not bool or value != no_op:
                raise ApiError(400, f"{name}={json.dumps(value)} is not supported: this server always behaves as "
                                    f"{name}={json.dumps(no_op)} (SGLang's option; leave it out)", name)
            body = {k: v for k, v in body.items() if k != name}
    return body


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
