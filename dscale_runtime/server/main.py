"""`dscale-serve`: load the engine named by the flags and serve it over HTTP with uvicorn (or, with
--data-parallel-size N, start N such servers behind sglang-router: `data_parallel.py`)."""

from __future__ import annotations

import gc
import json
import logging
import sys

from dscale_runtime.server.config import ServeConfig
from dscale_runtime.server.flags import parse_config


def check_paths(config: ServeConfig) -> None:
    """Every checkpoint path the flags name exists (checked before any slow loading starts)."""
    paths = {"--target": config.target_path, "--drafter": config.drafter_path, "--predictor": config.predictor_path}
    for flag, path in paths.items():
        if path is not None and not path.exists():
            raise FileNotFoundError(f"{path}: not found (dscale-serve {flag} PATH)")


def load_engine(config: ServeConfig, engine_cls=None):
    """The `Engine` the flags describe (every path checked before the slow loading starts)."""
    from dscale_runtime.config import EngineConfig
    from dscale_runtime.engine import Engine

    check_paths(config)
    max_model_len = config.max_model_len
    if max_model_len is None:
        target_config = json.loads((config.target_path / "config.json").read_text())
        max_model_len = min(int(target_config.get("max_position_embeddings", 4096)), 4096)
    engine_config = EngineConfig(
        mode=config.mode, max_running_requests=config.max_running_requests, max_model_len=max_model_len,
        kv_cache_tokens=config.kv_cache_tokens, memory_fraction=config.memory_fraction, budget_ratio=config.budget_ratio,
        full_width_max_batch=config.full_width_max_batch, dscale_policy=config.dscale_policy,
        step_graphs=config.step_graphs if config.step_graphs is not None else config.device.startswith("cuda"),
        measure_retention=config.measure_retention and config.mode == "dscale", device=config.device,
        live_calibration=config.live_calibration, calibration_window=config.calibration_window,
        dtype=config.dtype, draft_dtype=config.draft_dtype, seed=config.seed,
        sampling_rule=config.sampling_rule, overlap_schedule=config.overlap_schedule,
        prefix_caching=config.prefix_caching, chunked_prefill_tokens=config.chunked_prefill_tokens,
        target_fallback=config.target_fallback, prefill_graphs=config.prefill_graphs,
        prefill_stall_ratio=config.prefill_stall_ratio, admission_group=config.admission_group)
    return (engine_cls or Engine).from_pretrained(config.target_path, config.drafter_path, config.predictor_path,
                                                  config=engine_config)


def engine_process_app(config: ServeConfig):
    """The app with its engine in a child process (`--engine-process`): paths checked, the tokenizer loaded
    here, the engine loaded there (this waits for it)."""
    from dscale_runtime.models.loader import load_tokenizer
    from dscale_runtime.server.app import build_app
    from dscale_runtime.server.engine_process import EngineProcessClient

    check_paths(config)
    tokenizer = load_tokenizer(config.target_path)
    if tokenizer is None:
        raise ValueError(f"{config.target_path}: the target folder has no tokenizer; dscale-serve needs one "
                         "(tokenizer.json / tokenizer_config.json)")
    client = EngineProcessClient(config)
    try:
        return build_app(client.start_process(tokenizer), config, worker=client)
    except BaseException:
        if client.process.is_alive():
            client.process.terminate()
        raise


def uvicorn_config(app, config: ServeConfig, log_level: str):
    """uvicorn's settings for `app`: the event loop and HTTP parser of `--loop` / `--http`, with a deadline for
    request headers, and the keep-alive timeout."""
    import uvicorn

    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
                          loop=event_loop(config.loop),
                          http=header_deadline_protocol(config.header_timeout, http_parser(config.http),
                                                        config.max_header_bytes),
                          h11_max_incomplete_event_size=config.max_header_bytes,
                          timeout_keep_alive=config.timeout_keep_alive)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def event_loop(choice: str) -> str:
    """uvicorn's loop for `--loop`: 'auto' is uvloop where it is installed (not on Windows), else asyncio."""
    if choice == "auto":
        return "uvloop" if sys.platform != "win32" and _installed("uvloop") else "asyncio"
    if choice == "uvloop" and not _installed("uvloop"):
        raise ValueError("--loop uvloop: uvloop is not installed (pip install uvloop), or use --loop asyncio")
    return choice


def http_parser(choice: str) -> str:
    """The HTTP/1.1 implementation for `--http`: 'auto' is httptools where it is installed, else h11."""
    if choice == "auto":
        return "httptools" if _installed("httptools") else "h11"
    if choice == "httptools" and not _installed("httptools"):
        raise ValueError("--http httptools: httptools is not installed (pip install httptools), or use --http h11")
    return choice


