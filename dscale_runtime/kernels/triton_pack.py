"""DScale's decision after the predictor in two Triton launches: Algorithm 1's allocation (`dvl.allocate.allocate`
with `dvl.predictor.seed_lengths`' seeds) and the flat pack with its attention metadata (`dvl.pack.flat_pack`,
`packed_metadata`'s per-request columns and the step's query bounds). The torch definitions beside them are the
reference; in a captured DScale step they are about seventy small graph nodes, these are two.

Allocation: a program per RB requests. Every program recomputes the seeds of the whole batch (N x P scores, a few
KB) and so the gap D = M_live - sum k0 without a second launch; then ranks each of its candidates against every
candidate of the batch, as the reference's stable sort does (a smaller key first, equal keys by flat index), and
counts the chosen ones per request. Flat pack: a program per MB packed rows, each recomputing the exclusive cumsum
of the N lengths; a row's request is the number of ends at or below it (`searchsorted(..., right=True)`).

Every output is an integer: the kernels equal the reference exactly, except that a seed can differ where a row's
fp32 score sum lies within rounding of a half-integer (the kernel and torch may add the P scores in another order;
any verify lengths are lossless, only the choice would differ). Grids depend on shapes only: safe to capture in a
CUDA graph. Import this module only where triton is installed (`StepRunner.decide` does so lazily);
TRITON_INTERPRET=1 runs it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.kernels.triton_fused import interpreted, require_interpreter_on_cpu
from dscale_runtime.kv_cache import SCRATCH_PAGE

ALLOCATE_ROWS = 4  # requests per allocation program
CHUNK_ROWS = 4  # requests per tile of the batch that each allocation program walks
PACK_ROWS = 128  # packed rows per flat-pack program (fewer at large batches: a [rows, N] tile per program)


@triton.jit
def _seeds(scores_ptr, live_ptr, rows, cols, n, P: tl.constexpr, W: tl.constexpr):
    """Tile [len(rows), len(cols)] -> (scores, seeds k0 = clamp(1 + floor(sum + 0.5), 1, W), zero where not live)."""
    inside = (rows < n)[:, None] & (cols < P)[None, :]
    s = tl.load(scores_ptr + rows[:, None] * P + cols[None, :], mask=inside, other=0.0)
    seed = tl.minimum(tl.maximum(1.0 + tl.floor(tl.sum(s, axis=1) + 0.5), 1.0), W * 1.0).to(tl.int64)
    live = tl.load(live_ptr + rows, mask=rows < n, other=0) > 0
    return s, tl.where(live, seed, 0), live


@triton.jit
def _allocate_kernel(scores_ptr, live_ptr, budget_ptr, lens_ptr, n, P: tl.constexpr, PB: tl.constexpr,
                     W: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr, CHUNKS: tl.constexpr):
    cols = tl.arange(0, PB)
    slot = cols + 1  # the draft slot of each column
    # the gap D over the whole batch
    total = tl.zeros([CB], dtype=tl.int64)
    for c in range(CHUNKS):
        _, seed, _ = _seeds(scores_ptr, live_ptr, c * CB + tl.arange(0, CB), cols, n, P, W)
        total += seed
    gap = tl.load(budget_ptr) - tl.sum(total, axis=0)
    grow = gap > 0
    need = tl.abs(gap)
    # this program's requests: candidates (grow: slots >= k0; shrink: verified drafts < k0) and their keys
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    s, seed, live = _seeds(scores_ptr, live_ptr, rows, cols, n, P, W)
    cand = live[:, None] & (cols < P)[None, :] & tl.where(grow, slot[None, :] >= seed[:, None],
                                                              slot[None, :] < seed[:, None])
    key = tl.reshape(tl.where(grow, -s, s), [RB * PB])
    flat = tl.reshape(rows[:, None] * P + cols[None, :], [RB * PB])
    rank = tl.zeros([RB * PB], dtype=tl.int32)
    for c in range(CHUNKS):
        other = c * CB + tl.arange(0, CB)
        t, t_seed, t_live = _seeds(scores_ptr, live_ptr, other, cols, n, P, W)
        t_cand = t_live[:, None] & (cols < P)[None, :] & tl.where(grow, slot[None, :] >= t_seed[:, None],
                                                                      slot[None, :] < t_seed[:, None])
        t_key = tl.reshape(tl.where(grow, -t, t), [CB * PB])
        t_flat = tl.reshape(other[:, None] * P + cols[None, :], [CB * PB])
        t_cand = tl.reshape(t_cand, [CB * PB])
        before = t_cand[None, :] & ((t_key[None, :] < key[:, None])
                                    | ((t_key[None, :] == key[:, None]) & (t_flat[None, :] < flat[:, None])))
        rank += tl.sum(before.to(tl.int32), axis=1)
    chosen = tl.reshape(rank.to(tl.int64) < need, [RB, PB]) & cand
    count = tl.sum(chosen.to(tl.int64), axis=1)
    tl.store(lens_ptr + rows, seed + tl.where(grow, count, -count), mask=rows < n)


def allocate_triton(scores: torch.Tensor, live: torch.Tensor, budget: torch.Tensor, block_size: int) -> torch.Tensor:
    """`allocate(scores, seed_lengths(scores, W), live > 0, budget)` in one launch: scores [N, W-1] float32
    (non-increasing rows), live [N] int64 (> 0: live), budget [] int64 (M_live) -> [N] int64 verify lengths."""
    n, p = scores.shape
    assert p == block_size - 1 and scores.dtype == torch.float32 and scores.is_contiguous(), \
        (scores.shape, scores.dtype)
    assert live.dtype == budget.dtype == torch.int64 and budget.numel() == 1
    require_interpreter_on_cpu(scores, "the Triton allocation", "decision")
    lens = torch.empty(n, dtype=torch.int64, device=scores.device)
    if n == 0:
        return lens
    _allocate_kernel[(triton.cdiv(n, ALLOCATE_ROWS),)](
        scores, live, budget, lens, n, P=p, PB=triton.next_power_of_2(p), W=block_size, RB=ALLOCATE_ROWS,
        CB=CHUNK_ROWS, CHUNKS=triton.cdiv(n, CHUNK_ROWS), num_warps=4)
    return lens


@triton.jit
def _flat_pack_kernel(lens_ptr, block_ptr, ctx_ptr, tables_ptr, offsets_ptr, tokens_ptr, positions_ptr, slots_ptr,
                      row_req_ptr, row_local_ptr, query_lens_ptr, query_starts_ptr, kv_lens_ptr, n, num_rows,
                      block_stride, tables_stride, max_pages, page_size, scratch,
                      W: tl.constexpr, NB: tl.constexpr, MB: tl.constexpr):
    b = tl.arange(0, NB)
    inside = b < n
    lens = tl.load(lens_ptr + b, mask=inside, other=0)
    ends = tl.cumsum(lens, axis=0)  # inclusive
    live_rows = tl.sum(lens, axis=0)
    offsets = tl.where(lens > 0, ends - lens, live_rows)
    if tl.program_id(0) == 0:  # the per-request columns: offsets, the query bounds and the keys of each request
        ctx = tl.load(ctx_ptr + b, mask=inside, other=0)
        tl.store(offsets_ptr + b, offsets, mask=inside)
        tl.store(query_lens_ptr + b, tl.where(inside, lens, num_rows - live_rows), mask=b <= n)
        tl.store(query_starts_ptr + b, tl.where(inside, offsets, live_rows), mask=b <= n)
        tl.store(kv_lens_ptr + b, tl.where(inside, ctx + lens, 1), mask=b <= n)
    rows = tl.program_id(0) * MB + tl.arange(0, MB)
    req = tl.sum(((ends[None, :] <= rows[:, None]) & inside[None, :]).to(tl.int64), axis=1)  # [MB]
    tail = req >= n
    req_c = tl.minimum(req, n - 1)
    pick = b[None, :] == req_c[:, None]
    start = tl.sum(tl.where(pick, offsets[None, :], 0), axis=1)
    slot = tl.where(tail, tl.minimum(rows - live_rows, W - 1), rows - start)
    slot_c = tl.minimum(tl.maximum(slot, 0), W - 1)
    ok = rows < num_rows
    token = tl.load(block_ptr + req_c * block_stride + slot_c, mask=ok, other=0)
    position = tl.where(tail, 0, tl.load(ctx_ptr + req_c, mask=ok, other=0) + slot_c)
    page = tl.load(tables_ptr + req_c * tables_stride + tl.minimum(position // page_size, max_pages - 1), mask=ok,
                   other=0)
    tl.store(tokens_ptr + rows, tl.where(tail, 0, token), mask=ok)
    tl.store(positions_ptr + rows, position, mask=ok)
    tl.store(slots_ptr + rows, tl.where(tail, scratch * page_size, page * page_size + position % page_size), mask=ok)
    tl.store(row_req_ptr + rows, tl.where(tail, n, req), mask=ok)
    tl.store(row_local_ptr + rows, slot, mask=ok)


def pack_rows(nb: int) -> int:
    """Packed rows per flat-pack program for NB (>= N + 1) request columns: a [rows, NB] tile of <= 8K entries."""
    return max(16, min(PACK_ROWS, 8192 // nb))


def pack_warps(nb: int) -> int:
    return 4 if nb <= 128 else 8


def flat_pack_triton(lens: torch.Tensor, block: torch.Tensor, ctx: torch.Tensor, block_tables: torch.Tensor,
                     num_rows: int, page_size: int) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flat_pack(lens, block, ctx, block_tables, num_rows, page_size)` in one launch, with the metadata's
    per-request columns: -> (the PackedBatch fields by name, query_lens [N + 1], query_starts [N + 1], kv_lens
    [N + 1]): the last entry of each is the placeholder pseudo request's (M - M_live rows from M_live, one key)."""
    n, w = block.shape
    assert lens.dtype == block.dtype == ctx.dtype == block_tables.dtype == torch.int64
    assert block.stride(1) == 1 and block_tables.stride(1) == 1 and lens.is_contiguous() and ctx.is_contiguous()
    require_interpreter_on_cpu(lens, "the Triton flat pack", "decision")
    device = lens.device
    rows = {name: torch.empty(num_rows, dtype=torch.int64, device=device)
            for name in ("token_ids", "positions", "slot_mapping", "row_req", "row_local")}
    offsets = torch.empty(n, dtype=torch.int64, device=device)
    query_lens, query_starts, kv_lens = (torch.empty(n + 1, dtype=torch.int64, device=device) for _ in range(3))
    assert n >= 1 and num_rows >= 1
    nb = triton.next_power_of_2(n + 1)
    _flat_pack_kernel[(triton.cdiv(num_rows, pack_rows(nb)),)](
        lens, block, ctx, block_tables, offsets, rows["token_ids"], rows["positions"], rows["slot_mapping"],
        rows["row_req"], rows["row_local"], query_lens, query_starts, kv_lens, n, num_rows, block.stride(0),
        block_tables.stride(0), block_tables.shape[1], page_size, SCRATCH_PAGE, W=w,
        NB=nb, MB=pack_rows(nb), num_warps=pack_warps(nb))
    return {"verify_lens": lens, "verify_offsets": offsets, **rows}, query_lens, query_starts, kv_lens


def compile_offline(batch: int = 32, block_size: int = 16, arch: int = 90) -> list:
    """Both kernels compiled for an NVIDIA target without a GPU (`kernels.compile_for_gpu`): a CI check of the
    compiled path, which the interpreter does not make. Needs triton imported without TRITON_INTERPRET."""
    from dscale_runtime.kernels import compile_for_gpu

    assert not interpreted(), "compile_offline needs triton imported without TRITON_INTERPRET"
    p = block_size - 1
    alloc = {"P": p, "PB": triton.next_power_of_2(p), "W": block_size, "RB": ALLOCATE_ROWS, "CB": CHUNK_ROWS,
             "CHUNKS": triton.cdiv(batch, CHUNK_ROWS)}
    nb = triton.next_power_of_2(batch + 1)
    pack = {"W": block_size, "NB": nb, "MB": pack_rows(nb)}
    return [compile_for_gpu(_allocate_kernel, alloc, {"*": "*i64", "scores_ptr": "*fp32"}, 4, arch),
            compile_for_gpu(_flat_pack_kernel, pack, {"*": "*i64"}, pack_warps(nb), arch)]
