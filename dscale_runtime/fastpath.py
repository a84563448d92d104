"""The decode step on fixed-address buffers, runnable eagerly or as CUDA-graph replays (DESIGN 3.4, 3.6).

`StepWorkspace` holds a bucket's inputs (anchors, committed lengths, page tables, host-built batch context,
the budget M_live as a device scalar); `DecodeStep` splits the step into three parts that each read only
the workspace and the previous part's outputs: draft (drafter over N x W block rows, draft logits),
decide (features -> predictor -> Algorithm 1 -> flat-pack, DScale only) and verify (target over the M
packed rows, greedy prefix acceptance, drafter-cache injection of the accepted rows). Every part is a
pure tensor function without host reads, so `GraphedCall` can capture it once and replay it; on the CPU,
or with graphs off, the same functions run eagerly (the oracle the graph tests compare against).

NOTE: the engine's `_decide` passes the budget as a Python int, which `allocate` turns into a device
tensor with a blocking host copy; here the budget is a device scalar, so the decision can be captured.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass

import torch

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.dvl.allocate import allocate
from dscale_runtime.dvl.features import FeatureSpec, acceptance_features
from dscale_runtime.dvl.pack import PackedBatch, flat_pack, packed_metadata
from dscale_runtime.dvl.predictor import AcceptancePredictor, seed_lengths
from dscale_runtime.kv_cache import SCRATCH_PAGE
from dscale_runtime.verify import accept_greedy


@contextlib.contextmanager
def attention_path(backend: str | None, tile_rows: int | None):
    """Set DSCALE_ATTENTION / DSCALE_ATTENTION_TILE for the calls (and captures) inside the block."""
    saved = {k: os.environ.get(k) for k in ("DSCALE_ATTENTION", "DSCALE_ATTENTION_TILE")}
    for key, value in (("DSCALE_ATTENTION", backend), ("DSCALE_ATTENTION_TILE", tile_rows)):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class GraphedCall:
    """`fn()` -> outputs, captured once as a CUDA graph (after `warmup` eager calls on a side stream) and
    replayed by `__call__`; with `use_graph=False` every call runs `fn` eagerly. Inputs are whatever
    fixed-address tensors `fn` reads; outputs keep their addresses across replays."""

    def __init__(self, fn, use_graph: bool, warmup: int = 2, pool=None) -> None:
        self.fn = fn
        self.graph = None
        self.outputs = None
        if not use_graph:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        # NOTE: a garbage collection during capture may free an unreachable older graph (a DecodeStep and
        # its parts form a reference cycle), a CUDA call that invalidates the capture; collect first, then
        # keep the collector off until the capture ends.
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn()
        finally:
            if enabled:
                gc.enable()
        self.graph.replay()  # NOTE: capture records without running; fill the outputs once

    def __call__(self):
        if self.graph is None:
            self.outputs = self.fn()
        else:
            self.graph.replay()
        return self.outputs


@dataclass
class StepWorkspace:
    """Fixed-address inputs of one decode step for a bucket of N requests (refill with copy_ between steps)."""

    anchor_tokens: torch.Tensor  # [N] int64 last verified token (slot 0 of the block)
    ctx_lens: torch.Tensor  # [N] int64 committed tokens (position of the anchor)
    block_tables: torch.Tensor  # [N, max_pages] int64 pages of each request (room for ctx + W)
    context: torch.Tensor  # [N, num_context] float32 batch-context features (built on the host)
    live: torch.Tensor  # [N] bool; padding requests get k = 0
    budget: torch.Tensor  # [] int64 M_live, N_live <= M_live <= W * N_live
    max_kv: int  # host bound on ctx + W over the bucket (padding width of the portable attention)
    page_size: int


def block_metadata(ws: StepWorkspace, block_size: int, causal: bool) -> AttentionMetadata:
    """W rows per request right after its context, computed on the device from the workspace (DFlash's
    verification rows when causal, the drafter's block rows when not)."""
    n, w = ws.anchor_tokens.shape[0], block_size
    device = ws.ctx_lens.device
    rows = torch.arange(n * w, device=device)
    row_req, row_local = rows // w, rows % w
    positions = ws.ctx_lens[row_req] + row_local
    pages = ws.block_tables[row_req, positions // ws.page_size]
    return AttentionMetadata(
        row_req=row_req, row_local=row_local, positions=positions,
        slot_mapping=pages * ws.page_size + positions % ws.page_size, kv_lens=ws.ctx_lens + w,
        block_tables=ws.block_tables, max_q=w, max_kv=ws.max_kv, causal=causal,
        query_starts=torch.arange(n, device=device) * w, query_lens=torch.full_like(ws.ctx_lens, w))


def decide(
    predictor: AcceptancePredictor,
    projection: torch.Tensor,  # [d, hidden_proj_dim]
    draft_tokens: torch.Tensor,  # [N, W]
    draft_logits: torch.Tensor,  # [N, W-1, V]
    draft_hidden: torch.Tensor,  # [N, W-1, d]
    ws: StepWorkspace,
    num_rows: int,  # M, the verification buffer height (>= M_live)
) -> tuple[PackedBatch, AttentionMetadata]:
    """DVL decision without host reads: features -> monotone scores -> seeds -> Algorithm 1 -> flat-pack.
    The metadata carries explicit query bounds (N requests + the placeholder pseudo request)."""
    spec: FeatureSpec = predictor.spec
    w = draft_tokens.shape[1]
    features = acceptance_features(spec, draft_logits, draft_hidden, projection, ws.context)
    scores = predictor.scores(features)  # [N, W-1]
    lens = allocate(scores, seed_lengths(scores, w), ws.live, ws.budget)
    packed = flat_pack(lens, draft_tokens, ws.ctx_lens, ws.block_tables, num_rows, ws.page_size)
    # NOTE: max_q = W bounds the live requests; placeholders (num_rows > M_live) share local slots up to W - 1
    # (flat_pack), and the Triton kernels skip pseudo-request rows past W: their outputs are never read.
    meta = packed_metadata(packed, ws.ctx_lens, ws.block_tables, ws.max_kv, w)
    live_rows = lens.sum().view(1)
    meta.query_lens = torch.cat([lens, num_rows - live_rows])
    meta.query_starts = torch.cat([packed.verify_offsets, live_rows])
    return packed, meta


class DecodeStep:
    """One decode step of a bucket, in three capturable parts (see the module docstring).

    mode 'dflash': M = W * N, no decision; mode 'dscale': M = `num_rows`, decided by the predictor."""

    def __init__(self, target, drafter, ws: StepWorkspace, target_caches, drafter_caches, mode: str,
                 num_rows: int | None = None, predictor: AcceptancePredictor | None = None,
                 projection: torch.Tensor | None = None, inject: bool = True) -> None:
        assert mode in ("dflash", "dscale")
        self.target, self.drafter, self.ws = target, drafter, ws
        self.target_caches, self.drafter_caches = target_caches, drafter_caches
        self.mode, self.inject = mode, inject
        self.block_size = drafter.config.block_size
        n = ws.anchor_tokens.shape[0]
        self.num_rows = self.block_size * n if mode == "dflash" else num_rows
        assert self.num_rows is not None and n <= self.num_rows <= self.block_size * n
        if mode == "dscale":
            assert predictor is not None and projection is not None
        self.predictor, self.projection = predictor, projection
        self.capture_layers = tuple(drafter.config.target_layer_ids)
        self.parts: dict[str, GraphedCall] = {}

    # ---- the three parts (each reads only the workspace and earlier parts' outputs)
    def draft(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> draft tokens [N, W] (slot 0 = anchor), draft logits [N, W-1, V] (model dtype), hidden [N, W-1, d]."""
        ws, w = self.ws, self.block_size
        n = ws.anchor_tokens.shape[0]
        meta = block_metadata(ws, w, causal=False)
        block = torch.full((n, w), self.drafter.config.mask_token_id, dtype=torch.long, device=ws.ctx_lens.device)
        block[:, 0] = ws.anchor_tokens
        # NOTE: greedy only: drafts, features and acceptance need no fp32 copy of [N*(W-1) or M, V] logits
        # (an exact upcast: the Triton feature kernel and argmax read the model's dtype directly).
        logits, hidden = self.drafter.propose(block, self.target, meta, self.drafter_caches, float_logits=False)
        return block, logits, hidden

    def decide(self) -> tuple[torch.Tensor, PackedBatch | None, AttentionMetadata]:
        """-> (verify lens k [N], packed rows or None for DFlash, verification metadata)."""
        draft_tokens, logits, hidden = self._outputs("draft")
        if self.mode == "dflash":
            return torch.full_like(self.ws.ctx_lens, self.block_size), None, block_metadata(self.ws, self.block_size, True)
        packed, meta = decide(self.predictor, self.projection, draft_tokens, logits, hidden, self.ws, self.num_rows)
        return packed.verify_lens, packed, meta

    def verify(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (accepted drafts [N], successor tokens [N], verify lens [N]); writes target K/V of the M rows and
        the accepted rows' context K/V into the drafter cache (other rows write the scratch page)."""
        draft_tokens = self._outputs("draft")[0]
        lens, packed, meta = self._outputs("decide")
        meta.rope.clear()  # NOTE: graphs reuse one metadata object; its RoPE tables must be recomputed per call
        n, w = draft_tokens.shape
        if packed is None:
            token_ids, offsets = draft_tokens.reshape(-1), torch.arange(n, device=lens.device) * w
        else:
            token_ids, offsets = packed.token_ids, packed.verify_offsets
        logits, features = self.target(token_ids, meta, self.target_caches, None, self.capture_layers,
                                       float_logits=False)
        accepted, successor = accept_greedy(logits.argmax(dim=-1), draft_tokens, lens, offsets)
        if self.inject:
            req = meta.row_req.clamp(max=n - 1)
            keep = (meta.row_req < n) & (meta.row_local <= accepted[req])
            scratch = torch.full_like(meta.slot_mapping, SCRATCH_PAGE * self.ws.page_size)
            slots = torch.where(keep, meta.slot_mapping, scratch)
            self.drafter.inject_context(features, meta.positions, slots, self.drafter_caches)
        return accepted, successor, lens

    # ---- running
    def _outputs(self, name: str):
        return self.parts[name].outputs

    def build(self, use_graphs: bool, pool=None) -> DecodeStep:
        """Capture (or prepare eager runs of) the parts in order; a part's capture reads the earlier parts'
        fixed outputs, so each is replayed once right after its capture."""
        self.parts = {}
        for name in ("draft", "decide", "verify"):
            self.parts[name] = GraphedCall(getattr(self, name), use_graphs, pool=pool)
            if not use_graphs:
                self.parts[name]()
        return self

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One step on the device (no host read): draft -> decide -> verify; returns verify's outputs."""
        self.parts["draft"]()
        self.parts["decide"]()
        return self.parts["verify"]()
