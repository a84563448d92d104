"""The engine in a process of its own (`dscale-serve --engine-process`): HTTP apart from the decode loop.

In one process the engine thread and the asyncio loop share one GIL: every socket read and write of the loop
waits for the engine thread's switch interval, and every step's Python waits for the loop's (the API-server /
engine-core split of vLLM and SGLang's scheduler process answer the same problem). Here the HTTP process keeps
the app (checks, tokenising, SSE); a child process (spawned, so CUDA starts clean there) loads the engine and
runs the same `EngineWorker` loop. One duplex pipe joins them, watched by the HTTP process's event loop:
- HTTP -> engine: ("submit", request id, prompt token ids, SamplingParams, stream, arrival), ("abort", id),
  ("snapshot", n) (what /metrics and /get_load read, taken on the engine thread between steps), ("stop",);
- engine -> HTTP: ("ready", static facts) or ("error", message) once, then ("events", [(request id, event) or
  (request id, a Delta's text, its token count)], histogram calls) per pass of the engine thread, and ("snapshot",
  n, facts) answers.
Arrival stamps cross the pipe as `time.perf_counter()` values: a system-wide monotonic clock on Linux.

If the engine process dies, every request it held gets a 500 naming its id, new ones a 503, and /health says
503; the HTTP process stays up for a supervisor (or the router) to see it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import multiprocessing
import signal
import sys
import threading
from dataclasses import dataclass
from types import SimpleNamespace

from dscale_runtime.config import SamplingParams
from dscale_runtime.stats import EngineCounters
from dscale_runtime.server.worker import (TERMINAL, Delta, EngineWorker, Rejected, Submission, WorkerStats, deliver,
                                          post)

log = logging.getLogger("dscale.serve")

HISTOGRAMS = ("ttft", "e2e", "tpot", "step_seconds", "verify_rows", "accept_length")
"""`ServerMetrics` histograms the engine thread observes: recorded in the engine process, replayed here."""
SNAPSHOT_TIMEOUT = 10.0
"""Seconds /metrics waits for the engine thread's snapshot before it answers from the last one."""


