"""Flat-pack: selected prefixes into fixed-shape buffers of M rows, and the attention metadata over them.

offset_i = exclusive cumsum of k. Row r in [offset_i, offset_i + k_i) holds request i, slot r - offset_i:
its token, position ctx_i + slot and KV write slot. Inactive requests (k = 0) get offset M_live. Rows
r >= M_live are placeholders: token 0, position 0, written to the scratch page, attending only to it (local
slot min(r - M_live, W - 1): a bucket's fixed M may exceed M_live by more than W).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.kv_cache import SCRATCH_PAGE


@dataclass
class PackedBatch:
    """The fixed-address verification workspace of one step (M rows, N requests)."""

    verify_lens: torch.Tensor  # [N] k_i (0 for inactive requests)
    verify_offsets: torch.Tensor  # [N] exclusive cumsum of k (M_live for inactive requests)
    token_ids: torch.Tensor  # [M] token of each row (anchor or draft; 0 for placeholders)
    positions: torch.Tensor  # [M] absolute position of each row (0 for placeholders)
    slot_mapping: torch.Tensor  # [M] KV write slot (scratch page for placeholders)
    row_req: torch.Tensor  # [M] request of each row (N for placeholders: a pseudo request on the scratch page)
    row_local: torch.Tensor  # [M] slot inside the request (min(row - M_live, W - 1) for placeholders)


def flat_pack(
    verify_lens: torch.Tensor,  # [N] int64
    draft_tokens: torch.Tensor,  # [N, W] slot 0 = anchor
    ctx_lens: torch.Tensor,  # [N] int64 committed lengths (position of the anchor)
    block_tables: torch.Tensor,  # [N, max_pages] int64
    num_rows: int,  # M, the buffer height (>= sum k)
    page_size: int,
) -> PackedBatch:
    n, w = draft_tokens.shape
    device = draft_tokens.device
    ends = torch.cumsum(verify_lens, 0)  # inclusive
    live_rows = ends[-1] if n else torch.zeros((), dtype=torch.long, device=device)
    offsets = torch.where(verify_lens > 0, ends - verify_lens, live_rows)
    rows = torch.arange(num_rows, device=device)
    req = torch.searchsorted(ends, rows, right=True)  # [M]; == N for rows past the live ones
    is_tail = req >= n
    req_c = req.clamp(max=max(n - 1, 0))
    # NOTE: placeholders past the W-th share local slot W - 1, so any M fits a query tile of W rows
    slot = torch.where(is_tail, (rows - live_rows).clamp(max=w - 1), rows - offsets[req_c])
    slot_c = slot.clamp(0, w - 1)
    tokens = torch.where(is_tail, torch.zeros_like(rows), draft_tokens[req_c, slot_c])
    positions = torch.where(is_tail, torch.zeros_like(rows), ctx_lens[req_c] + slot_c)
    pages = block_tables[req_c, (positions // page_size).clamp(max=block_tables.shape[1] - 1)]
    kv_slots = torch.where(is_tail, torch.full_like(rows, SCRATCH_PAGE * page_size),
                           pages * page_size + positions % page_size)
    return PackedBatch(verify_lens, offsets, tokens, positions, kv_slots, torch.where(is_tail, n, req), slot)


def packed_metadata(packed: PackedBatch, ctx_lens: torch.Tensor, block_tables: torch.Tensor, max_kv: int,
                    max_q: int, kv_lens: torch.Tensor | None = None) -> AttentionMetadata:
    """Causal attention metadata over the packed rows: N requests plus one pseudo request for placeholders.

    `max_q` (>= every k_i and the placeholder count) and `max_kv` (>= every ctx_i + k_i) are host-side bounds,
    so building this needs no device-to-host read of the chosen lengths: a captured step passes its static
    width, an eager one the live context's (`StepBuffers.kv_width`; the portable path's cost follows it).
    `kv_lens` [N + 1]: the keys of each request and the pseudo request's one, where a kernel wrote them already
    (`kernels/triton_pack.py`). `block_tables` [N, P] gets the pseudo request's row on the scratch page appended;
    [N + 1, P] is taken as it is, its last row being that one (`StepBuffers.tables_with_scratch`: no launch)."""
    n = ctx_lens.shape[0]
    if block_tables.shape[0] == n + 1:
        tables = block_tables
    else:
        tables = torch.cat([block_tables, torch.full_like(block_tables[:1], SCRATCH_PAGE)])
    if kv_lens is None:
        kv_lens = torch.cat([ctx_lens + packed.verify_lens, torch.ones_like(ctx_lens[:1])])
    assert tables.shape[0] == n + 1
    return AttentionMetadata(row_req=packed.row_req, row_local=packed.row_local, positions=packed.positions,
                             slot_mapping=packed.slot_mapping, kv_lens=kv_lens, block_tables=tables, max_q=max_q,
                             max_kv=max_kv, causal=True)
