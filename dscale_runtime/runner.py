"""The step runner: the device work of every decode step, in every mode, on fixed per-bucket buffers.

One runner serves target-only decoding (W = 1), DFlash (W = 16, full width) and DScale (the packed budget),
greedy and sampled requests mixed in one batch, traced (features for step observers, full-width retention) or
not. A batch of n live requests runs in the smallest bucket B >= n; the B - n padding requests have no pages of
their own (every table entry is the scratch page), k = 0 in DScale and scratch-page rows otherwise, and their
results are never read. Each bucket owns one `StepBuffers` (inputs at fixed addresses, filled from one host
staging copy per step); each (bucket, `StepKind`) owns one `BucketStep`, a pure tensor function of those
buffers:

    draft   drafter over B x W block rows -> draft tokens (argmax, or drawn from q for sampled-draft rows; a DFlash 2
            drafter's candidate selector walks the slots instead, `models/dflash2.py`)
    decide  features -> predictor -> Algorithm 1 -> flat-pack (DScale), or the full-width layout
    verify  target over the M rows -> target tokens (argmax or keyed draws) -> acceptance (per-row rule)
            -> drafter-cache injection of the accepted rows -> one int64 result row per request

On CUDA each step is captured once as a CUDA graph (all graphs share one memory pool, captured largest bucket
first) and replayed; elsewhere the same function runs eagerly. The host reads one result tensor per step.

Rules per request (the `rule` buffer): 0 greedy (argmax drafts and targets), 1 top-1 drafts with sampled target
tokens (the paper's rule, a coupling: tokens equal target-only sampling), 2 sampled drafts (min(1, p/q)); see
`verify.py`. Random draws are keyed by (request seed, token position, purpose) (`sampling.py`), never by batch
slot, so they survive graphs, padding and batch composition.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.dvl.allocate import allocate, budget_rows
from dscale_runtime.dvl.calibration import calibrated_scores, conditional_scores, identity_knots, pack_unit, unpack_unit
from dscale_runtime.dvl.features import acceptance_features, agreement_features, sampling_features
from dscale_runtime.dvl.pack import PackedBatch, flat_pack, packed_metadata
from dscale_runtime.dvl.predictor import seed_lengths
from dscale_runtime.graphs import GraphedCall, collect_garbage, cuda_times
from dscale_runtime.kv_cache import SCRATCH_PAGE
from dscale_runtime.sampling import DRAFT, Policy, SamplingRows, draft_draws, target_tokens
from dscale_runtime.verify import CandidatePolicy, accept_greedy, accept_rules

RULE_GREEDY, RULE_TOP1, RULE_SAMPLED = 0, 1, 2
MODES = ("target", "dflash", "dscale")


MEASURED_BUCKETS_UP_TO = 64  # the default set below was chosen on step times measured at every N up to here


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 4 up to 64 and every multiple of 8 beyond, capped by and ending at
    `max_batch`. Chosen on the captured step measured at every N = 1 .. 64 in a bucket of exactly N (Qwen3-8B
    shape, H200, docs/benchmarks.md): padding costs 2.8% (DFlash) / 2.3% (DScale) on average, at worst x1.13,
    for 18 graphs per kind, against 6.4% / 3.8% and x1.22 for 1, 2, 4, 8 and multiples of 8 (11 graphs) and
    22% / 14% and x1.85 for powers of two."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(4, min(max_batch, MEASURED_BUCKETS_UP_TO + 1), 4))
    sizes += list(range(MEASURED_BUCKETS_UP_TO + 8, max_batch, 8))
    return sorted({b for b in sizes if b < max_batch}) + [max_batch]


@dataclass(frozen=True)
class StepKind:
    """What one captured step computes (part of its key; chosen per step on the host)."""

    mode: str  # 'target' (W = 1), 'dflash' (full width) or 'dscale' (decision + packed budget)
    sampled: bool = False  # some row samples (policy probabilities and keyed draws are computed)
    filtered: bool = False  # some sampled row uses top-k or top-p (the policy finds its rows' floors)
    draft_sampling: bool = False  # some row uses the sampled-drafts rule (q is computed and drawn from)
    features: bool = False  # return the acceptance features (step observers, DScale's are free)
    retention: bool = False  # DScale: a full-width pass first, for the accepted count it would have had


# Layout of the integer buffer: per-request fields, then the block tables, then the budget M_live. `slot` is the
# request's row of the runner's `DeviceState`; `host` is 1 where the staged anchor / ctx / context are the
# request's current state, 0 where the device state is newer (a step of it launched but not yet committed).
INT_FIELDS = ("anchor", "ctx", "live", "seed_lo", "seed_hi", "top_k", "rule", "slot", "host")
FLOAT_FIELDS = ("temperature", "top_p")
SAMPLING_COLUMNS = 2  # the staged [B, 2] sampling feature columns after the float fields (`sampling_columns`)


class _Staging:
    """One host copy of a bucket's inputs (pinned on CUDA) and the event of its latest host-to-device copy."""

    def __init__(self, n_int: int, n_float: int, pinned: bool) -> None:
        self.ints = torch.zeros(n_int, dtype=torch.long, pin_memory=pinned)
        self.floats = torch.zeros(n_float, dtype=torch.float32, pin_memory=pinned)
        self.np_int, self.np_float = self.ints.numpy(), self.floats.numpy()
        self.copied = torch.cuda.Event() if pinned else None
        self.pending = False


