"""The FastAPI application: OpenAI routes, checks in the order a client can fix them, SSE streaming.

Checks before a request reaches the engine thread: API key (401), body size (413), JSON (400), fields
(400, the field named), model name (404), unsupported options (400), server queue (429). The engine
thread then checks the prompt against the context limit (400). None of these touch other requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from collections import Counter
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from dscale_runtime.server import metrics, protocol
from dscale_runtime.server.config import ServeConfig
from dscale_runtime.server.protocol import ApiError
from dscale_runtime.server.worker import Admitted, Delta, EngineWorker, Finished, Rejected, Submission

log = logging.getLogger("dscale.serve")


class ServerState:
    """Loop-thread state: the worker, the request count the queue limit reads, error counts."""

    def __init__(self, engine, config: ServeConfig) -> None:
        self.config = config
        self.engine = engine
        self.worker = EngineWorker(engine)
        self.model = config.model_name
        self.num_pending = 0
        self.requests_received = 0
        self.http_errors: Counter[int] = Counter()
        self.max_pending = engine.config.max_running_requests + config.max_waiting_requests


def build_app(engine, config: ServeConfig) -> FastAPI:
    """The server app around `engine` (started and stopped with the app's lifespan)."""
    if engine.tokenizer is None:
        raise ValueError(f"{config.target_path}: the target folder has no tokenizer; dscale-serve needs one "
                         "(tokenizer.json / tokenizer_config.json)")
    state = ServerState(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.worker.start()
        yield
        await asyncio.to_thread(state.worker.stop)

    app = FastAPI(title="dscale-serve", lifespan=lifespan)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        state.http_errors[exc.status] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error")
        state.http_errors[500] += 1
        return JSONResponse(ApiError(500, f"internal error: {exc}").body(), status_code=500)

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), config.api_key.encode()):
            what = "missing" if not header else "wrong"
            raise ApiError(401, f"{what} API key: send the header 'Authorization: Bearer KEY' with the key "
                                "dscale-serve was started with (--api-key)")

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
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model:
            raise ApiError(404, f"model '{name}' does not exist; this server serves '{state.model}' "
                                "(GET /v1/models)", "model")

    @app.get("/health")
    async def health():
        if not state.worker.alive:
            return JSONResponse({"status": "engine thread stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def get_metrics():
        text = metrics.render(state.worker, state.model, state.requests_received, dict(state.http_errors),
                              state.num_pending)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        return {"object": "list", "data": [{
            "id": state.model, "object": "model", "created": 0, "owned_by": "dscale",
            "max_model_len": engine.config.max_model_len, "mode": engine.config.mode}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        body = protocol.parse_body(protocol.CompletionRequest, await read_json(request))
        check_model(body.model)
        body.refuse_unsupported()
        prompt = body.prompt_input(engine.target.config.vocab_size)
        return await run(request, body, prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_key(request)
        body = protocol.parse_body(protocol.ChatCompletionRequest, await read_json(request))
        check_model(body.model)
        body.refuse_unsupported()
        tokenizer = engine.tokenizer
        if getattr(tokenizer, "chat_template", None) is None:
            raise ApiError(400, f"model '{state.model}' has no chat template (its tokenizer_config.json has no "
                                "'chat_template'): use /v1/completions with a plain prompt", "messages")
        try:
            prompt = tokenizer.apply_chat_template([m.as_template_input() for m in body.messages], tokenize=False,
                                                   add_generation_prompt=True, **(body.chat_template_kwargs or {}))
        except Exception as exc:  # template errors are the request's (roles, kwargs)
            raise ApiError(400, f"the chat template could not render these messages: {exc}", "messages") from None
        return await run(request, body, prompt, body.output_limit, chat=True)

    async def run(request: Request, body, prompt, max_tokens: int | None, chat: bool) -> Response:
        state.requests_received += 1
        try:
            params = body.sampling_params(max_tokens or 1)  # max_tokens=None: set once the prompt is tokenized
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        if state.num_pending >= state.max_pending:
            raise ApiError(429, f"the server queue is full ({state.num_pending} requests running or waiting; "
                                f"--max-running-requests {engine.config.max_running_requests} + "
                                f"--max-waiting-requests {config.max_waiting_requests}); retry later")
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        sub = Submission(request_id, prompt, params, max_tokens, body.stream, asyncio.Queue(), loop, release)
        # NOTE: the count drops when the engine thread's last event for the request arrives (`release`), so
        # no way of leaving (error, disconnect, a stream that never started) can leak a queue place.
        state.num_pending += 1
        try:
            state.worker.submit(sub)
            first = await sub.events.get()
        except asyncio.CancelledError:
            state.worker.abort(request_id)
            raise
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
        build = protocol.chat_body if chat else protocol.completion_body
        return JSONResponse(build(request_id, state.model, finished.text, finished.output))

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
            while True:
                item = await sub.events.get()
                if isinstance(item, Delta):
                    if item.text:
                        yield chunk(item.text)
                elif isinstance(item, Finished):
                    done = True
                    yield chunk(item.text, item.output.finish_reason)
                    if include_usage:
                        yield event(protocol.usage_chunk(sub.request_id, state.model, chat, item.output))
                    break
                elif isinstance(item, Rejected):
                    done = True
                    state.http_errors[item.status] += 1
                    yield f"data: {json.dumps(ApiError(item.status, item.message).body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not done:
                state.worker.abort(sub.request_id)

    return app


async def wait_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