def header_deadline_protocol(seconds: float, parser: str = "h11", max_head_bytes: int = 1 << 14):
    """uvicorn's HTTP protocol (`parser`: 'h11' or 'httptools'), closing a connection whose request line and
    headers take over `seconds`, or (httptools) over `max_head_bytes` (h11 bounds them itself, through uvicorn's
    `h11_max_incomplete_event_size`, with a 400).

    uvicorn arms a timer only once a response is complete (keep-alive), and cancels it as soon as any byte of
    the next request arrives, so a client that connects and sends nothing, or half a request (the first or a
    later one), would hold its connection (and a file descriptor) forever. The deadline runs from the
    connection and from the first bytes of each later request; an idle keep-alive connection stays uvicorn's
    (`timeout_keep_alive`). Both protocols start a new request cycle once its headers are complete.

    httptools (llhttp) keeps a header however long it grows until its end arrives, so a client could fill the
    server's memory within the deadline: the bytes read while a request's head is incomplete are counted, and past
    `max_head_bytes` the client gets 431 and the connection closes. A read that ends a body and starts the next head
    is not counted, so the bound is `max_head_bytes` plus one read."""
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Protocol
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Protocol

    class HeaderDeadlineProtocol(Protocol):
        _reading_head = True  # NOTE: llhttp callbacks (httptools only) move it; h11 keeps it unused
        _heads = 0
        _head_bytes = 0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            if self.timeout_keep_alive_task is not None:  # NOTE: idle after a response: a new request starts here
                self._arm_header_deadline()
            heads, in_head = self._heads, self._reading_head
            super().data_received(data)
            if parser != "httptools" or self.transport.is_closing():
                return
            if self._heads != heads:  # a head ended in this read: what follows it is not known, count from 0
                self._head_bytes = 0
            elif in_head and self._reading_head:
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes:
                    self._reject_head()

        def on_headers_complete(self) -> None:
            self._reading_head, self._heads, self._head_bytes = False, self._heads + 1, 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._reading_head = True
            super().on_message_complete()

        def _reject_head(self) -> None:
            body = (f"the request line and headers exceed this server's limit of {max_head_bytes} bytes "
                    "(--max-header-bytes)").encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                                 b"charset=utf-8\r\nconnection: close\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.transport.close()

        def _arm_header_deadline(self) -> None:
            waiting_for = self.cycle
            self.loop.call_later(seconds, self._header_deadline, waiting_for)

        def _header_deadline(self, waiting_for) -> None:
            # NOTE: a new request cycle means the headers arrived in time
            if self.cycle is waiting_for and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadlineProtocol


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from dscale_runtime.server.app import build_app

    config = parse_config(ServeConfig, "dscale-serve", argv,
                          "OpenAI-compatible server for DScale / DFlash / target-only decoding.")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if config.data_parallel:
        from dscale_runtime.server.data_parallel import serve

        try:
            return serve(config)
        except (RuntimeError, ValueError) as exc:
            sys.exit(f"dscale-serve: {exc}")
    try:
        loop, http = event_loop(config.loop), http_parser(config.http)  # NOTE: before minutes of loading
        if config.engine_process:
            app = engine_process_app(config)
            engine = app.state.server.engine
        else:
            engine = load_engine(config)
            app = build_app(engine, config)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        sys.exit(f"dscale-serve: {exc}")
    logging.getLogger("dscale.serve").info(
        "serving '%s' (mode %s, max %d running, context %d) on http://%s:%d/v1 (%s, %s)", config.model_name,
        config.mode, config.max_running_requests, engine.config.max_model_len, config.host, config.port, loop, http)
    # NOTE: start-up's objects (weights' wrappers, graphs, tokenizer) move to the permanent generation: the
    # collector's full passes while serving no longer walk them, which shortens the pauses a request can meet
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(config.switch_interval_ms / 1000)
    uvicorn.Server(uvicorn_config(app, config, config.log_level)).run()


if __name__ == "__main__":
    main()


class BackgroundServer:
    """uvicorn serving `build_app(engine, config)` from a thread of this process (tests, notebooks).

    `with BackgroundServer(engine, config) as server:` serves at `server.url` (port 0 picks a free port)."""

    def __init__(self, engine, config: ServeConfig, worker=None) -> None:
        """`worker`: an `EngineProcessClient` whose process is up (`engine` is its proxy); default: a thread."""
        import uvicorn

        from dscale_runtime.server.app import build_app

        self.app = build_app(engine, config, worker)
        self.state = self.app.state.server
        self._server = uvicorn.Server(uvicorn_config(self.app, config, "warning"))
        self._thread = None
        self.url = ""

    def __enter__(self) -> "BackgroundServer":
        import threading
        import time

        self._thread = threading.Thread(target=self._server.run, name="dscale-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.02)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(60)
