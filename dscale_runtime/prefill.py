"""Prefill on fixed buffers in token buckets: the target forward over the prompt chunks of one engine step, the
drafter's context injection and the first generated token of every prompt that completes, as one pure tensor
function, captured once per (token bucket, draw kind) on CUDA and replayed; eager elsewhere.

A bucket of T tokens has R = min(T, max_requests) request slots plus one pseudo request that owns the padding
rows. Every padding row sits at position 0 of the scratch page (it writes K/V there and attends to that one
key), unused request slots have no rows and no keys, and rows of a request slot whose prompt does not complete
in this chunk (or padding slots) write their first-token draw to the device state's dummy row. The host fills
every index (rows, positions, cache slots, query bounds, block tables) with numpy and stages them in one copy
per dtype (pinned, alternating on CUDA, as the decode buffers do), so a replay needs no host read.

With more than one request slot a bucket also has variants with fewer slots: R = 1 (a chunk of one request, a long
prompt beside decoding) and every power of SLOT_VARIANT_STEP below max_requests (4, 16, ...: a group of
admitted requests). A prefill of n requests replays the bucket's smallest variant with at least n slots: the
attention launches a program per request slot, head group, query tile and key split whether a slot is used or
not, and the full buckets' start-up times follow that count rather than their tokens (docs/benchmarks.md,
2026-12-05: on the demo pair one request on the 32-slot 256-token bucket took 1.30 ms, on its one-slot variant
0.37 ms).

Token counts above the largest bucket run the same function eagerly on buffers of their own size (rounded up to
16 rows, the Triton kernels' specialisation of the captured sizes). Without padding (`pad=False`, the CPU
default) each call builds exact-size buffers and gives the portable attention its live query and key bounds:
the same code as the captured path, at the cost of its math.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.graphs import GraphedCall, collect_garbage, cuda_times
from dscale_runtime.kernels import kv_splits_for
from dscale_runtime.kv_cache import SCRATCH_PAGE
from dscale_runtime.sampling import SamplingRows, target_tokens

log = logging.getLogger("dscale.prefill")

RULE_GREEDY = 0  # the runner's rule codes (runner.RULE_GREEDY); sampling tuples carry them
ROW_ALIGN = 16  # eager token counts are padded to this (the captured buckets are multiples of it)
FLOOR_FACTOR = 1.5  # a chunk beside decoding may take this many times the cheapest chunk's time (`budget`)
KINDS = ((False, False), (True, False), (True, True))  # (sampled, filtered) of the first-token draw
SLOT_VARIANT_STEP = 4
"""Besides its full request slots and one, a bucket is captured with every power of this many slots in between."""


def slot_variants(max_requests: int) -> tuple[int, ...]:
    """The request-slot counts a bucket is captured with, ascending, the full count last: 1, 4, 16, ...,
    max_requests (just max_requests when it is 1)."""
    counts, r = {max_requests}, 1
    while r < max_requests:
        counts.add(r)
        r *= SLOT_VARIANT_STEP
    return tuple(sorted(counts))


def default_prefill_buckets(max_tokens: int) -> list[int]:
    """Token buckets up to `max_tokens`: 16, 32, 64, 128, 256, then steps of x1.5 / x1.33 (384, 512, 768, 1024,
    1536, 2048, 3072, 4096, 6144, 8192, ...), so padding wastes at most a third of a large chunk's math and a
    small chunk (a prefix-cache hit's last page, a short prompt) replays a small graph."""
    sizes, b = [], 16
    while b < max_tokens:
        sizes.append(b)
        if b >= 256:
            sizes.append(b * 3 // 2)
        b *= 2
    return sorted({s for s in sizes if s < max_tokens} | {-(-max_tokens // ROW_ALIGN) * ROW_ALIGN})


INT_FIELDS = ("token_ids", "positions", "row_req", "row_local", "slot_mapping")  # [T] each
REQ_FIELDS = ("query_starts", "query_lens", "kv_lens")  # [R + 1] each (the pseudo request last)
SLOT_FIELDS = ("last_rows", "slots", "draw_pos", "seed_lo", "seed_hi", "top_k", "rule")  # [R] each
FLOAT_FIELDS = ("temperature", "top_p")  # [R] each


@dataclass
class PrefillChunk:
    """One request's part of a prefill: `tokens` at positions start.., its block table, and, when its prompt
    completes here, the state slot and sampling tuple of its first-token draw at index `draw_pos`."""

    tokens: list[int]
    start: int
    pages: list[int]
    slot: int | None = None  # None: the prompt goes on in a later chunk (or was preempted): no draw
    sampling: tuple = (0, 0, -1, RULE_GREEDY, 1.0, 1.0)
    draw_pos: int = 0
    tail_slot: int | None = None  # the state slot whose token ring takes `tail` (its prefill ends here), or None
    tail: tuple[int, ...] | list[int] = ()  # the last (up to) R tokens before position `tail_end`
    tail_end: int = 0


class PrefillBuffers:
    """Fixed-address inputs of one token bucket (T rows, R request slots + the pseudo request)."""

    def __init__(self, tokens: int, requests: int, max_pages: int, page_size: int, device: torch.device,
                 tail_width: int = 0) -> None:
        from dscale_runtime.runner import _Staging  # NOTE: the decode buffers' staging (pinned, alternating)

        self.tokens, self.requests, self.max_pages, self.page_size = tokens, requests, max_pages, page_size
        self.tail_width = tail_width  # the token ring's width R (v3 features), 0 without one
        t, n = tokens, requests + 1
        self.n_int = (len(INT_FIELDS) * t + len(REQ_FIELDS) * n + n * max_pages + len(SLOT_FIELDS) * requests
                      + requests * (2 + tail_width))
        self.n_float = len(FLOAT_FIELDS) * requests
        on_cpu = device.type == "cpu"
        self.stagings = [_Staging(self.n_int, self.n_float, not on_cpu) for _ in range(1 if on_cpu else 2)]
        self._turn = 0
        first = self.stagings[0]
        self.dev_int = first.ints if on_cpu else torch.zeros(self.n_int, dtype=torch.long, device=device)
        self.dev_float = first.floats if on_cpu else torch.zeros(self.n_float, dtype=torch.float32, device=device)
        self._views(self.dev_int, self.dev_float, self)

    def _views(self, ints, floats, into) -> None:
        """Name the fields of a flat int / float pair (the device buffers, or a staging's numpy arrays)."""
        t, r, n = self.tokens, self.requests, self.requests + 1
        at = 0
        for name in INT_FIELDS:
            setattr(into, name, ints[at : at + t])
            at += t
        for name in REQ_FIELDS:
            setattr(into, name, ints[at : at + n])
            at += n
        setattr(into, "block_tables", ints[at : at + n * self.max_pages].reshape(n, self.max_pages))
        at += n * self.max_pages
        for name in SLOT_FIELDS + ("tail_slots", "tail_end"):
            setattr(into, name, ints[at : at + r])
            at += r
        setattr(into, "tail", ints[at : at + r * self.tail_width].reshape(r, self.tail_width))
        for i, name in enumerate(FLOAT_FIELDS):
            setattr(into, name, floats[i * r : (i + 1) * r])

    def fill(self, chunks: list[PrefillChunk], dummy_slot: int) -> None:
        """Stage one prefill's indices on the host and copy them to the device (non-blocking when pinned)."""
        staging = self.stagings[self._turn]
        self._turn = (self._turn + 1) % len(self.stagings)
        if staging.pending:  # NOTE: its previous copy must have left before it is overwritten
            staging.copied.synchronize()

        class _Host:
            pass

        h = _Host()
        self._views(staging.np_int, staging.np_float, h)
        t, r, ps = self.tokens, self.requests, self.page_size
        n = len(chunks)
        lens = np.fromiter((len(c.tokens) for c in chunks), dtype=np.int64, count=n)
        total = int(lens.sum())
        assert n <= r and total <= t, (n, r, total, t)
        starts = np.cumsum(lens) - lens
        ctx = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
        staging.np_int.fill(0)  # NOTE: SCRATCH_PAGE == 0: unused tables, padding slots and rows on scratch
        assert SCRATCH_PAGE == 0
        tables = h.block_tables
        for i, c in enumerate(chunks):
            tables[i, : len(c.pages)] = c.pages
        if total:
            h.token_ids[:total] = np.fromiter((tok for c in chunks for tok in c.tokens), dtype=np.int64, count=total)
            req = np.repeat(np.arange(n), lens)
            local = np.arange(total) - starts[req]
            pos = ctx[req] + local
            h.row_req[:total], h.row_local[:total], h.positions[:total] = req, local, pos
            h.slot_mapping[:total] = tables[req, pos // ps] * ps + pos % ps
        pad = t - total
        h.row_req[total:] = r
        h.row_local[total:] = np.arange(pad)
        h.query_starts[:n], h.query_lens[:n], h.kv_lens[:n] = starts, lens, ctx + lens
        h.query_starts[n:] = total
        h.query_lens[r], h.kv_lens[r] = pad, 1
        h.last_rows[:n] = starts + lens - 1
        h.slots[:] = dummy_slot
        h.tail_slots[:] = dummy_slot
        for i, c in enumerate(chunks):
            if c.tail_slot is not None and self.tail_width:
                tail = c.tail[len(c.tail) - self.tail_width :] if len(c.tail) > self.tail_width else c.tail
                h.tail_slots[i], h.tail_end[i] = c.tail_slot, c.tail_end
                if len(tail):
                    h.tail[i, self.tail_width - len(tail) :] = tail
        h.temperature[:] = 1.0
        h.top_p[:] = 1.0
        h.top_k[:] = -1
        for i, c in enumerate(chunks):
            if c.slot is None:
                continue
            h.slots[i], h.draw_pos[i] = c.slot, c.draw_pos
            h.seed_lo[i], h.seed_hi[i], h.top_k[i], h.rule[i] = c.sampling[:4]
            h.temperature[i], h.top_p[i] = c.sampling[4], c.sampling[5]
        if staging.copied is not None:
            self.dev_int.copy_(staging.ints, non_blocking=True)
            self.dev_float.copy_(staging.floats, non_blocking=True)
            staging.copied.record()
            staging.pending = True


class PrefillStep:
    """The prefill of one token bucket for one draw kind: forward, injection, first tokens -> [R] int64."""

    def __init__(self, runner: "PrefillRunner", buffers: PrefillBuffers, sampled: bool, filtered: bool,
                 live_bounds: tuple[int, int] | None = None) -> None:
        self.runner, self.buf, self.sampled, self.filtered = runner, buffers, sampled, filtered
        # Static bounds (graph-safe): the whole bucket; live ones (the portable path) when given
        self.max_q, self.max_kv = live_bounds or (buffers.tokens, buffers.max_pages * buffers.page_size)
        self.kv_splits = runner.kv_splits(buffers.tokens)
        self.call: GraphedCall | None = None

    def step(self) -> torch.Tensor:
        r, buf = self.runner, self.buf
        meta = AttentionMetadata(
            row_req=buf.row_req, row_local=buf.row_local, positions=buf.positions, slot_mapping=buf.slot_mapping,
            kv_lens=buf.kv_lens, block_tables=buf.block_tables, max_q=self.max_q, max_kv=self.max_kv, causal=True,
            query_starts=buf.query_starts, query_lens=buf.query_lens, kv_splits=self.kv_splits)
        logits, features = r.target(buf.token_ids, meta, r.target_caches, buf.last_rows, r.capture_layers)
        if features is not None:
            r.drafter.inject_context(features, buf.positions, buf.slot_mapping, r.drafter_caches)
        rows = SamplingRows(buf.rule == RULE_GREEDY, buf.temperature, buf.top_k, buf.top_p, buf.seed_lo, buf.seed_hi,
                            r.sampling_backend)
        first = target_tokens(logits, rows, buf.draw_pos, self.filtered, self.sampled, with_policy=False)[0]
        state = r.state
        state.anchor.index_copy_(0, buf.slots, first)
        state.ctx.index_copy_(0, buf.slots, buf.kv_lens[: buf.requests])
        if state.history is not None:
            state.history.index_fill_(0, buf.slots, 0.0)
        if buf.tail_width:  # the token ring: position tail_end - R + k sits in column (tail_end + k) % R
            columns = (buf.tail_end[:, None] + torch.arange(buf.tail_width, device=first.device)) % buf.tail_width
            state.tokens.index_put_((buf.tail_slots[:, None].expand(-1, buf.tail_width), columns), buf.tail)
        return first

    def build(self, use_graph: bool, pool=None) -> "PrefillStep":
        if use_graph:
            self.buf.fill([], self.runner.state.dummy)  # NOTE: captured on padding only: no state is touched
        self.call = GraphedCall(self.step, use_graph, pool=pool)
        return self

    def __call__(self) -> torch.Tensor:
        return self.call()


class PrefillRunner:
    """Owns the prefill of one engine: token buckets, their buffers and captured steps, the eager path above
    the largest bucket, and the measured time of each bucket (the chunk budget beside decoding)."""

    def __init__(self, target, drafter, target_caches, drafter_caches, state, *, capture_layers: tuple[int, ...],
                 max_requests: int, max_pages: int, page_size: int, buckets: list[int] | None, pad: bool,
                 use_graphs: bool, device: torch.device, pool=None) -> None:
        self.target, self.drafter = target, drafter
        self.target_caches, self.drafter_caches = target_caches, drafter_caches
        self.state, self.capture_layers = state, capture_layers
        self.tail_width = state.tokens.shape[1] if state.tokens is not None else 0  # the v3 features' token ring
        self.sampling_backend = target.kernels.fused
        self.max_requests, self.max_pages, self.page_size = max_requests, max_pages, page_size
        self.buckets = sorted(buckets) if buckets else []
        self.pad = pad or use_graphs
        self.use_graphs = use_graphs
        self.device = torch.device(device)
        self.pool = pool
        self.slot_counts = slot_variants(max_requests) if self.pad else (max_requests,)
        """The request slots each bucket is captured with (`slot_variants`; at most the bucket's tokens): a prefill
        of n requests replays the smallest variant with at least n."""
        self._variants: dict[int, tuple[int, ...]] = {}  # tokens -> `variants(tokens)`
        self.buffers: dict[tuple[int, int], PrefillBuffers] = {}  # (tokens, request slots) -> buffers
        self.steps: dict[tuple[int, int, bool, bool], PrefillStep] = {}  # (tokens, request slots, sampled, filtered)
        self.bucket_ms: dict[int, tuple[float, float, int]] = {}
        """Each captured bucket's greedy prefill of one request's chunk, measured (`measure`; on the one-request
        variant where there is one): (ms from position 0, ms after a context of `c` keys, c); a chunk after `ctx`
        keys is interpolated between the two (attention grows with the keys)."""
        self.many_ms: dict[int, tuple[float, float, int]] = {}
        """The same chunk on the full bucket (all its request slots): what a prefill of several requests costs at
        most. Equal to `bucket_ms` without one-request variants."""
        self.group_ms: dict[int, dict[int, tuple[float, float, int]]] = {}
        """The same chunk on the variants between (slots -> bucket -> times): what a prefill of up to that many
        requests costs. Where a variant is not measured, the full bucket's times stand for it."""
        self.eager_calls = 0
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 0

    def kv_splits(self, tokens: int) -> int:
        """Key splits of a prefill of `tokens` rows (`AttentionMetadata.kv_splits`, Triton path): sized for one
        busy request, the case where a chunk after a long context would leave most of the GPU idle (requests
        with fewer than 2 x MIN_KEYS_PER_SPLIT keys do not split, on the device); 1 off CUDA."""
        if not self.sm_count or self.target.kernels.attention != "triton":
            return 1
        cfg = self.target.config
        return kv_splits_for(1, tokens, cfg.num_attention_heads, cfg.num_key_value_heads, self.sm_count,
                             tile_rows=self.target.kernels.attention_tile)

    def bucket(self, tokens: int) -> int | None:
        """The smallest bucket holding `tokens`, None above the largest (or without buckets)."""
        if not self.pad:
            return None
        return next((b for b in self.buckets if b >= tokens), None)

    def _full_slots(self, tokens: int) -> int:
        """The request slots of a bucket's full variant."""
        return min(tokens, self.max_requests)

    def variants(self, tokens: int) -> tuple[int, ...]:
        """The request-slot counts a bucket of `tokens` is captured with, ascending (its full count last)."""
        if tokens not in self._variants:  # NOTE: read by every chunk budget beside decoding: computed once a bucket
            self._variants[tokens] = tuple(sorted({min(tokens, r) for r in self.slot_counts}))
        return self._variants[tokens]

    def slots_for(self, tokens: int, n: int) -> int | None:
        """The slots of the bucket's smallest variant that holds `n` requests (None: none does)."""
        return next((r for r in self.variants(tokens) if r >= n), None)

    def get(self, tokens: int, sampled: bool, filtered: bool, slots: int | None = None) -> PrefillStep:
        """The step of a bucket and draw kind on `slots` request slots (default: the full bucket; a count that is
        not one of its variants takes the next larger one); built on first use."""
        slots = self.slots_for(tokens, slots or self.max_requests) or self._full_slots(tokens)
        key = (tokens, slots, sampled, filtered)
        if key not in self.steps:
            if (tokens, slots) not in self.buffers:
                self.buffers[tokens, slots] = PrefillBuffers(tokens, slots, self.max_pages, self.page_size,
                                                             self.device, self.tail_width)
            self.steps[key] = PrefillStep(self, self.buffers[tokens, slots], sampled, filtered).build(
                self.use_graphs, self.pool)
        return self.steps[key]

    def prepare(self, free_pages: int = 0) -> None:
        """Capture every bucket's step of every draw kind, largest first (CUDA graphs, one shared pool), so no
        request waits for a capture or a compile; then time the greedy ones (`bucket_ms`) on pool pages
        1..`free_pages` (all free: their contents are junk after it)."""
        if self.use_graphs:
            collect_garbage(self.device)
        for tokens in reversed(self.buckets):
            for slots in self.variants(tokens):
                for sampled, filtered in KINDS:
                    self.get(tokens, sampled, filtered, slots)
        if self.use_graphs:
            self.measure(free_pages=free_pages)

    def measure(self, reps: int = 5, long_context: int | None = None, free_pages: int = 0) -> None:
        """Median replay time of each bucket's greedy step with every row live: the bucket's tokens from position
        0, then after `long_context` keys (default: as many as the block table holds beside the bucket, at most
        16,384), so a chunk's time is known at any context (`ms_at`). The keys lie on distinct pages, pool pages
        1..`free_pages` in turn (free ones: the step writes them), as a live request's do; with none given, all on
        the scratch page, where a long context's keys stay in the L2 cache and read faster than live ones.
        Each variant of a bucket is timed (`bucket_ms`: the one-request variant where there is one; `many_ms`:
        the full bucket; `group_ms`: the variants between)."""
        span = self.max_pages * self.page_size
        for tokens in self.buckets:
            per = min(tokens, span)  # NOTE: a bucket wider than one request's table is measured over several
            sizes = [per] * (tokens // per) + ([tokens % per] if tokens % per else [])
            long = min(long_context or 16384, span - per)
            full = self._full_slots(tokens)
            for slots in self.variants(tokens):
                step = self.get(tokens, False, False, slots)
                times = []
                for ctx in (0, long):
                    pages = itertools.count()
                    chunks = [PrefillChunk([0] * k, ctx, [1 + next(pages) % free_pages if free_pages else
                                                          SCRATCH_PAGE for _ in range(-(-(ctx + k) // self.page_size))])
                              for k in sizes]
                    step.buf.fill(chunks[:slots], self.state.dummy)
                    step()
                    times.append(float(np.median(cuda_times(step, reps))))
                entry = (times[0], times[1], max(1, long))
                if slots == self.variants(tokens)[0]:  # NOTE: one slot, or the full bucket without variants
                    self.bucket_ms[tokens] = entry
                if slots == full:
                    self.many_ms[tokens] = entry
                elif slots > 1:
                    self.group_ms.setdefault(slots, {})[tokens] = entry

    def _times(self, tokens: int, requests: int) -> tuple[float, float, int]:
        """The measured times of the variant a prefill of `requests` requests replays in the bucket: one request's
        chunk on it (the one-request times where the other tables are not measured)."""
        if requests <= 1 or not self.many_ms:
            return self.bucket_ms[tokens]
        slots = self.slots_for(tokens, requests)
        return self.group_ms.get(slots, {}).get(tokens) or self.many_ms[tokens]

    def _requests(self, many: bool, requests: int | None) -> int:
        """The requests a prefill is priced for: `requests`, else all slots with `many`, else one."""
        return requests if requests is not None else self.max_requests if many else 1

    def ms_at(self, tokens: int, ctx: int, many: bool = False, requests: int | None = None) -> float:
        """Measured time of a bucket's prefill after `ctx` keys (linear in the keys between the two measures); of
        the variant a prefill of `requests` requests replays (with `many` and no count: the full bucket)."""
        short, long, c = self._times(tokens, self._requests(many, requests))
        return short + max(0.0, long - short) * ctx / c

    def floor_ms(self, ctx: int, many: bool = False, requests: int | None = None) -> float:
        """The least a chunk after `ctx` keys may last beside decoding: FLOOR_FACTOR x the cheapest bucket's time."""
        return FLOOR_FACTOR * min(self.ms_at(b, ctx, many, requests) for b in self.bucket_ms)

    def budget(self, limit_ms: float, cap: int, ctx: int = 0, many: bool = False, requests: int | None = None) -> int:
        """The most tokens one prefill after `ctx` keys may take to last at most `limit_ms` (by `bucket_ms`):
        the largest bucket within it, at most `cap`. Where even the smallest bucket takes longer (a large model's
        prefill reads every weight whatever its tokens: at Qwen3-8B shape a 16-token chunk costs about a
        target-only decode step), the limit becomes FLOOR_FACTOR x the cheapest bucket's time: every chunk pays
        that floor, so it takes as many tokens as cost about the same. `requests`: how many requests may share the
        prefill, so each bucket's variant for that many bounds it (`many` without a count: the full buckets; one
        request's chunk runs the one-request variant)."""
        if not self.bucket_ms:
            return cap
        limit = max(limit_ms, self.floor_ms(ctx, many, requests))
        fits = [b for b in self.bucket_ms if self.ms_at(b, ctx, many, requests) <= limit]
        return max(1, min(max(fits, default=min(self.bucket_ms)), cap))

    def run(self, chunks: list[PrefillChunk]) -> torch.Tensor:
        """Prefill the chunks (at most `max_requests`); returns the first-token draws [n] on the device (rows of
        chunks without a draw hold junk)."""
        n = len(chunks)
        total = sum(len(c.tokens) for c in chunks)
        draws = [c for c in chunks if c.slot is not None]
        sampled = any(c.sampling[3] != RULE_GREEDY for c in draws)
        filtered = sampled and any(c.sampling[3] != RULE_GREEDY and (c.sampling[2] > 0 or c.sampling[5] < 1)
                                   for c in draws)
        size = self.bucket(total)
        slots = self.slots_for(size, n) if size is not None else None
        if slots is not None:
            step = self.get(size, sampled, filtered, slots)
        else:  # NOTE: above the largest bucket, or unpadded: the same step, eager, on buffers of this size
            self.eager_calls += 1
            rows = -(-total // ROW_ALIGN) * ROW_ALIGN if self.pad else total
            buffers = PrefillBuffers(rows, n, self.max_pages, self.page_size, self.device, self.tail_width)
            bounds = None if self.pad else (max(len(c.tokens) for c in chunks),
                                            max(c.start + len(c.tokens) for c in chunks))
            step = PrefillStep(self, buffers, sampled, filtered, bounds).build(False)
        step.buf.fill(chunks, self.state.dummy)
        return step()[:n]
