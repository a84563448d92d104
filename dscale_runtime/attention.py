"""Ragged attention over the paged KV cache: the metadata every forward carries, and the portable path.

Rows of one forward are packed request after request (prefill chunks, 16-slot verify blocks, DScale's
variable prefixes or single decode rows alike). `AttentionMetadata` says, for every row, which request
it belongs to and where it sits, and for every request which cache pages it owns. The portable path
here gathers each request's keys, pads the queries per request and runs SDPA with an explicit mask; it
is the oracle for any fast kernel. The models call `dscale_runtime.kernels.paged_attention` with the path
of their `KernelChoice`: the Triton kernels (chosen on CUDA) or this path (always on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Row-to-request mapping and cache addressing for one forward over T packed rows of N requests."""

    row_req: torch.Tensor  # [T] int64, request index of each row (0..N-1)
    row_local: torch.Tensor  # [T] int64, index of the row inside its request's query (0..q_len-1)
    positions: torch.Tensor  # [T] int64, absolute position of each row (RoPE and the causal bound)
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot that receives each row's K/V
    kv_lens: torch.Tensor  # [N] int64, keys visible to each request once this forward has written
    block_tables: torch.Tensor  # [N, max_pages] int64, page ids of each request (unused entries 0)
    max_q: int  # longest per-request query (padding height of the portable path)
    # Bound of every kv_len: the portable path gathers and masks max_kv keys per request, so eager callers keep
    # it at the live context (captured steps use their static width; the Triton kernels read kv_lens only).
    max_kv: int
    causal: bool  # True: a row at position p sees keys <= p; False: every key < kv_len (DFlash block)
    rope: dict = field(default_factory=dict, repr=False)  # (head_dim, theta, dtype) -> cos/sin of `positions`
    # Optional per-request query bounds for kernels; derived on the device from `row_req` when left None.
    query_starts: torch.Tensor | None = None  # [N] int64, first packed row of each request
    query_lens: torch.Tensor | None = None  # [N] int64, rows of each request
    kv_splits: int = 1  # split the keys of each request over up to this many programs (Triton path; static)

    @property
    def num_requests(self) -> int:
        return int(self.kv_lens.shape[0])

    def query_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_starts [N], query_lens [N]), derived on the device (no host read) and kept when absent.

        NOTE: rows are packed request after request (build_metadata, flat_pack), so request i starts after
        the rows of requests 0..i-1; placeholder rows belong to the last (pseudo) request."""
        if self.query_starts is None or self.query_lens is None:
            lens = torch.zeros(self.num_requests, dtype=self.row_req.dtype, device=self.row_req.device)
            lens.scatter_add_(0, self.row_req, torch.ones_like(self.row_req))
            self.query_lens, self.query_starts = lens, torch.cumsum(lens, 0) - lens
        return self.query_starts, self.query_lens


def host_to_device(values, device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host values as a device tensor; on CUDA through pinned memory, so the host does not wait for the work
    queued before the copy (the engine builds a prefill while a decode step runs)."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def build_metadata(
    query_lens: list[int],
    ctx_lens: list[int],
    block_tables: list[list[int]],
    page_size: int,
    device: torch.device | str,
    causal: bool = True,
) -> AttentionMetadata:
    """Metadata for requests whose `query_lens[i]` new rows start at position `ctx_lens[i]`."""
    assert len(query_lens) == len(ctx_lens) == len(block_tables)
    max_pages = max((len(t) for t in block_tables), default=1) or 1
    tables = host_to_device([t + [0] * (max_pages - len(t)) for t in block_tables], device)
    q = host_to_device(query_lens, device)
    ctx = host_to_device(ctx_lens, device)
    num_rows = sum(query_lens)
    row_req = torch.repeat_interleave(torch.arange(len(query_lens), device=device), q, output_size=num_rows)
    starts = torch.cumsum(q, 0) - q
    row_local = torch.arange(num_rows, device=device) - starts[row_req]
    positions = ctx[row_req] + row_local
    assert all(c + n <= len(t) * page_size for c, n, t in zip(ctx_lens, query_lens, block_tables)), \
        "request has too few cache pages for its rows"
    slots = tables[row_req, positions // page_size] * page_size + positions % page_size
    kv_lens = [c + n for c, n in zip(ctx_lens, query_lens)]
    return AttentionMetadata(
        row_req=row_req,
        row_local=row_local,
        positions=positions,
        slot_mapping=slots,
        kv_lens=ctx + q,
        block_tables=tables,
        max_q=max(query_lens, default=1),
        max_kv=max(kv_lens, default=1),
        causal=causal,
        query_starts=starts,
        query_lens=q,
    )


def paged_attention_ref(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D] (this layer)
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    page_size: int,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Portable ragged attention: gather keys per request, pad queries per request, masked SDPA. Its cost grows
    with `meta.max_kv` (N x max_q x max_kv scores), whatever the requests' kv_lens."""
    n, max_q, max_kv = meta.num_requests, meta.max_q, meta.max_kv
    num_heads, head_dim = q.shape[1], q.shape[2]
    device = q.device
    key_pos = torch.arange(max_kv, device=device)  # [max_kv]
    pages = meta.block_tables.gather(1, (key_pos // page_size).clamp(max=meta.block_tables.shape[1] - 1).expand(n, -1))
    key_slots = pages * page_size + key_pos % page_size  # [N, max_kv]
    k = k_cache[key_slots].transpose(1, 2)  # [N, KVH, max_kv, D]
    v = v_cache[key_slots].transpose(1, 2)
    q_pad = q.new_zeros(n, max_q, num_heads, head_dim)
    q_pad[meta.row_req, meta.row_local] = q
    q_pad = q_pad.transpose(1, 2)  # [N, H, max_q, D]
    visible = key_pos[None, :] < meta.kv_lens[:, None]  # [N, max_kv]
    mask = visible[:, None, :].expand(n, max_q, max_kv).clone()  # [N, max_q, max_kv]
    if meta.causal:
        row_pos = torch.full((n, max_q), -1, dtype=torch.long, device=device)
        row_pos[meta.row_req, meta.row_local] = meta.positions
        mask &= key_pos[None, None, :] <= row_pos[:, :, None]
    # NOTE: padded query rows would see no key and give NaN; let them see key 0 and discard them.
    mask[:, :, 0] |= ~mask.any(-1)
    out = F.scaled_dot_product_attention(
        q_pad, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=num_heads != k.shape[1]
    )  # [N, H, max_q, D]
    return out.transpose(1, 2)[meta.row_req, meta.row_local]
