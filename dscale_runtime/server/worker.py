"""The engine thread: the only thread that touches the `Engine` (it is synchronous and not thread-safe).

HTTP handlers run on the asyncio loop and talk to it through two channels:
- in: a thread-safe inbox of `Submission`s and aborts, drained between engine steps, so new requests join
  the running batch at the next step (continuous batching);
- out: per-request `asyncio.Queue`s fed with `loop.call_soon_threadsafe`: `Admitted` (or `Rejected`), then
  `Delta`s for streaming requests, then `Finished` (or `Rejected` when a step fails, `Aborted` after an abort).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from dscale_runtime.config import RequestOutput, SamplingParams
from dscale_runtime.server.detokenize import IncrementalDetokenizer

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


@dataclass
class Aborted:
    """The request was aborted (its client went away)."""


TERMINAL = (Finished, Rejected, Aborted)


@dataclass
class Submission:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    max_tokens: int | None
    """None: as many as the context leaves (`max_model_len` - prompt tokens)."""
    stream: bool
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    on_done: Callable[[], None] | None = None
    """Called on the loop thread when the last event (Finished, Rejected or Aborted) arrives."""

    def send(self, event) -> None:
        """From the engine thread: hand `event` to the loop thread."""
        try:
            self.loop.call_soon_threadsafe(self._deliver, event)
        except RuntimeError:  # the loop has closed (server shutdown): nobody is listening
            pass

    def _deliver(self, event) -> None:
        self.events.put_nowait(event)
        if isinstance(event, TERMINAL) and self.on_done is not None:
            self.on_done()


@dataclass
class _Live:
    submission: Submission
    detokenizer: IncrementalDetokenizer | None


@dataclass
class WorkerStats:
    """What the engine thread measured (read by /metrics from the loop thread; plain numbers)."""

    prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0})
    steps: int = 0
    step_seconds: float = 0.0
    last_step_seconds: float = 0.0


class EngineWorker:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.stats = WorkerStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dscale-engine", daemon=True)

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

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain(block=not self.engine.has_unfinished())
            if self._stopping.is_set():
                break
            if self.engine.has_unfinished():
                self._step()
        for request_id in list(self._live):
            self._abort(request_id)
        while True:  # requests that arrived during shutdown
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Submission):
                item.send(Rejected(503, "the server is shutting down"))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                if isinstance(item, Submission):
                    self._admit(item)
                elif isinstance(item, str):
                    self._abort(item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _admit(self, sub: Submission) -> None:
        engine = self.engine
        limit = engine.config.max_model_len
        try:
            if isinstance(sub.prompt, str):
                token_ids = list(engine.tokenizer.encode(sub.prompt, add_special_tokens=False))
            else:
                token_ids = list(sub.prompt)
            if not token_ids:
                return sub.send(Rejected(400, "the prompt is empty: send at least one token", "prompt"))
            if len(token_ids) >= limit:
                return sub.send(Rejected(
                    400, f"the prompt has {len(token_ids)} tokens; this server's context limit is {limit} tokens "
                    f"(prompt + output, dscale-serve --max-model-len), so the prompt must be shorter than {limit}",
                    "prompt"))
            max_tokens = sub.max_tokens if sub.max_tokens is not None else limit - len(token_ids)
            if len(token_ids) + max_tokens > limit:
                return sub.send(Rejected(
                    400, f"the prompt has {len(token_ids)} tokens and max_tokens is {max_tokens}: together they "
                    f"exceed this server's context limit of {limit} tokens; lower max_tokens to at most "
                    f"{limit - len(token_ids)}", "max_tokens"))
            params = replace(sub.params, max_tokens=max_tokens)
            engine.add_request(token_ids, params, sub.request_id)
        except ValueError as exc:
            return sub.send(Rejected(400, str(exc)))
        except Exception as exc:  # one bad request must not stop the engine thread
            log.exception("admitting request %s failed", sub.request_id)
            return sub.send(Rejected(500, f"internal error while admitting the request: {exc}"))
        self.stats.prompt_tokens += len(token_ids)
        detok = IncrementalDetokenizer(engine.tokenizer, params.stop) if sub.stream else None
        self._live[sub.request_id] = _Live(sub, detok)
        sub.send(Admitted(len(token_ids)))

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            self.engine.abort(request_id)
            self.stats.finished["abort"] += 1
            live.submission.send(Aborted())

    def _step(self) -> None:
        start = time.perf_counter()
        steps_before = self.engine.counters.steps
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # NOTE: a failed step leaves the batch in an unknown state: fail every live request, keep serving.
            log.exception("engine step failed")
            for request_id, live in list(self._live.items()):
                self.engine.abort(request_id)
                live.submission.send(Rejected(500, f"internal error in the engine step: {exc}"))
            self._live.clear()
            return
        elapsed = time.perf_counter() - start
        if self.engine.counters.steps > steps_before:
            self.stats.steps += 1
            self.stats.step_seconds += elapsed
            self.stats.last_step_seconds = elapsed
        finished_ids = set()
        for out in outputs:
            finished_ids.add(out.request_id)
            live = self._live.pop(out.request_id, None)
            if live is None:
                continue
            self.stats.finished[out.finish_reason] = self.stats.finished.get(out.finish_reason, 0) + 1
            text = out.text or ""
            if live.detokenizer is not None:
                live.detokenizer.token_ids.extend(out.token_ids[len(live.detokenizer.token_ids):])
                text = live.detokenizer.finish(text)
            live.submission.send(Finished(out, text))
        for request_id, live in self._live.items():
            detok = live.detokenizer
            if detok is None:
                continue
            new = self.engine.generated_token_ids(request_id, len(detok.token_ids))
            if new:
                live.submission.send(Delta(detok.add(new), len(detok.token_ids)))

