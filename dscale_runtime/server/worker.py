"""The engine thread: the only thread that touches the `Engine` (it is synchronous and not thread-safe).

HTTP handlers run on the asyncio loop and talk to it through two channels:
- in: a thread-safe inbox of `Submission`s (already tokenized and checked) and aborts, drained between engine
  steps, so new requests join the running batch at the next step (continuous batching);
- out: per-request `asyncio.Queue`s: `Admitted` (or `Rejected`), then `Delta`s for streaming requests, then
  `Finished` (or `Rejected` when a step fails, `Aborted` after an abort). The events of one pass of the thread
  (a drain of the inbox, or a step) go to the loop together, in one `loop.call_soon_threadsafe`: one wake-up
  of the loop per step rather than one per request, each a trip through the GIL while this thread works.

The thread never dies of an exception: a failing admission or detokenisation fails that request alone; a
request the engine aborted alone (finish_reason 'error': a fault its step attributed to it) gets a 500; a
failing `engine.step()` fails the requests of that step (the batch state is the engine's to repair) and the
thread goes on serving. Error answers carry the request id; the traceback goes to the log with it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from dscale_runtime.config import RequestOutput, SamplingParams
from dscale_runtime.server.detokenize import IncrementalDetokenizer, text_decoder

log = logging.getLogger("dscale.serve")


@dataclass
class Admitted:
    prompt_tokens: int


@dataclass
class Rejected:
    status: int
    message: str
    param: str | None = None


@dataclass
class Delta:
    text: str
    num_tokens: int
    """Tokens generated so far."""


@dataclass
class Finished:
    output: RequestOutput
    text: str
    """Streaming: the text not sent yet; otherwise the whole answer."""
    e2e_latency: float
    """Seconds from the request's arrival to its last token."""


@dataclass
class Aborted:
    """The request was aborted (its client went away)."""


TERMINAL = (Finished, Rejected, Aborted)


def internal_error(request_id: str, what: str) -> Rejected:
    """A 500 that names the request id (the log has the details), never the exception text."""
    return Rejected(500, f"internal error {what} (request id {request_id}; the server log has the details)")


@dataclass
class Submission:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    """With the final max_tokens (the handler checked it against the context)."""
    stream: bool
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    on_done: Callable[[], None] | None = None
    """Called on the loop thread when the last event (Finished, Rejected or Aborted) arrives."""
    arrival: float = field(default_factory=time.perf_counter)
    """perf_counter() when the HTTP request arrived (TTFT and E2E latency count from here)."""

    def _deliver(self, event) -> None:
        """On the loop thread (the engine thread hands events over through an `Outbox`)."""
        self.events.put_nowait(event)
        if isinstance(event, TERMINAL) and self.on_done is not None:
            self.on_done()


class Outbox:
    """Events the engine thread has produced since its last flush, handed to each loop in one call, in order."""

    def __init__(self) -> None:
        self._events: list[tuple[Submission, object]] = []

    def put(self, sub: Submission, event) -> None:
        self._events.append((sub, event))

    def flush(self) -> None:
        if self._events:
            events, self._events = self._events, []
            post(events)