class StepBuffers:
    """Fixed-address inputs of a bucket of `size` requests, filled from host staging by one copy per dtype.

    Device views (each contiguous): anchor / ctx / live / seed_lo / seed_hi / top_k / rule / slot / host [B]
    int64, block_tables [B, max_pages] int64, budget [] int64, temperature / top_p [B] float32, context [B, C].
    On CUDA two pinned stagings alternate: a step is staged while the previous one's copy may still be queued
    behind the running step (the engine launches step t + 1 before it reads step t).

    `max_kv` (max_pages x page_size) is the static key width that captured steps attend over. Eager steps
    (`bounded`: the CPU, or CUDA with graphs off) attend over the live context instead (`kv_width`): the
    portable attention path gathers and masks `max_kv` keys per request, so a static width would make every
    eager step cost max_model_len (issue 24)."""

    def __init__(self, size: int, max_pages: int, num_context: int, page_size: int, device: torch.device,
                 dummy_slot: int = 0, bounded: bool = False) -> None:
        self.size, self.max_pages, self.page_size, self.max_kv = size, max_pages, page_size, max_pages * page_size
        self.num_context, self.dummy_slot, self.bounded = num_context, dummy_slot, bounded
        self.ctx_bound: int | None = None  # host bound of the staged step's longest start ctx (`fill`), if known
        b = size
        self.n_int = size * len(INT_FIELDS) + (size + 1) * max_pages + 1  # NOTE: tables + the scratch row, budget
        self.n_float = size * (len(FLOAT_FIELDS) + SAMPLING_COLUMNS + num_context)
        on_cpu = device.type == "cpu"
        self.stagings = [_Staging(self.n_int, self.n_float, not on_cpu) for _ in range(1 if on_cpu else 2)]
        self._turn = 0
        first = self.stagings[0]
        self.dev_int = first.ints if on_cpu else torch.zeros(self.n_int, dtype=torch.long, device=device)
        self.dev_float = first.floats if on_cpu else torch.zeros(self.n_float, dtype=torch.float32, device=device)
        for i, name in enumerate(INT_FIELDS):
            setattr(self, name, self.dev_int[i * b : (i + 1) * b])
        start = len(INT_FIELDS) * b
        # NOTE: a last row on the scratch page, never written (the packed layout's pseudo request reads it)
        self.tables_with_scratch = self.dev_int[start : start + (b + 1) * max_pages].view(b + 1, max_pages)
        self.block_tables = self.tables_with_scratch[:b]
        self.budget = self.dev_int[-1]
        for i, name in enumerate(FLOAT_FIELDS):
            setattr(self, name, self.dev_float[i * b : (i + 1) * b])
        start = len(FLOAT_FIELDS) * b
        self.sampling_feature = self.dev_float[start : start + b * SAMPLING_COLUMNS].view(b, SAMPLING_COLUMNS)
        self.context = self.dev_float[start + b * SAMPLING_COLUMNS :].view(b, num_context)

    def fill(self, anchors: list[int], ctx: list[int], pages: list[list[int]], sampling: list[tuple],
             budget: int, context: np.ndarray | None, slots: list[int] | None = None,
             host: list[bool] | None = None, ctx_bound: int | None = None) -> None:
        """Stage one step's inputs on the host and copy them to the device (non-blocking from pinned memory).

        sampling[i] = (seed_lo, seed_hi, top_k, rule, temperature, top_p) of request i; slots[i] its row of the
        device state (default: the dummy row) and host[i] whether the staged anchor / ctx / context are current
        (default: all). Padding rows get zeros (temperature 1, top_p 1), the dummy slot and scratch-page tables.
        `ctx_bound` bounds every row's start ctx (the device state's for rows not current on the host): an
        eager step on CUDA attends over that many keys plus its block (`kv_width`); None: all rows current
        on the host give it, else the static `max_kv`."""
        n, b, f = len(anchors), self.size, len(INT_FIELDS)
        if ctx_bound is None and (host is None or all(host)):
            ctx_bound = max(ctx, default=0)
        self.ctx_bound = ctx_bound
        staging = self.stagings[self._turn]
        self._turn = (self._turn + 1) % len(self.stagings)
        if staging.pending:  # NOTE: its previous copy must have left before it is overwritten
            staging.copied.synchronize()
        ints, floats = staging.np_int, staging.np_float
        ints[: f * b + (b + 1) * self.max_pages].fill(0)  # NOTE: SCRATCH_PAGE == 0: padding on scratch
        assert SCRATCH_PAGE == 0
        ints[0:n] = anchors
        ints[b : b + n] = ctx
        ints[2 * b : 2 * b + n] = 1
        floats[0 : 2 * b].fill(1.0)  # NOTE: padding rows' temperature and top_p (an empty batch's too)
        if n:
            cols = np.asarray(sampling, dtype=np.float64)  # [n, 6]
            for i in range(4):
                ints[(3 + i) * b : (3 + i) * b + n] = cols[:, i]
            floats[0:n] = cols[:, 4]
            floats[b : b + n] = cols[:, 5]
        # NOTE: the predictor's sampling columns staged by the host (`sampling_columns`: no launch in the step)
        staged_sampling = floats[len(FLOAT_FIELDS) * b : (len(FLOAT_FIELDS) + SAMPLING_COLUMNS) * b]
        staged_sampling.fill(0.0)
        if n:
            staged_sampling = staged_sampling.reshape(b, SAMPLING_COLUMNS)
            staged_sampling[:n, 0] = np.where(cols[:, 3] == RULE_GREEDY, 0.0, cols[:, 4])
            staged_sampling[:n, 1] = cols[:, 3] == RULE_SAMPLED
        slot, flag = INT_FIELDS.index("slot") * b, INT_FIELDS.index("host") * b
        ints[slot : slot + b] = self.dummy_slot
        if slots is not None:
            ints[slot : slot + n] = slots
        ints[flag : flag + b] = 1
        if host is not None:
            ints[flag : flag + n] = host
        tables = ints[f * b : f * b + b * self.max_pages].reshape(b, self.max_pages)
        for i, table in enumerate(pages):
            tables[i, : len(table)] = table
        ints[-1] = budget
        staged_context = floats[(len(FLOAT_FIELDS) + SAMPLING_COLUMNS) * b :].reshape(b, self.num_context)
        staged_context.fill(0.0)
        if context is not None:
            staged_context[:n] = context
        if staging.copied is not None:
            self.dev_int.copy_(staging.ints, non_blocking=True)
            self.dev_float.copy_(staging.floats, non_blocking=True)
            staging.copied.record()
            staging.pending = True

    def sampling_columns(self, spec) -> torch.Tensor:
        """The feature spec's sampling columns [B, spec.num_sampling] of the staged requests: temperature (0 for
        greedy rows: their staged temperature is a placeholder 1) and whether their drafts are sampled, as
        `sampling_features` defines them; staged by the host with the rest (`fill`), so no launch computes them.
        (A request's parameters never change, so rows a step ahead of the host have theirs too.)"""
        return self.sampling_feature[:, : spec.num_sampling]

    def sampling_columns_ref(self, spec) -> torch.Tensor:
        """`sampling_columns` computed on the device from the staged rule and temperature (the definition)."""
        greedy = self.rule == RULE_GREEDY
        return sampling_features(spec, torch.where(greedy, torch.zeros_like(self.temperature), self.temperature),
                                 self.rule == RULE_SAMPLED)

    def sampling_rows(self, backend: str = "ref") -> SamplingRows:
        return SamplingRows(self.rule == RULE_GREEDY, self.temperature, self.top_k, self.top_p, self.seed_lo,
                            self.seed_hi, backend)

    def kv_width(self, width: int) -> int:
        """The key width (`AttentionMetadata.max_kv`) of a step of `width` rows per request over the resolved
        buffers: the static `max_kv` unless `bounded`; else the longest start ctx plus `width`, rounded up to
        the page size (at most `max_kv`). On the CPU the resolved ctx is read (exact, no synchronisation);
        on CUDA the host's `ctx_bound` is used (reading the device would wait for the step before)."""
        if not self.bounded:
            return self.max_kv
        if self.ctx.device.type == "cpu":
            longest = int(self.ctx.max())
            assert self.ctx_bound is None or longest <= self.ctx_bound, \
                f"a row's device ctx {longest} exceeds the host's bound {self.ctx_bound} (eager CUDA would drop keys)"
        elif self.ctx_bound is not None:
            longest = self.ctx_bound
        else:
            return self.max_kv
        return min(self.max_kv, -(-(longest + width) // self.page_size) * self.page_size)


class DeviceState:
    """Per-request decode state on the device, one row per engine slot (+ a dummy row for padding): the next
    anchor, the context length and (DScale) the request's context-feature history, written by every step from
    its verified results so the next step can start before the host has read them (DESIGN: the overlap
    schedule). Rows: anchor [S + 1], ctx [S + 1], history [S + 1, C] float32 with `context_features`' columns
    2.. (decode steps, history length, most recent accepted counts first); columns 0-1 are rebuilt per step; with
    the v3 features, tokens [S + 1, R]: a ring of each request's last R tokens (`BucketStep.token_window`)."""

    def __init__(self, num_slots: int, num_context: int, device: torch.device, with_history: bool,
                 token_window: int = 0) -> None:
        self.dummy = num_slots
        self.anchor = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
        self.ctx = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
        self.history = torch.zeros(num_slots + 1, num_context, dtype=torch.float32, device=device) if with_history else None
        # v3 features: each request's last `token_window` tokens, the token at position p in column p % token_window
        # (written by the prefill's tail and every step's anchor and accepted drafts; the dummy row takes junk)
        self.tokens = torch.zeros(num_slots + 1, token_window, dtype=torch.long, device=device) if token_window else None

    def start(self, slots: torch.Tensor, anchors: torch.Tensor, ctx: torch.Tensor) -> None:
        """A request's state right after its prefill: anchor = its first generated token, no decode step yet."""
        self.anchor.index_copy_(0, slots, anchors)
        self.ctx.index_copy_(0, slots, ctx)
        if self.history is not None:
            self.history.index_fill_(0, slots, 0.0)


def block_metadata(buf: StepBuffers, width: int, causal: bool, max_kv: int | None = None) -> AttentionMetadata:
    """`width` rows per request right after its context, computed on the device from the buffers (DFlash's
    verification rows or target-only rows when causal, the drafter's block rows when not). `max_kv` bounds
    every request's ctx + width (default: the buffers' static `max_kv`; eager steps pass `kv_width`)."""
    n, device = buf.size, buf.ctx.device
    rows = torch.arange(n * width, device=device)
    row_req, row_local = rows // width, rows % width
    positions = buf.ctx[row_req] + row_local
    pages = buf.block_tables[row_req, positions // buf.page_size]
    return AttentionMetadata(
        row_req=row_req, row_local=row_local, positions=positions,
        slot_mapping=pages * buf.page_size + positions % buf.page_size, kv_lens=buf.ctx + width,
        block_tables=buf.block_tables, max_q=width, max_kv=buf.max_kv if max_kv is None else max_kv, causal=causal,
        query_starts=torch.arange(n, device=device) * width, query_lens=torch.full_like(buf.ctx, width))


@dataclass
class Decision:
    """What the decide part hands to verification."""

    verify_lens: torch.Tensor  # [B] k_i (0 for padding in DScale)
    verify_offsets: torch.Tensor  # [B]
    token_ids: torch.Tensor  # [M] anchor or draft of every verification row
    meta: AttentionMetadata  # causal metadata over the M rows
    features: torch.Tensor | None  # [B, spec.width] float32, when computed
    conditionals: torch.Tensor | None = None  # [B, ceil((W-1) / 4)] int64: DScale's raw conditionals (`pack_unit`)


class BucketStep:
    """One decode step of a bucket for one `StepKind`: `draft` -> `decide` -> `verify`, a pure function of
    the bucket's buffers (see the module docstring); `__call__` runs it (a graph replay once `build` captured
    it) and returns the result [B, 4 + W] int64: accepted, successor, k, full-width accepted (-1 when not
    measured), then the W block tokens (anchor and drafts); DScale steps append the predictor's raw
    conditionals, packed (`dvl/calibration.py`: ceil((W-1) / 4) words)."""

    def __init__(self, runner: "StepRunner", buffers: StepBuffers, kind: StepKind) -> None:
        self.runner, self.buf, self.kind = runner, buffers, kind
        self.width = 1 if kind.mode == "target" else runner.block_size
        b = buffers.size
        self.num_rows = budget_rows(b, self.width, runner.budget_ratio) if kind.mode == "dscale" else self.width * b
        self.call: GraphedCall | None = None
        self.features: torch.Tensor | None = None
        self.block_meta: AttentionMetadata | None = None  # the drafter's block rows of the step being built
        self.max_kv = buffers.max_kv  # key width of the step's metadata: static when captured, else `kv_width`

    # ---- the three parts
    def draft(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, Policy | CandidatePolicy | None]:
        """-> block tokens [B, W] (slot 0 = anchor), draft logits [B, W-1, V] (drafter dtype; DFlash 2: the
        selector's scores [B, W-1, K]), drafter hidden states [B, W-1, d], the drafter's policy q over the
        B x (W-1) draft slots (sampled-draft steps only)."""
        r, buf, kind = self.runner, self.buf, self.kind
        self.block_meta = None
        if kind.mode == "target":
            return buf.anchor.view(-1, 1), None, None, None
        b, w = buf.size, self.width
        if r.decision_backend == "triton":  # NOTE: the block and its metadata in one launch (kernels/triton_step.py)
            from dscale_runtime.kernels.triton_step import block_metadata_triton

            meta, block = block_metadata_triton(buf.ctx, buf.block_tables, buf.page_size, w, False, self.max_kv,
                                                buf.anchor, r.drafter.config.mask_token_id)
        else:
            block = torch.full((b, w), r.drafter.config.mask_token_id, dtype=torch.long, device=buf.ctx.device)
            block[:, 0] = buf.anchor
            meta = block_metadata(buf, w, causal=False, max_kv=self.max_kv)
        self.block_meta = meta
        if r.drafter.config.dflash2 is not None:
            # DFlash 2: the selector's walk gives the drafts (greedy, or drawn from its q for sampled-draft rows),
            # its scores [B, W-1, K] stand for the logits in the features, its sparse q for the drafter's policy.
            draw = uniforms = None
            if kind.draft_sampling:
                draw = buf.rule == RULE_SAMPLED
                positions = buf.ctx[:, None] + torch.arange(1, w, device=block.device)  # [B, W-1] the drafts' indices
                uniforms = buf.sampling_rows(r.sampling_backend).uniforms(positions, DRAFT)
            scores, hidden, q = r.drafter.propose_walk(block, r.target, meta, r.drafter_caches, buf.temperature, draw,
                                                       uniforms)
            return block, scores, hidden, q
        # NOTE: drafts, features and greedy acceptance read the model's dtype directly (an exact upcast away).
        logits, hidden = r.drafter.propose(block, r.target, meta, r.drafter_caches, float_logits=False)
        q = None
        if kind.draft_sampling:
            # NOTE: the drafts land in the block's slots (one launch at small vocabularies: no copy)
            q = draft_draws(logits.reshape(b, w - 1, -1), buf.sampling_rows(r.sampling_backend), buf.ctx,
                            buf.rule == RULE_SAMPLED, kind.filtered, block[:, 1:], out=block[:, 1:])[1]
        return block, logits, hidden, q

    def decide(self, block: torch.Tensor, logits: torch.Tensor | None, hidden: torch.Tensor | None) -> Decision:
        """DVL decision without host reads (DScale) or the full-width layout; features when asked for."""
        r, buf, kind = self.runner, self.buf, self.kind
        b, w = buf.size, self.width
        features = None
        if kind.mode == "dscale" or kind.features:
            features = self.acceptance_features(block, logits, hidden)
        if kind.mode != "dscale":
            meta = self.full_width_metadata()  # NOTE: its query bounds are the full-width lens and offsets
            return Decision(meta.query_lens, meta.query_starts, block.reshape(-1), meta, features)
        if r.decision_backend == "triton":
            # NOTE: the artifact's calibration (if any), the raw conditionals packed for the host and the live map's
            # scores in one launch (the reference's ~30, ~55 with an artifact map), then the allocation and the flat
            # pack with its metadata columns in two (the reference's ~70)
            from dscale_runtime.kernels.triton_pack import allocate_triton, flat_pack_triton
            from dscale_runtime.kernels.triton_step import conditionals_triton

            predictor = r.predictor
            art = predictor.band_knots(features) if predictor.calibration_knots is not None else None
            scores = predictor.uncalibrated_scores(features)  # NOTE: `scores` itself when the artifact has no map
            packed_conditionals, scores = conditionals_triton(scores.contiguous(), r.calibration_knots, art)
            lens = allocate_triton(scores.float().contiguous(), buf.live, buf.budget, w)
            fields, query_lens, query_starts, kv_lens = flat_pack_triton(lens, block, buf.ctx, buf.block_tables,
                                                                         self.num_rows, buf.page_size)
            packed = PackedBatch(**fields)
        else:
            scores = r.predictor.scores(features)  # [B, W-1]
            conditionals = conditional_scores(scores)  # [B, W-1] the raw map inputs, returned to the host's watch
            packed_conditionals = pack_unit(conditionals)
            if r.calibration_knots is not None:  # NOTE: the live map, a fixed-address tensor the host rewrites
                scores = calibrated_scores(conditionals, r.calibration_knots)
            lens = allocate(scores, seed_lengths(scores, w), buf.live > 0, buf.budget)
            packed = flat_pack(lens, block, buf.ctx, buf.block_tables, self.num_rows, buf.page_size)
            live_rows, kv_lens = lens.sum().view(1), None
            query_lens = torch.cat([lens, self.num_rows - live_rows])
            query_starts = torch.cat([packed.verify_offsets, live_rows])
        # NOTE: max_q = W bounds the live requests; placeholders (num_rows > M_live) share local slots up to W - 1
        # (flat_pack), and the Triton kernels skip pseudo-request rows past W: their outputs are never read.
        meta = packed_metadata(packed, buf.ctx, buf.tables_with_scratch, self.max_kv, w, kv_lens)
        meta.query_lens, meta.query_starts = query_lens, query_starts
        return Decision(lens, packed.verify_offsets, packed.token_ids, meta, features, packed_conditionals)

    def _accept(self, logits: torch.Tensor, meta: AttentionMetadata, block: torch.Tensor, q: Policy | None,
                lens: torch.Tensor, offsets: torch.Tensor,
                top1: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Accepted drafts [B] and successors [B] of one verification forward, each request by its rule, and the
        rows' target tokens [M]. `top1` False: where no row samples its drafts, the counts are left to the
        caller (None, None; `kernels/triton_step.accept_triton` applies the top-1 rule to the tokens)."""
        buf, kind = self.buf, self.kind
        b = buf.size
        rows = buf.sampling_rows(self.runner.sampling_backend)
        # Row at position p predicts the token at index p + 1: that index keys its draw. Rows past the live
        # requests (DScale's placeholders) read the last request's parameters; their tokens are never read.
        tokens, policy = target_tokens(logits, rows, meta.positions, kind.filtered, kind.sampled, index=meta.row_req,
                                       max_index=b - 1, offset=1, with_policy=kind.draft_sampling)
        if not (top1 or kind.draft_sampling):
            return None, None, tokens
        if kind.draft_sampling:
            accepted, successor = accept_rules(policy, q, block, tokens, lens, offsets, buf.rule, RULE_SAMPLED, rows,
                                               buf.ctx)
        else:
            accepted, successor = accept_greedy(tokens, block, lens, offsets)
        return accepted, successor, tokens

    def verify(self, block: torch.Tensor, q: Policy | None, decision: Decision) -> torch.Tensor:
        """Target forward over the M rows, acceptance, drafter-cache injection -> the result [B, 4 + W]."""
        r, buf, kind = self.runner, self.buf, self.kind
        b, w = buf.size, self.width
        full_accepted = None  # NOTE: -1 in the result unless measured
        if kind.retention:
            # Full-width verification first, only to measure what DVL keeps: the same draws decide it, and the
            # packed pass below rewrites the K/V it shares with it.
            meta = self.full_width_metadata()
            logits, _ = r.target(block.reshape(-1), meta, r.target_caches, None, (), float_logits=False)
            full_accepted = self._accept(logits, meta, block, q, meta.query_lens, meta.query_starts)[0]
        meta, lens, offsets = decision.meta, decision.verify_lens, decision.verify_offsets
        # NOTE: a speculative runner's target-only steps leave the drafter's context to the engine
        # (`StepRunner.defer_context`): it is written, in one prefill-shaped forward, only before a speculative step
        layers = r.capture_layers if kind.mode != "target" or not r.defer_context else ()
        logits, features = r.target(decision.token_ids, meta, r.target_caches, None, layers, float_logits=False)
        fused = r.decision_backend == "triton"
        accepted, successor, tokens = self._accept(logits, meta, block, q, lens, offsets, top1=not fused)
        if fused:
            # NOTE: acceptance, the drafter's kept slots and the result row in one launch (the reference's ~30)
            from dscale_runtime.kernels.triton_step import accept_triton

            result, kept = accept_triton(tokens, block, lens, offsets, buf.live, meta, buf.page_size,
                                         keep=features is not None,
                                         given=None if accepted is None else (accepted, successor),
                                         full_accepted=full_accepted,
                                         extra=decision.conditionals)
            if features is not None:
                r.drafter.inject_context(features, meta.positions, kept, r.drafter_caches, meta.rope)
            return result
        if features is not None:
            req = meta.row_req.clamp(max=b - 1)
            keep = (meta.row_req < b) & (meta.row_local <= accepted[req]) & (buf.live[req] > 0)
            scratch = torch.full_like(meta.slot_mapping, SCRATCH_PAGE * buf.page_size)
            r.drafter.inject_context(features, meta.positions, torch.where(keep, meta.slot_mapping, scratch),
                                     r.drafter_caches, meta.rope)
        if full_accepted is None:
            full_accepted = torch.full_like(buf.ctx, -1)
        parts = [torch.stack([accepted, successor, lens, full_accepted], dim=1), block]
        return torch.cat(parts + ([decision.conditionals] if decision.conditionals is not None else []), dim=1)

    def full_width_metadata(self) -> AttentionMetadata:
        """Causal metadata over every request's W rows: the drafter's block rows' (same positions, slots and
        lengths), causal, sharing their RoPE tables; built anew in target-only steps (W = 1)."""
        if self.block_meta is not None:
            return dataclasses.replace(self.block_meta, causal=True)
        if self.runner.decision_backend == "triton":  # NOTE: one launch (kernels/triton_step.py)
            from dscale_runtime.kernels.triton_step import block_metadata_triton

            buf = self.buf
            return block_metadata_triton(buf.ctx, buf.block_tables, buf.page_size, self.width, True, self.max_kv)[0]
        return block_metadata(self.buf, self.width, causal=True, max_kv=self.max_kv)

    def acceptance_features(self, block: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor,
                            backend: str | None = None) -> torch.Tensor:
        """The feature rows [B, spec.width] of the drafted block (`dvl.features`; the v3 agreement columns read the
        token ring); `backend`: the confidence and agreement columns' path (default: the runner's, each its own)."""
        r, buf = self.runner, self.buf
        spec = r.feature_spec
        if spec.num_agreement and r.state.tokens is None:
            raise RuntimeError(f"{spec.version} features read the request's recent tokens, which this runner does not "
                               "keep: build the engine with trace_features=True (or the runner with token_ring=True)")
        agreement = None
        if spec.num_agreement:
            ring = r.state.tokens
            if (backend or r.decision_backend) == "triton":
                from dscale_runtime.kernels.triton_agreement import agreement_columns_triton

                # NOTE: one launch from the ring (the reference's ~50; exactly its columns): block[:, 0] = the anchor
                agreement = agreement_columns_triton(ring, buf.slot, buf.ctx, block, spec.agreement_ngram,
                                                     spec.agreement_lookup)
            else:
                agreement = agreement_features(spec, *self.token_window(), block)
        return acceptance_features(spec, logits, hidden, r.projection, buf.context, backend or r.features_backend,
                                   buf.sampling_columns(spec), agreement)

    def token_window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's tokens at positions ctx - R + 1 .. ctx from the device state's ring (the anchor last,
        from the buffers) -> (tokens [B, R] int64, valid [B, R]: False before the sequence's start)."""
        buf, ring = self.buf, self.runner.state.tokens
        r = ring.shape[1]
        positions = buf.ctx[:, None] + torch.arange(1 - r, 1, device=ring.device)  # [B, R]
        tokens = ring[buf.slot].gather(1, positions % r)
        return torch.cat([tokens[:, :-1], buf.anchor[:, None]], dim=1), positions >= 0

    # ---- the device state around the parts
    def resolve(self) -> None:
        """Rows whose `host` flag is 0 take anchor, ctx and context from the device state (the results of a step
        the host has not read yet); the others keep what the host staged."""
        buf, state = self.buf, self.runner.state
        if self.runner.decision_backend == "triton":  # NOTE: one launch (kernels/triton_state.py)
            from dscale_runtime.kernels.triton_state import resolve_triton

            resolve_triton(buf.anchor, buf.ctx, buf.context, buf.host, buf.slot, buf.live, state.anchor, state.ctx,
                           state.history)
            return
        ahead = buf.host == 0
        buf.anchor.copy_(torch.where(ahead, state.anchor[buf.slot], buf.anchor))
        buf.ctx.copy_(torch.where(ahead, state.ctx[buf.slot], buf.ctx))
        if state.history is not None:
            row = state.history[buf.slot]
            row[:, 0] = buf.live.sum().float()  # the batch's live requests, as `context_features` counts them
            row[:, 1] = buf.ctx.float()
            buf.context.copy_(torch.where(ahead[:, None], row, buf.context))

    def advance(self, accepted: torch.Tensor, successor: torch.Tensor, block: torch.Tensor) -> None:
        """Write each request's next state (anchor = successor, ctx + accepted + 1, one more history entry, and
        the anchor and accepted drafts of `block` [B, W] into the token ring)."""
        buf, state = self.buf, self.runner.state
        if self.runner.decision_backend == "triton":  # NOTE: one launch (kernels/triton_state.py)
            from dscale_runtime.kernels.triton_state import advance_triton

            advance_triton(accepted, successor, block, buf.slot, buf.ctx, buf.context, state.anchor, state.ctx,
                           state.history, state.tokens, state.dummy)
            return
        if state.tokens is not None:
            slots = torch.arange(block.shape[1], device=block.device)
            rows = torch.where(slots <= accepted[:, None], buf.slot[:, None], state.dummy)  # the rest: the dummy row
            state.tokens.index_put_((rows, (buf.ctx[:, None] + slots) % state.tokens.shape[1]), block)
        state.anchor.index_copy_(0, buf.slot, successor)
        state.ctx.index_copy_(0, buf.slot, buf.ctx + accepted + 1)
        if state.history is not None:
            old, history = buf.context, torch.zeros_like(buf.context)
            history[:, 2] = old[:, 2] + 1
            history[:, 3] = (old[:, 3] + 1).clamp(max=old.shape[1] - 4)
            if old.shape[1] > 4:
                history[:, 4] = accepted.float()
                history[:, 5:] = old[:, 4:-1]
            state.history.index_copy_(0, buf.slot, history)

    # ---- running
    def step(self) -> torch.Tensor:
        self.resolve()
        self.max_kv = self.buf.kv_width(self.width)  # NOTE: the static max_kv under graphs (no host read)
        block, logits, hidden, q = self.draft()
        decision = self.decide(block, logits, hidden)
        result = self.verify(block, q, decision)
        self.advance(result[:, 0], result[:, 1], block)
        self.features = decision.features if self.kind.features else None
        return result

    def timed_ms(self, context: int, reps: int, warmup: int = 2) -> float:
        """The median device time (ms, CUDA events) of `reps` replays after `warmup` more, every row a live greedy
        request at `context` tokens with all its pages on the scratch page: the start-up timings' setting
        (`StepRunner.measure_policy`, `Engine._time_decode_steps`)."""
        size = self.buf.size
        self.buf.fill([0] * size, [context] * size, [], [(0, 0, -1, RULE_GREEDY, 1.0, 1.0)] * size, self.num_rows,
                      None)
        for _ in range(warmup):
            self()
        return float(np.median(cuda_times(self, reps)))

    def build(self, use_graph: bool, pool=None) -> "BucketStep":
        """Capture the step (on CUDA) or prepare eager runs. Capture runs the step a few times: on padding rows
        only (the scratch page, the dummy slot), so that a step built while requests run never advances
        their device state."""
        if use_graph:
            self.buf.fill([], [], [], [], 0, None)
        self.call = GraphedCall(self.step, use_graph, pool=pool)
        return self

    def __call__(self) -> torch.Tensor:
        return self.call()


def agreed_values(values: list[float], device: torch.device, op: str = "max") -> list[float]:
    """Under tensor parallelism (a process group of more than one rank) the ranks' elementwise maximum or minimum of
    `values`, on every rank; else `values`. Every scheduling input measured per rank (a step time, the memory
    left for the KV pool) goes through it, so that the ranks, which schedule alike without talking (SPMD), decide
    alike."""
    import torch.distributed as dist

    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return tensor.tolist()


def _agreed(times: dict[str, float], device: torch.device) -> dict[str, float]:
    """Under tensor parallelism every rank must pick the same steps: each time becomes the ranks' maximum."""
    return dict(zip(times, agreed_values(list(times.values()), device)))


@dataclass
class StepResult:
    """One step's results on the host (live requests only)."""

    accepted: list[int]
    successors: list[int]
    verify_lens: list[int]
    full_accepted: list[int] | None
    drafts: list[list[int]]  # [n][W] anchor + drafts of each request
    num_rows: int  # M_live
    features: torch.Tensor | None  # [n, spec.width] float32 on the CPU (traced steps)
    # NOTE: a timing, not a result: two runs of one step decode the same whatever their times (compare=False)
    device_ms: float | None = field(default=None, compare=False)  # CUDA events around replay + result copy (CPU: wall)
    conditionals: np.ndarray | None = None  # [n, W-1] DScale steps: the predictor's raw conditionals (15-bit)
    waited_ms: float = field(default=0.0, compare=False)  # host time blocked on the device for this step's results

    def __eq__(self, other) -> bool:
        """Field by field, arrays and tensors element by element (exactly): the generated `__eq__` would ask an
        array for one truth value and raise."""
        if not isinstance(other, StepResult):
            return NotImplemented
        for f in dataclasses.fields(self):
            if not f.compare:
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, (np.ndarray, torch.Tensor)) or isinstance(b, (np.ndarray, torch.Tensor)):
                if a is None or b is None or type(a) is not type(b) or tuple(a.shape) != tuple(b.shape):
                    return False
                if not bool((a == b).all()):
                    return False
            elif a != b:
                return False
        return True


class StepRunner:
    """Owns every decode step of one engine: buckets, their buffers and steps, capture, replay, host reads."""

    DEFER_CONTEXT = True
    """Whether a speculative runner's target-only steps leave the drafter's context to the engine (`defer_context`);
    a benchmark sets it off around an engine's construction to time the steps that write it."""

    def __init__(self, target, drafter, target_caches, drafter_caches, *, mode: str, block_size: int,
                 max_batch: int, max_pages: int, page_size: int, budget_ratio: float, full_width_max_batch: int,
                 feature_spec, predictor=None, projection=None, buckets: list[int] | None = None,
                 use_graphs: bool = False, device: torch.device | str = "cpu", measured_policy: bool = False,
                 policy_context: int = 1024, target_fallback: bool = False, live_policy: bool = False,
                 calibration: bool = False, token_ring: bool = True, traced: bool = False) -> None:
        assert mode in MODES
        self.target, self.drafter = target, drafter
        self.target_caches, self.drafter_caches = target_caches, drafter_caches
        self.mode, self.block_size = mode, (1 if mode == "target" else block_size)
        self.budget_ratio, self.full_width_max_batch = budget_ratio, full_width_max_batch
        self.feature_spec, self.predictor, self.projection = feature_spec, predictor, projection
        self.capture_layers = tuple(drafter.config.target_layer_ids) if drafter is not None and mode != "target" else ()
        # Target-only steps of a speculative runner (the target fallback's) skip the drafter's context: their
        # captures and context writes were 1.4-5% of such a step on the demo pair (an H100, 2026-12-06), and most of
        # those positions are never drafted from; the engine writes what a speculative step will read just before it
        # (`Engine._catch_up_context`). Read when a step is built (`DEFER_CONTEXT` off: the steps write it as before).
        self.defer_context = self.DEFER_CONTEXT and bool(self.capture_layers)
        # NOTE: the confidence-feature path was chosen once with the drafter's kernels (its logits' device/dtype);
        # DFlash 2's features read K selector scores per slot instead of V logits: the same two launches (one
        # chunk per row) where the reference takes about a dozen small ones
        self.features_backend = drafter.kernels.features if drafter is not None else "ref"
        # The step's index work (KernelChoice.decision; a target-only runner takes the target's): metadata,
        # acceptance and result rows, resolve and advance, DScale's agreement columns, conditionals, allocation and
        # flat pack ('triton': one launch each); an attribute, so a test or benchmark may set it before the steps
        # are built
        self.decision_backend = (drafter if drafter is not None else target).kernels.decision
        self.sampling_backend = target.kernels.fused  # the sampler's kernels: chunk sums, draws, inverse CDF
        self.device = torch.device(device)
        self.buckets = sorted(buckets) if buckets else default_buckets(max_batch)
        if self.buckets[-1] < max_batch or self.buckets[0] < 1:
            raise ValueError(f"graph buckets {self.buckets} must be >= 1 and reach max_running_requests={max_batch}")
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(self.buckets[-1] + 1)]
        self.max_pages, self.page_size = max_pages, page_size
        self.use_graphs = use_graphs
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.buffers: dict[int, StepBuffers] = {}
        self.steps: dict[tuple[int, StepKind], BucketStep] = {}
        self.last_key: tuple[int, StepKind] | None = None  # the (bucket, kind) of the latest step
        # DScale's measured policy (`prepare` with graphs): bucket -> 'dscale' or 'dflash', and the step times
        # NOTE: the token ring only where the v3 features can be computed (speculative steps) and are wanted
        # (`token_ring`: the engine's DScale steps, or traced DFlash steps)
        self.token_ring = feature_spec.agreement_window if (feature_spec.num_agreement and mode != "target"
                                                            and token_ring) else 0
        self.traced = traced  # NOTE: DFlash steps whose features are read (the collector's): they keep the ring
        self.state = DeviceState(max_batch, feature_spec.num_context, self.device, with_history=mode == "dscale",
                                 token_window=self.token_ring)
        # Launched steps of each device-state row whose results the host has not read yet (`PendingStep.result`):
        # each may have advanced the row's ctx by up to a block, the bound of eager steps' keys (`launch`).
        self.unread = np.zeros(max_batch + 1, dtype=np.int64)
        self.measured_policy = measured_policy and mode == "dscale" and use_graphs
        # The engine may switch a bucket between its DFlash and DScale steps by live acceptance (`live_modes`).
        self.live_policy = live_policy and self.measured_policy
        # Target-only steps beside the speculative ones (the engine switches a bucket to them while live
        # acceptance says speculation cannot pay): captured and timed at start-up too.
        self.target_fallback = target_fallback and mode != "target" and use_graphs
        self.policy_context = policy_context
        self.bucket_modes: dict[int, str] = {}
        self.policy_ms: dict[int, dict[str, float]] = {}
        self.policy_steps_served = True
        """Whether `policy_ms` timed the graphs that are served (False once `measure_policy` dropped them)."""
        # DScale's live calibration map (`dvl/calibration.py`), [W-1, K+1] at a fixed address, identity at start;
        # `write_calibration` rewrites it in place (stream-ordered: steps launched later read the new map).
        self.calibration_knots = identity_knots(self.block_size - 1).to(self.device) \
            if calibration and mode == "dscale" else None
        on_cuda = self.device.type == "cuda"
        self._knots_staging = torch.zeros(self.calibration_knots.shape, pin_memory=on_cuda) \
            if self.calibration_knots is not None else None
        self._knots_copied = torch.cuda.Event() if on_cuda and self.calibration_knots is not None else None

    def write_calibration(self, knots: np.ndarray) -> None:
        """Rewrite the live calibration map in place ([W-1, K+1] knot values; a non-blocking copy on CUDA)."""
        assert self.calibration_knots is not None and knots.shape == tuple(self.calibration_knots.shape)
        if self._knots_copied is not None:
            self._knots_copied.synchronize()  # NOTE: the previous copy has left the staging before it changes
        self._knots_staging.copy_(torch.from_numpy(knots))
        self.calibration_knots.copy_(self._knots_staging, non_blocking=True)
        if self._knots_copied is not None:
            self._knots_copied.record()

    def bucket(self, n: int) -> int:
        """The smallest bucket of at least n rows (a table lookup: several calls per decode step)."""
        if n >= len(self._bucket_of):
            raise ValueError(f"a batch of {n} requests exceeds the largest step bucket, {self.buckets[-1]}")
        return self._bucket_of[n]

    def mode_for(self, n: int) -> str:
        """The step a batch of n live requests runs: DScale's decision, or full width (DFlash, DScale at or
        below `full_width_max_batch`, and DScale in a bucket where the measured policy found the DFlash step
        faster), or the target alone."""
        if self.mode == "dscale" and n <= self.full_width_max_batch:
            return "dflash"
        if self.mode == "dscale" and self.bucket_modes:
            return self.bucket_modes[self.bucket(n)]
        return self.mode

    def live_modes(self, n: int) -> list[str]:
        """The steps the engine may choose among by live acceptance for a batch of n (each timed at start-up,
        `policy_ms`): `mode_for(n)`'s, DFlash and DScale both with the live policy in a bucket where DScale
        may decide, and the target-only step with the target fallback."""
        times = self.policy_ms.get(self.bucket(n), {})
        static = self.mode_for(n)
        if static not in times:
            return [static]
        modes = [static]
        if (self.live_policy and self.state.history is not None and n > self.full_width_max_batch
                and "dflash" in times and "dscale" in times):
            modes = ["dflash", "dscale"]
        if self.target_fallback and "target" in times and static != "target":
            modes.append("target")
        return modes

    def _buffers(self, size: int) -> StepBuffers:
        if size not in self.buffers:
            self.buffers[size] = StepBuffers(size, self.max_pages, self.feature_spec.num_context, self.page_size,
                                             self.device, dummy_slot=self.state.dummy, bounded=not self.use_graphs)
        return self.buffers[size]

    def get(self, size: int, kind: StepKind) -> BucketStep:
        """The (built, on CUDA captured) step of a bucket and kind; built on first use."""
        key = (size, kind)
        if key not in self.steps:
            if kind.mode == "dscale" and (self.predictor is None or self.projection is None):
                raise RuntimeError("dscale steps need the predictor and its hidden projection")
            self.steps[key] = BucketStep(self, self._buffers(size), kind).build(self.use_graphs, self.pool)
        return self.steps[key]

    def prepare(self, kinds: list[StepKind]) -> None:
        """Build (capture, on CUDA) every step a batch can need for the given kinds (their `mode` is replaced by
        each bucket's own), largest bucket first: one shared pool, sized by the largest graph, and no request
        waits for a capture. With the measured policy or the target fallback, every bucket's greedy steps of
        the modes it may run are captured and timed first (`measure_policy`), and the other kinds only for
        the modes the policy can pick."""
        if self.use_graphs:
            collect_garbage(self.device)
        if self.measured_policy or self.target_fallback:
            if self.measured_policy:
                self.bucket_modes = {}
            for size in reversed(self.buckets):
                for mode in self._timed_modes(size):
                    self.get(size, StepKind(mode))
            self.measure_policy()
        for i in reversed(range(len(self.buckets))):
            size, smallest = self.buckets[i], self.buckets[i - 1] + 1 if i else 1
            modes = {m for n in range(smallest, size + 1) for m in (self.mode_for(n), *self.live_modes(n))}
            modes |= {"target"} if self.target_fallback else set()
            for mode in sorted(modes):
                for kind in kinds:
                    self.get(size, dataclasses.replace(kind, mode=mode,
                                                       draft_sampling=kind.draft_sampling and mode != "target"))

    def _timed_modes(self, size: int) -> list[str]:
        """The greedy steps `measure_policy` times in a bucket: DFlash and DScale where DScale's policy chooses,
        else the bucket's own step; and the target-only step for the fallback."""
        if self.measured_policy and size > self.full_width_max_batch:
            return ["dflash", "dscale"] + (["target"] if self.target_fallback else [])
        return [self.mode_for(size), "target"] if self.target_fallback else []

    @property
    def timing_context(self) -> int:
        """The context length of the start-up step timings' rows: `policy_context`, within the pages a row has."""
        return max(1, min(self.policy_context, self.max_pages * self.page_size - 2 * self.block_size))

    def measure_policy(self, reps: int = 7) -> None:
        """Replay each bucket's captured greedy steps (`_timed_modes`) with every request live at
        `policy_context` tokens (all pages on the scratch page), the median of `reps` timed replays each
        (`policy_ms`). DScale's measured policy keeps the decision only in buckets where its step is faster."""
        assert self.use_graphs
        for size in self.buckets:
            times = {}
            for mode in self._timed_modes(size):
                times[mode] = self.get(size, StepKind(mode)).timed_ms(self.timing_context, reps)
            if not times:
                continue
            times = _agreed(times, self.device)
            self.policy_ms[size] = times
            if self.measured_policy and "dscale" in times:
                self.bucket_modes[size] = "dscale" if times["dscale"] <= times["dflash"] else "dflash"
        if not self.measured_policy:
            return
        for size in self.buckets:
            self.bucket_modes.setdefault(size, "dflash")
        if "dscale" not in self.bucket_modes.values():
            # No bucket decides: the engine is a DFlash engine. Its steps need no context-feature history and
            # (untraced) no token ring, so the measured graphs are dropped and recaptured without them (`prepare`
            # captures what is served; the engine builds its prefill after this, without the ring's tails). While
            # it kept the ring (a few launches per step and prefill), the served default trailed the DFlash server
            # by 2-4% at every point of a paired sweep (docs/benchmarks.md, 2026-12-04).
            self.state.history = None
            if not self.traced:
                self.state.tokens, self.token_ring = None, 0
            self.steps.clear()
            self.pool = torch.cuda.graph_pool_handle()  # NOTE: the old pool goes with its last graph
            self.policy_steps_served = False

    def launch(self, anchors: list[int], ctx: list[int], pages: list[list[int]], sampling: list[tuple],
               kind: StepKind, context: np.ndarray | None = None, slots: list[int] | None = None,
               host: list[bool] | None = None) -> "PendingStep":
        """Start one decode step of n live requests (`kind.mode` from `mode_for(n)`): fill, replay, and queue the
        copy of its results to the host; `PendingStep.result()` reads them. Rows with host[i] false start from
        the device state of slots[i] (the request's previous step, launched but not read).

        Eager steps attend over the live context: a row current on the host starts at ctx[i]; one that is not
        starts at most a block per launched, unread step of its slot past ctx[i], its length on the host (which
        counts every step the host has read; `DeviceState.start` writes that length)."""
        n = len(anchors)
        size = self.bucket(n)
        step = self.get(size, kind)
        self.last_key = (size, kind)
        rows = budget_rows(n, self.block_size, self.budget_ratio) if kind.mode == "dscale" else step.width * n
        bound, unread = None, None
        if not self.use_graphs:
            read = np.asarray(slots if slots is not None else [self.state.dummy] * n, dtype=np.int64)
            ahead = 0 if host is None else self.unread[read] * ~np.asarray(host, dtype=bool)
            bound = int((np.asarray(ctx, dtype=np.int64) + ahead * self.block_size).max(initial=0))
            unread = (self.unread, read)
        on_cuda = self.device.type == "cuda"
        wall = time.perf_counter()
        step.buf.fill(anchors, ctx, pages, sampling, rows, context, slots, host, bound)
        # NOTE: stream-ordered, recorded after the host staging and right before the replay: the start event fires
        # when the device reaches the step, so the host's staging time (which an event recorded before `fill` counts
        # whenever the device waits for the host) stays out of the step's device time
        started = torch.cuda.Event(enable_timing=True) if on_cuda else None
        if started is not None:
            started.record()
        result = step()
        if unread is not None:
            np.add.at(self.unread, unread[1], 1)
        features = step.features[:n].float() if step.features is not None else None
        out = AsyncRead(result, timing=on_cuda)
        return PendingStep(n, rows, kind, out, AsyncRead(features) if features is not None else None, unread,
                           started if on_cuda else 1000 * (time.perf_counter() - wall), step.width)

    def run(self, anchors: list[int], ctx: list[int], pages: list[list[int]], sampling: list[tuple],
            kind: StepKind, context: np.ndarray | None = None) -> StepResult:
        """One decode step, its results read at once (`launch` + `result`)."""
        return self.launch(anchors, ctx, pages, sampling, kind, context).result()