@dataclass
class EngineRequest:
    """The engine process's record of a request (the `Submission` fields the worker reads)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    arrival: float


class _Recorder:
    def __init__(self, name: str, sink: list) -> None:
        self.name, self.sink = name, sink

    def observe(self, value: float) -> None:
        self.sink.append((self.name, "observe", value))

    def add(self, values: list[int]) -> None:
        self.sink.append((self.name, "add", values))


class RecordingMetrics:
    """The histograms' `observe` (and the accept-length histogram's `add`) calls, kept for the next message to
    the HTTP process, which makes them again on its `ServerMetrics`."""

    def __init__(self) -> None:
        self.observations: list[tuple[str, str, object]] = []
        for name in HISTOGRAMS:
            setattr(self, name, _Recorder(name, self.observations))


class PipeOutbox:
    """`Outbox` for the engine process: one pipe message per flush with the events and the observations."""

    def __init__(self, conn, metrics: RecordingMetrics) -> None:
        self.conn, self.metrics = conn, metrics
        self._events: list = []

    def put(self, sub: EngineRequest, event) -> None:
        # NOTE: a Delta (one per request per step) crosses as its fields: a dataclass pickles ~10x slower
        if type(event) is Delta:
            self._events.append((sub.request_id, event.text, event.num_tokens))
        else:
            self._events.append((sub.request_id, event))

    def flush(self) -> None:
        observations = self.metrics.observations
        if not self._events and not observations:
            return
        events, self._events = self._events, []
        self.conn.send(("events", events, list(observations)))
        observations.clear()


def engine_facts(engine, worker: EngineWorker) -> dict:
    """What the HTTP process reads of the engine at a scrape (taken on the engine thread)."""
    counters = engine.counters
    calibration = getattr(engine, "calibration", None)
    return {
        "num_running": engine.num_running, "num_waiting": engine.num_waiting,
        "num_free": engine.allocator.num_free,
        "counters": dataclasses.replace(counters, history=[], steps_by_mode=dict(counters.steps_by_mode)),
        "stats": dataclasses.replace(worker.stats, finished=dict(worker.stats.finished)),
        "live_acceptance": dict(getattr(engine, "live_acceptance", {})),
        "live_step_ms": dict(getattr(engine, "live_step_ms", {})),
        "host_ms": dict(getattr(engine, "host_ms", {})),
        "wall_ms": dict(getattr(engine, "wall_ms", {})),
        "cycle_ms": getattr(engine, "cycle_ms", None),
        "calibration": calibration.report() if calibration is not None else None,
        "prefix_cache_stats": dict(getattr(engine, "prefix_cache_stats", {})),
        "step_policy": dict(getattr(engine, "step_policy", {})),
    }


def static_facts(engine) -> dict:
    return {"config": engine.config, "block_size": engine.block_size, "page_size": engine.allocator.page_size,
            "num_pages": engine.allocator.num_pages, "vocab_size": engine.target.config.vocab_size,
            "architecture": type(engine.target).__name__}


def engine_process_main(config, conn, factory=None) -> None:
    """The child: load the engine (`factory(config)`, default `main.load_engine`), run the worker, turn pipe
    messages into its inbox until stop or EOF."""
    from dscale_runtime.server.main import load_engine

    # NOTE: Ctrl-C reaches the whole process group; the HTTP process stops this one (its "stop", or EOF if it died)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = (factory or load_engine)(config)
    except Exception as exc:  # NOTE: the HTTP process exits with this message (bad paths, bad checkpoints)
        log.exception("engine process: loading the engine failed")
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    metrics = RecordingMetrics()
    outbox = PipeOutbox(conn, metrics)
    worker = EngineWorker(engine, metrics, outbox)
    conn.send(("ready", static_facts(engine)))
    gc.collect()
    gc.freeze()
    sys.setswitchinterval(config.switch_interval_ms / 1000)
    worker.start()
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the HTTP process is gone
                break
            kind = message[0]
            if kind == "submit":
                worker.submit(EngineRequest(*message[1:]))
            elif kind == "abort":
                worker.abort(message[1])
            elif kind == "snapshot":
                nonce = message[1]
                worker.call(lambda nonce=nonce: conn.send(("snapshot", nonce, engine_facts(engine, worker))))
            elif kind == "stop":
                break
    finally:
        worker.stop()


class EngineProxy:
    """The engine as the HTTP process sees it: static facts from start-up, the rest from the last snapshot."""

    def __init__(self, facts: dict, tokenizer) -> None:
        self.config = facts["config"]
        self.tokenizer = tokenizer
        self.block_size = facts["block_size"]
        self.target_architecture = facts["architecture"]
        self.target = SimpleNamespace(config=SimpleNamespace(vocab_size=facts["vocab_size"]))
        self.allocator = SimpleNamespace(page_size=facts["page_size"], num_pages=facts["num_pages"],
                                         num_free=facts["num_pages"] - 1)
        self.last_step = None
        self.num_running = self.num_waiting = 0
        self.counters = EngineCounters()
        self.live_acceptance, self.live_step_ms, self.host_ms, self.wall_ms, self.cycle_ms = {}, {}, {}, {}, None
        self.calibration = None
        self.prefix_cache_stats, self.step_policy = {}, {}
        self.stats = WorkerStats()

    def update(self, facts: dict) -> None:
        self.num_running, self.num_waiting = facts["num_running"], facts["num_waiting"]
        self.allocator.num_free = facts["num_free"]
        self.counters, self.stats = facts["counters"], facts["stats"]
        self.live_acceptance, self.live_step_ms = facts["live_acceptance"], facts["live_step_ms"]
        self.host_ms, self.wall_ms, self.cycle_ms = facts["host_ms"], facts["wall_ms"], facts["cycle_ms"]
        report = facts["calibration"]
        self.calibration = SimpleNamespace(report=lambda: report) if report is not None else None
        self.prefix_cache_stats, self.step_policy = facts["prefix_cache_stats"], facts["step_policy"]


class EngineProcessClient:
    """The HTTP process's side: the `EngineWorker` surface the app uses, over the pipe to the engine process."""

    read_on_loop = True
    """Read the pipe on the app's loop where it can watch it (`start`); false: in a thread of its own."""

    def __init__(self, config, factory=None) -> None:
        """`factory(config) -> engine` runs in the engine process (picklable; default: the flags' engine)."""
        self.config = config
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        # NOTE: not a daemon (a daemon process may not start processes of its own, which compilers can); it
        # ends at "stop", or when this process is gone (EOF on the pipe)
        self.process = context.Process(target=engine_process_main, args=(config, child, factory),
                                       name="dscale-engine")
        self._child_conn = child
        self._send_lock = threading.Lock()
        self._subs: dict[str, Submission] = {}
        self._subs_lock = threading.Lock()
        self._snapshots: dict[int, asyncio.Future] = {}
        self._nonce = 0
        self._reader: threading.Thread | None = None
        """The pipe's reader thread, where the loop cannot watch the pipe (else the loop reads it: `start`)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead = False
        self._stopping = False
        self.metrics = None
        self.engine: EngineProxy | None = None

    # ------------------------------------------------------------------ start-up (before the app exists)
    def start_process(self, tokenizer) -> EngineProxy:
        """Start the engine process and wait until its engine is loaded (raises with its error)."""
        self.process.start()
        self._child_conn.close()
        while not self.conn.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited (status {self.process.exitcode}) while loading")
        message = self.conn.recv()
        if message[0] == "error":
            self.process.join(30)
            raise ValueError(message[1])
        self.engine = EngineProxy(message[1], tokenizer)
        return self.engine

    # ------------------------------------------------------------------ the worker surface (loop thread)
    @property
    def stats(self) -> WorkerStats:
        return self.engine.stats

    @property
    def alive(self) -> bool:
        return not self._dead and self.process.is_alive()

    def start(self) -> None:
        """Read the engine's messages on the running loop (the app's lifespan calls this on it): the pipe is one
        more file descriptor the loop waits on, as vLLM's and SGLang's HTTP processes read their engine's sockets,
        so events reach their requests with no thread between (which took the GIL from the loop, and woke it through
        its self-pipe once per message). A loop without `add_reader` (Windows' proactor) gets a reader thread."""
        self._loop = asyncio.get_running_loop()
        if self.read_on_loop:
            try:
                return self._loop.add_reader(self.conn.fileno(), self._readable)
            except NotImplementedError:
                pass
        self._reader = threading.Thread(target=self._read, name="dscale-engine-pipe", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._send(("stop",))
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)

    def submit(self, sub: Submission) -> None:
        with self._subs_lock:
            self._subs[sub.request_id] = sub
        if not self._send(("submit", sub.request_id, sub.prompt_token_ids, sub.params, sub.stream, sub.arrival)):
            with self._subs_lock:
                self._subs.pop(sub.request_id, None)
            sub._deliver(Rejected(503, "the engine process has stopped; the server cannot take requests"))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def refresh(self) -> None:
        """Ask the engine thread for a snapshot and wait for it (a dead engine: the last one)."""
        loop = asyncio.get_running_loop()
        self._nonce += 1
        nonce, future = self._nonce, loop.create_future()
        self._snapshots[nonce] = future
        try:
            if self._send(("snapshot", nonce)):
                await asyncio.wait_for(asyncio.shield(future), SNAPSHOT_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("the engine process sent no snapshot within %.0f s; /metrics shows the last one",
                        SNAPSHOT_TIMEOUT)
        finally:
            self._snapshots.pop(nonce, None)

    def _send(self, message) -> bool:
        if self._dead:
            return False
        try:
            with self._send_lock:
                self.conn.send(message)
            return True
        except (OSError, ValueError):  # the pipe is closed: the engine process is gone
            return False

    # ------------------------------------------------------------------ the pipe reader (the loop, or a thread)
    def _readable(self) -> None:
        """On the loop: every message that has arrived (at most 64, then the loop's other work goes first).
        The engine writes each message whole, so a read that starts one finds all of it, or EOF."""
        try:
            for _ in range(64):
                if not self.conn.poll():
                    return
                self._handle(self.conn.recv())
        except (EOFError, OSError):  # the engine process is gone
            self._loop.remove_reader(self.conn.fileno())
            self._engine_gone()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            self._handle(message)
        self._engine_gone()

    def _handle(self, message) -> None:
        try:
            if message[0] == "events":
                self._events(message[1], message[2])
            elif message[0] == "snapshot":
                self.engine.update(message[2])
                future = self._snapshots.get(message[1])
                if future is not None:
                    self._on_loop(future.get_loop(), _resolve, future)
        except Exception:  # NOTE: one bad message must not stop the deliveries of every request
            log.exception("engine pipe: handling a message failed")

    def _on_loop(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        """`fn(*args)` on `loop`: now when this is its thread (the loop reads the pipe), else handed over."""
        if self._reader is None and loop is self._loop:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, events: list) -> None:
        """(submission, event) pairs to their loops: at once on the loop that reads the pipe, the rest posted."""
        if self._reader is not None:
            return post(events)
        here = [(sub, event) for sub, event in events if sub.loop is self._loop]
        if len(here) < len(events):
            post([(sub, event) for sub, event in events if sub.loop is not self._loop])
        deliver(here)

    def _engine_gone(self) -> None:
        self._dead = True
        (log.info if self._stopping else log.error)("the engine process stopped (exit status %s); failing its %d "
                                                    "requests", self.process.exitcode, len(self._subs))
        with self._subs_lock:
            subs, self._subs = list(self._subs.values()), {}
        self._deliver([(sub, Rejected(500, f"internal error: the engine process stopped (request id {sub.request_id}; "
                                           "the server log has the details)")) for sub in subs])

    def _events(self, events: list, observations: list) -> None:
        if self.metrics is not None:
            for name, method, value in observations:
                getattr(getattr(self.metrics, name), method)(value)
        delivered = []
        with self._subs_lock:
            for entry in events:
                request_id = entry[0]
                sub = self._subs.get(request_id)
                if sub is None:
                    continue
                event = Delta(entry[1], entry[2]) if len(entry) == 3 else entry[1]
                if isinstance(event, TERMINAL):
                    del self._subs[request_id]
                delivered.append((sub, event))
        self._deliver(delivered)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