def post(events: list) -> None:
    """From any thread: hand (submission, event) pairs to their loops, in order. A loop is woken only when it has
    no hand-over queued already; else the events join the one it will run (`_LoopInbox`)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for sub, event in events:
        by_loop.setdefault(sub.loop, []).append((sub, event))
    for loop, batch in by_loop.items():
        _inbox(loop).add(loop, batch)


class _LoopInbox:
    """Events for one loop from other threads. Waking a loop (`call_soon_threadsafe`) writes to its self-pipe, and that
    write lets go of the GIL; the engine thread must then wait for the loop thread's switch interval to take it
    back. A loop that has not yet run the last hand-over gets the new events in it, without another wake-up; when
    it runs, it delivers everything queued (1.135x / 1.099x served tokens/s at c = 8 / 32 against a wake-up per
    flush, `benchmarks/serve_host_cpu.py --trees`, 2026-12-05). (No reference to the loop: it keys a weak
    dictionary.)"""

    def __init__(self) -> None:
        self.events: list = []
        self.lock = threading.Lock()
        self.queued = False

    def add(self, loop: asyncio.AbstractEventLoop, batch: list) -> None:
        with self.lock:
            if loop.is_closed():  # NOTE: server shutdown: nobody is listening, and a queued hand-over never runs
                self.events.clear()
                self.queued = False
                return
            self.events.extend(batch)
            if self.queued:
                return
            self.queued = True
        try:
            loop.call_soon_threadsafe(self.run)
        except RuntimeError:  # the loop has closed (server shutdown): nobody is listening
            with self.lock:
                self.events.clear()
                self.queued = False

    def run(self) -> None:
        """On the loop: deliver every event queued so far."""
        with self.lock:
            events, self.events, self.queued = self.events, [], False
        deliver(events)


_INBOXES: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopInbox]" = weakref.WeakKeyDictionary()
_INBOXES_LOCK = threading.Lock()


def _inbox(loop: asyncio.AbstractEventLoop) -> _LoopInbox:
    inbox = _INBOXES.get(loop)
    if inbox is None:
        with _INBOXES_LOCK:
            inbox = _INBOXES.setdefault(loop, _LoopInbox())
    return inbox


def deliver(batch: list) -> None:
    """On the loop thread: each (submission, event) to its request, in order; one failing delivery (its on_done)
    does not stop the others."""
    for sub, event in batch:
        try:
            sub._deliver(event)
        except Exception:  # NOTE: one request's delivery (its on_done) must not cost the others theirs
            log.exception("request %s: delivering an event failed", sub.request_id)


@dataclass
class _Live:
    submission: Submission
    detokenizer: IncrementalDetokenizer | None
    first_token_at: float | None = None


@dataclass
class WorkerStats:
    """What the engine thread counted (read by /metrics from the loop thread; plain numbers)."""

    prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0, "error": 0})
    step_failures: int = 0


class EngineWorker:
    def __init__(self, engine, metrics=None, outbox=None) -> None:
        self.engine = engine
        self.metrics = metrics
        """`ServerMetrics` whose histograms this thread observes (None: no histograms)."""
        self.stats = WorkerStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._outbox = outbox if outbox is not None else Outbox()
        """Where events go: the loop threads of this process (`Outbox`), or a pipe to the HTTP process
        (`engine_process.PipeOutbox`)."""
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dscale-engine", daemon=True)
        self._decode: Callable[[list[int]], str] | None = None
        """The streams' `text_decoder` of the engine's tokenizer (made at the first stream)."""

    # ------------------------------------------------------------------ loop-thread side
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, submission: Submission) -> None:
        self._inbox.put(submission)

    def abort(self, request_id: str) -> None:
        self._inbox.put(request_id)

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread between steps (it may read the engine; its events are flushed)."""
        self._inbox.put(fn)

    async def refresh(self) -> None:
        """What /metrics and /get_load read is current (here: always; the engine is in this process)."""

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._drain(block=not self.engine.has_unfinished())
                self._outbox.flush()  # admissions reach their handlers before the step runs
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished():
                    self._step()
            except Exception:  # NOTE: a bug of this loop's own; the thread must outlive it
                log.exception("engine thread: unexpected error (live requests: %s)", sorted(self._live))
                time.sleep(0.05)
            finally:
                self._outbox.flush()
        for request_id in list(self._live):
            self._abort(request_id)
        while True:  # requests that arrived during shutdown
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, str) and not callable(item) and item is not None:
                self._send(item, Rejected(503, "the server is shutting down"))
        self._outbox.flush()

    def _send(self, sub: Submission, event) -> None:
        self._outbox.put(sub, event)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, str):
                    self._abort(item)
                elif callable(item):
                    self._run_call(item)
                elif item is not None:  # a Submission (or the engine process's record of one)
                    self._admit(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _run_call(self, fn) -> None:
        try:
            fn()
        except Exception:
            log.exception("engine thread: a call failed")

    def _admit(self, sub: Submission) -> None:
        try:
            self.engine.add_request(sub.prompt_token_ids, sub.params, sub.request_id)
            detok = None
            if sub.stream:
                if self._decode is None:
                    self._decode = text_decoder(self.engine.tokenizer)
                detok = IncrementalDetokenizer(self.engine.tokenizer, sub.params.stop, self._decode)
        except ValueError as exc:  # the engine's checks name what is wrong with the request
            return self._send(sub, Rejected(400, str(exc)))
        except Exception:
            log.exception("request %s: admission failed", sub.request_id)
            self._drop(sub.request_id)
            return self._send(sub, internal_error(sub.request_id, "while admitting the request"))
        self.stats.prompt_tokens += len(sub.prompt_token_ids)
        self._live[sub.request_id] = _Live(sub, detok)
        self._send(sub, Admitted(len(sub.prompt_token_ids)))

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self._drop(request_id)
            self.stats.finished["abort"] += 1
            self._send(live.submission, Aborted())

    def _drop(self, request_id: str) -> None:
        """Remove a request from the engine, whatever state it is in."""
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("request %s: engine.abort failed", request_id)

    def _fail(self, request_id: str, what: str) -> None:
        """Fail one live request with a 500 (the caller logged why)."""
        live = self._live.pop(request_id, None)
        self._drop(request_id)
        self.stats.finished["error"] += 1
        if live is not None:
            self._send(live.submission, internal_error(request_id, what))

    def _step(self) -> None:
        start = time.perf_counter()
        steps_before = self.engine.counters.steps
        try:
            outputs = self.engine.step()
        except Exception:
            # NOTE: a failed step leaves its batch in a state only the engine knows: its requests fail (each
            # client gets a 500 naming its request id), the thread goes on with the next step.
            self.stats.step_failures += 1
            ids = sorted(self._live)
            log.exception("engine step failed; failing its requests %s", ids)
            for request_id in ids:
                self._fail(request_id, "in the engine step")
            return
        now = time.perf_counter()
        if self.engine.counters.steps > steps_before:
            self._observe_step(now - start)
        for out in outputs:
            live = self._live.pop(out.request_id, None)
            if live is not None:
                self._finish(live, out, now)
        for request_id, live in list(self._live.items()):
            try:
                self._progress(request_id, live, now)
            except Exception:
                log.exception("request %s: streaming its tokens failed", request_id)
                self._fail(request_id, "while streaming the answer")

    def _observe_step(self, seconds: float) -> None:
        if self.metrics is None or self.engine.last_step is None:
            return
        step = self.engine.last_step
        self.metrics.step_seconds.observe(seconds)
        self.metrics.verify_rows.observe(step.num_verify_rows)
        self.metrics.accept_length.add(step.accepted_lens)

    def _progress(self, request_id: str, live: _Live, now: float) -> None:
        detok = live.detokenizer
        if detok is None:
            if live.first_token_at is None and self.engine.generated_token_ids(request_id):
                live.first_token_at = now
            return
        new = self.engine.generated_token_ids(request_id, len(detok.token_ids))
        if new:
            if live.first_token_at is None:
                live.first_token_at = now
            text = detok.add(new)
            if text:  # text held back (a partial character, a possible stop string) comes with a later delta
                self._send(live.submission, Delta(text, len(detok.token_ids)))

    def _finish(self, live: _Live, out: RequestOutput, now: float) -> None:
        sub = live.submission
        if out.finish_reason == "error":  # the engine aborted this request alone (its log names it)
            self.stats.finished["error"] += 1
            return self._send(sub, internal_error(sub.request_id, "in the engine step"))
        try:
            text = out.text or ""
            if live.detokenizer is not None:
                live.detokenizer.token_ids.extend(out.token_ids[len(live.detokenizer.token_ids):])
                text = live.detokenizer.finish(text)
        except Exception:
            log.exception("request %s: detokenizing the answer failed", sub.request_id)
            self.stats.finished["error"] += 1
            return self._send(sub, internal_error(sub.request_id, "while detokenizing the answer"))
        self.stats.finished[out.finish_reason] = self.stats.finished.get(out.finish_reason, 0) + 1
        e2e = now - sub.arrival
        if self.metrics is not None and out.token_ids:
            first = live.first_token_at if live.first_token_at is not None else now
            self.metrics.ttft.observe(first - sub.arrival)
            self.metrics.e2e.observe(e2e)
            if len(out.token_ids) > 1:
                self.metrics.tpot.observe((now - first) / (len(out.token_ids) - 1))
        self._send(sub, Finished(out, text, e2e))
