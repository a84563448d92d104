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
    """uvicorn's settings for `app`: h11 with a deadline for request headers, the keep-alive timeout."""
    import uvicorn

    return uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level, lifespan="on",
                          http=header_deadline_protocol(config.header_timeout),
                          timeout_keep_alive=config.timeout_keep_alive)


def header_deadline_protocol(seconds: float):
    """uvicorn's h11 protocol, closing a connection whose request line and headers take over `seconds`.

    uvicorn arms a timer only once a response is complete (keep-alive), and cancels it as soon as any byte of
    the next request arrives, so a client that connects and sends nothing, or half a request (the first or a
    later one), would hold its connection (and a file descriptor) forever. The deadline runs from the
    connection and from the first bytes of each later request; an idle keep-alive connection stays uvicorn's
    (`timeout_keep_alive`)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadlineProtocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_deadline()

        def data_received(self, data: bytes) -> None:
            if self.timeout_keep_alive_task is not None:  # NOTE: idle after a response: a new request starts here
                self._arm_header_deadline()
            super().data_received(data)

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
        if config.engine_process:
            app = engine_process_app(config)
            engine = app.state.server.engine
        else:
            engine = load_engine(config)
            app = build_app(engine, config)
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        sys.exit(f"dscale-serve: {exc}")
    logging.getLogger("dscale.serve").info(
        "serving '%s' (mode %s, max %d running, context %d) on http://%s:%d/v1", config.model_name, config.mode,
        config.max_running_requests, engine.config.max_model_len, config.host, config.port)
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