class AsyncRead:
    """A device tensor's copy to the host, queued now (pinned memory, non-blocking) and waited for by `get()`;
    on the CPU the tensor itself (an eager step's outputs are fresh tensors)."""

    def __init__(self, tensor: torch.Tensor, timing: bool = False) -> None:
        self.waited_ms = 0.0
        """Host time `get()` spent waiting for the device (the engine's host-cost estimate leaves it out)."""
        if tensor.device.type == "cpu":
            self.host, self.done = tensor, None
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.done = torch.cuda.Event(enable_timing=timing)
        self.done.record()

    def get(self) -> torch.Tensor:
        if self.done is not None and not self.done.query():
            start = time.perf_counter()
            self.done.synchronize()
            self.waited_ms += (time.perf_counter() - start) * 1e3
        return self.host


@dataclass
class PendingStep:
    """A launched step whose results are on their way to the host."""

    num_live: int
    num_rows: int
    kind: StepKind
    out: AsyncRead
    features: AsyncRead | None
    unread: tuple[np.ndarray, np.ndarray] | None = None  # (the runner's unread counts, this step's slots)
    started: "torch.cuda.Event | float | None" = None  # CUDA: the event before the step's replay; CPU: its wall ms
    width: int | None = None  # W of the step's block (None: the rest of the result row)

    def result(self) -> StepResult:
        n = self.num_live
        rows = self.out.get()[:n]  # NOTE: the one device-to-host read of the step
        host = rows.tolist()
        w = self.width if self.width is not None else rows.shape[1] - 4
        conditionals = unpack_unit(rows[:, 4 + w:].numpy(), w - 1) if self.kind.mode == "dscale" else None
        device_ms = self.started.elapsed_time(self.out.done) if isinstance(self.started, torch.cuda.Event) \
            else self.started
        if self.unread is not None:
            counts, slots = self.unread
            np.subtract.at(counts, slots, 1)
            self.unread = None
        features = self.features.get() if self.features is not None else None
        retention = self.kind.retention
        waited = self.out.waited_ms + (self.features.waited_ms if self.features is not None else 0.0)
        return StepResult([h[0] for h in host], [h[1] for h in host], [h[2] for h in host],
                          [h[3] for h in host] if retention else None, [h[4 : 4 + w] for h in host], self.num_rows,
                          features, device_ms, conditionals, waited)
