"""Continuous-batching scheduler: request state, admission under the KV-cache bound, preemption, release.

CPU-only policy (no tensors): each step it grows the pages of running requests so they can hold one more
verification block, preempting the most recently admitted requests when the cache is full (they return
to the front of the queue and are recomputed later), then admits waiting requests while both the
running-request limit and the free pages allow. Finished or aborted requests free their pages at once.
A running request holds a slot (0 .. max_running - 1): its row of the runner's device state.

The overlap schedule (the engine launches step t + 1 before it commits step t) asks `reserve` for two blocks
beyond the committed tokens, without preempting: when that fails the engine commits first and schedules.
Pages and slots freed while a step that still writes them is queued are safe to hand out: every later use is a
later kernel on the same stream.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

from dscale_runtime.config import RequestStats, SamplingParams
from dscale_runtime.kv_cache import PageAllocator
from dscale_runtime.prefix_cache import page_keys

log = logging.getLogger("dscale.scheduler")

ADMISSION_HOLD_STEPS = 4
"""With an admission group, a waiting request is held at most this many steps for more slots to free."""
IN_BATCH_SHARE_TOKENS = 32
"""A waiting request whose next this-many tokens (whole pages) a running request is prefilling waits a step to
take them from the prefix cache (SGLang's in-batch prefix threshold is 32 tokens as well)."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose target K/V is in the cache (all but the pending anchor)."""
    context_from: int | None = None
    """The first position whose drafter context is not in the cache, or None where every computed position's is:
    a speculative engine's target-only steps leave it unwritten, and the engine writes it before the request's next
    speculative step (`Engine._catch_up_context`)."""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    """What failed, when the engine aborted this request alone (finish_reason 'error')."""
    slot: int = -1
    """Row of the runner's device state while running (-1 otherwise)."""
    prefill_chunk: int = 0
    """Tokens the engine prefills for this request in the current step (chunked prefill)."""
    ahead: int = 0
    """Launched steps of this request not committed yet (its device state is newer than its host state)."""
    page_keys: tuple[int, list[bytes]] = (-1, ())
    """(number of prefill tokens, prefix keys of their full pages), computed by a prefix-caching scheduler."""
    sampling: tuple = ()
    """(seed_lo, seed_hi, top_k, rule, temperature, top_p): the request's columns of the step buffers."""
    stats: RequestStats = field(default_factory=RequestStats)
    stop_ids: frozenset[int] | None = None
    """Token ids that end this request (its stop_token_ids, and the EOS ids unless ignore_eos); set by the engine at
    its first commit."""

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token: the anchor of the next block (no copy of the token list)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_token_ids(self) -> list[int]:
        """What a prefill computes: the prompt, or after a preemption every token but the pending anchor."""
        return self.all_token_ids[: self.num_tokens - 1] if self.output_token_ids else self.prompt_token_ids

    @property
    def prefilling(self) -> bool:
        """Admitted but not prefilled to the end yet (chunked prefill runs a prompt over several steps)."""
        out = self.output_token_ids  # NOTE: read per running request several times a step: no nested property
        return self.num_computed < len(self.prompt_token_ids) + len(out) - 1 if out else \
            self.num_computed < len(self.prompt_token_ids)


class Scheduler:
    def __init__(self, allocator: PageAllocator, max_running: int, lookahead: int, admission_group: int = 1) -> None:
        self.allocator = allocator
        self.max_running = max_running
        self.admission_group = admission_group
        """Admit waiting requests in groups of up to this many while others decode (`_holds`); 1 = at once."""
        self._held = 0
        self.lookahead = lookahead
        """Cache slots a request needs beyond its computed tokens for one step (the block width W)."""
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._free_slots = list(range(max_running - 1, -1, -1))

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, request: Request, lookahead: int | None = None) -> int:
        # NOTE: a block starts at its anchor's position: the last token's for a request with output, one past the
        # prompt for a fresh one (its first token is drawn by the prefill), which a step may decode as soon as
        # its last chunk is in: a target-only step (lookahead 1) sized on num_tokens - 1 wrote its anchor's K/V
        # past the request's last page when the prompt filled whole pages (issue 24).
        out = request.output_token_ids
        anchor = len(request.prompt_token_ids) + len(out) - (1 if out else 0)
        tokens = max(request.num_computed, anchor) + (self.lookahead if lookahead is None else lookahead)
        return max(0, self.allocator.pages_for(tokens) - len(request.pages))

    def reserve(self, requests: list[Request], lookahead: int) -> bool:
        """Grow every request's pages to its committed tokens + `lookahead`, all or none (no preemption)."""
        needed = [self._pages_needed(r, lookahead) for r in requests]
        if sum(needed) > self.allocator.num_free:
            return False
        for request, count in zip(requests, needed):
            if count:
                request.pages.extend(self.allocator.allocate(count))
        return True

    def _grow(self, request: Request) -> bool:
        pages = self.allocator.allocate(self._pages_needed(request))
        if pages is None:
            return False
        request.pages.extend(pages)
        return True

    def schedule(self) -> tuple[list[Request], list[Request]]:
        """Returns (requests to prefill now, running requests to decode now).

        Requests admitted in this call are prefilled this step and decode from the next one on."""
        # Running requests first: each needs room for one more block.
        for request in list(self.running):
            if request.status is not Status.RUNNING:
                continue  # preempted below while serving an earlier request
            while not self._grow(request):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
        num_decoding = len(self.running)
        admitted = self.admit()
        return admitted, self.running[:num_decoding]

    def admit(self) -> list[Request]:
        """Admit waiting requests, in order, while the running-request limit and the free pages allow. With a
        prefix-caching allocator a request starts from the longest cached prefix of its tokens (at least one
        token is always computed) and gets pages for the rest; a request whose next pages (IN_BATCH_SHARE_TOKENS
        at least) a running request is still prefilling waits for them instead of computing them again, and the
        requests behind it go on (SGLang's in-batch prefix deprioritization)."""
        if self._holds():
            return []
        admitted = []
        caching = hasattr(self.allocator, "match")
        pending: set[bytes] | None = None  # NOTE: built at the first request that needs it, not every step
        index = 0
        # NOTE: at most max_running waiting requests are passed over per call, so a long queue sharing one
        # prompt costs a bounded scan (and hashing) per step.
        while index < len(self.waiting) and index <= self.max_running and len(self.running) < self.max_running:
            request = self.waiting[index]
            matched = caching and not request.pages
            if matched:
                if pending is None:
                    pending = self._pending_keys()
                if pending and self._waits(request, pending):
                    index += 1
                    continue
                tokens = request.prefill_token_ids
                # NOTE: counted once admitted: a request that cannot be admitted now is matched again later
                request.pages = self.allocator.match(tokens, max_tokens=len(tokens) - 1, count=False)
                request.num_computed = len(request.pages) * self.allocator.page_size
            if not self._grow(request):
                if caching:  # NOTE: a request that cannot be admitted holds no pages while it waits
                    self._release(request)
                    request.num_computed = 0
                break
            if matched:
                hit_pages = request.num_computed // self.allocator.page_size
                self.allocator.count_query(len(request.prefill_token_ids), hit_pages)
            del self.waiting[index]
            request.status = Status.RUNNING
            request.slot = self._free_slots.pop()
            self.running.append(request)
            admitted.append(request)
            if pending is not None:
                pending |= set(self._keys(request)[request.num_computed // self.allocator.page_size :])
        return admitted

    def _holds(self) -> bool:
        """Whether admission waits this step (SGLang's --min-free-slots-delay, bounded): while requests decode and
        the queue could fill a group of `admission_group` but fewer slots are free, for at most
        ADMISSION_HOLD_STEPS steps; never while the queue is shorter than the group or nothing decodes."""
        group = min(self.admission_group, self.max_running)
        free = self.max_running - len(self.running)
        if (group <= 1 or free <= 0 or len(self.waiting) < group or free >= group
                or self._held >= ADMISSION_HOLD_STEPS or not any(not r.prefilling for r in self.running)):
            self._held = 0
            return False
        self._held += 1
        return True

    def _keys(self, request: Request) -> list[bytes]:
        """Prefix keys of the full pages of the request's prefill tokens (kept while those tokens stay the same)."""
        tokens = request.prefill_token_ids
        if request.page_keys[0] != len(tokens):
            request.page_keys = (len(tokens), page_keys(tokens, self.allocator.page_size))
        return request.page_keys[1]

    def _pending_keys(self) -> set[bytes]:
        """Keys of the full pages that running requests have yet to prefill (they register them when computed)."""
        size = self.allocator.page_size
        return {key for r in self.running if r.prefilling for key in self._keys(r)[r.num_computed // size :]}

    def _waits(self, request: Request, pending: set[bytes]) -> bool:
        """Whether the pages after the request's cached prefix, IN_BATCH_SHARE_TOKENS tokens of them at least,
        are pages running requests are prefilling."""
        size = self.allocator.page_size
        keys = self._keys(request)[: (len(request.prefill_token_ids) - 1) // size]
        cached = self.allocator.cached_pages(keys)  # NOTE: the last token is always computed, hence the bound
        need = -(-IN_BATCH_SHARE_TOKENS // size)
        return cached + need <= len(keys) and all(key in pending for key in keys[cached : cached + need])

    def register(self, request: Request) -> None:
        """With a prefix-caching allocator: offer the full pages of the request's computed tokens to later
        requests (their K/V is final: every position below num_computed holds a committed token), up to the
        first position without its drafter context (`Request.context_from`): a hit starts from that context."""
        if hasattr(self.allocator, "register") and request.pages:
            upto = request.num_computed if request.context_from is None else request.context_from
            try:
                self.allocator.register(request.all_token_ids[:upto], request.pages)
            except ValueError:  # NOTE: bookkeeping of a cache, never of the output: the pages stay uncached
                log.exception("request %s: its pages could not be offered to the prefix cache", request.request_id)

    def _preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self.running.remove(request)
        self.register(request)
        self._release(request)
        request.num_computed, request.context_from = 0, None
        request.status = Status.WAITING
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        if request.slot >= 0:
            self._free_slots.append(request.slot)
            request.slot = -1
        if request.pages:
            self.allocator.free(request.pages)
            request.pages = []

    def finish(self, request: Request, reason: str) -> None:
        if request in self.running:
            self.running.remove(request)
            if reason != "error":
                self.register(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
