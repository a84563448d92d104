"""The engine's greedy decode step on fixed per-bucket buffers: `fastpath.DecodeStep` per (bucket, mode).

A batch of n live requests runs in the smallest bucket B >= n (powers of two up to `max_running_requests`);
the B - n padding requests have no pages of their own (every table entry is the scratch page), k = 0 in
DScale and scratch-page rows in DFlash, and their results are never read. The bucket's verification height
is fixed (W x B for DFlash, round(budget_ratio x W x B) for DScale) and the live budget M_live =
round(budget_ratio x W x n) is a device scalar, so one step per bucket serves every n that maps to it. On
CUDA each (bucket, mode) is captured once as three CUDA graphs (draft, decision, verification) sharing the
bucket's workspace; elsewhere the same functions run eagerly, which is what the CPU tests compare with the
engine's ordinary step. The host fills the workspace (one copy per tensor) and reads the results back once.
"""

from __future__ import annotations

import torch

from dscale_runtime.dvl.allocate import budget_rows
from dscale_runtime.dvl.features import context_features
from dscale_runtime.fastpath import DecodeStep, StepWorkspace
from dscale_runtime.kv_cache import SCRATCH_PAGE


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two below `max_batch`, then `max_batch` itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class StepGraphs:
    """Per-bucket fixed-address decode steps of one engine (see the module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        cfg = engine.config
        self.buckets = bucket_sizes(cfg.max_running_requests)
        self.use_graphs = engine.device.type == "cuda"
        self.max_pages = -(-(cfg.max_model_len + engine.block_size) // cfg.page_size)
        self.steps: dict[tuple[int, str], DecodeStep] = {}

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def mode_for(self, n: int) -> str:
        """The step a batch of n live requests runs: DScale's decision, or full width (DFlash, and DScale at
        or below `full_width_max_batch`)."""
        cfg = self.engine.config
        return "dscale" if cfg.mode == "dscale" and n > cfg.full_width_max_batch else "dflash"

    def prepare(self) -> None:
        """Build (capture, on CUDA) every (bucket, mode) a batch can need, up front: the engine does this at
        start-up on CUDA, so no request waits for a capture."""
        for n in range(1, self.engine.config.max_running_requests + 1):
            key = (self.bucket(n), self.mode_for(n))
            if key not in self.steps:
                self.steps[key] = self._build(*key)

    def _build(self, size: int, mode: str) -> DecodeStep:
        e, cfg = self.engine, self.engine.config
        dev = e.device
        ws = StepWorkspace(
            anchor_tokens=torch.zeros(size, dtype=torch.long, device=dev),
            ctx_lens=torch.zeros(size, dtype=torch.long, device=dev),
            block_tables=torch.full((size, self.max_pages), SCRATCH_PAGE, dtype=torch.long, device=dev),
            context=torch.zeros(size, e.feature_spec.num_context, dtype=torch.float32, device=dev),
            live=torch.zeros(size, dtype=torch.bool, device=dev),
            budget=torch.tensor(size, dtype=torch.long, device=dev),
            max_kv=self.max_pages * cfg.page_size, page_size=cfg.page_size)
        rows = budget_rows(size, e.block_size, cfg.budget_ratio) if mode == "dscale" else None
        if mode == "dscale" and e.hidden_projection is None:
            raise RuntimeError("dscale mode needs the predictor's hidden projection")
        step = DecodeStep(e.target, e.drafter, ws, e.target_cache.layers, e.drafter_cache.layers, mode, rows,
                          e.predictor, e.hidden_projection)
        # NOTE: capture runs each part on the current (empty) workspace: padding only, all on the scratch page.
        # Each part keeps its own memory pool, so graphs of different buckets may replay in any order.
        return step.build(self.use_graphs)

    def run(self, requests, mode: str) -> tuple[list[int], list[int], list[int], list[list[int]], int]:
        """One decode step of the live `requests` -> host (accepted, successors, verify lens, drafts [W] per
        request, verification rows M_live); the target and drafter caches are written as by the eager step."""
        e, cfg = self.engine, self.engine.config
        n, w = len(requests), e.block_size
        size = self.bucket(n)
        key = (size, mode)
        if key not in self.steps:
            self.steps[key] = self._build(size, mode)
        step = self.steps[key]
        ws = step.ws
        tables = torch.full((size, self.max_pages), SCRATCH_PAGE, dtype=torch.long)
        for i, r in enumerate(requests):
            tables[i, : len(r.pages)] = torch.tensor(r.pages, dtype=torch.long)
        ctx = [r.num_computed for r in requests]
        pad = [0] * (size - n)
        rows = budget_rows(n, w, cfg.budget_ratio) if mode == "dscale" else w * n
        ws.anchor_tokens.copy_(torch.tensor([r.last_token_id for r in requests] + pad))
        ws.ctx_lens.copy_(torch.tensor(ctx + pad))
        ws.block_tables.copy_(tables)
        ws.live.copy_(torch.tensor([True] * n + [False] * (size - n)))
        ws.budget.fill_(rows)
        if mode == "dscale":
            context = context_features(e.feature_spec, n, ctx, [r.stats.num_steps for r in requests],
                                       [r.stats.accepted_lens for r in requests], "cpu")
            ws.context.zero_()
            ws.context[:n].copy_(context)
        accepted, successor, lens = step()
        drafts = step.parts["draft"].outputs[0]
        # NOTE: the one device-to-host copy of the step
        host = torch.cat([accepted[:n], successor[:n], lens[:n], drafts[:n].reshape(-1)]).tolist()
        return host[:n], host[n : 2 * n], host[2 * n : 3 * n], [host[3 * n + i * w : 3 * n + (i + 1) * w]
                                                                 for i in range(n)], rows
