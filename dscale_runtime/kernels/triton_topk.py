"""Triton top-k over vocabulary-wide rows (DFlash 2's `selector_top_k` candidates, `models/dflash2.py`).

Exact and sort-free, in four launches whatever the vocabulary (torch.topk's radix select reads the rows in
several passes and launches per digit):
1. `_chunk_max_kernel`: the maximum of every chunk of `CHUNK` columns (one read of the logits, as an argmax);
2. `_select_kernel`: per row, the k chunks of largest maximum (ties: the lower chunk first);
3. `_chunk_topk_kernel`: per row and selected chunk, that chunk's top k;
4. `_merge_kernel`: per row, the top k of those k x k candidates (fewer when the row has fewer than k chunks).
A vocabulary of one chunk (toy models) takes one launch instead (`_small_topk_kernel`, rows grouped).
The top k of a row lie in its k chunks of largest maximum: if tau is the k-th largest chunk maximum, at least
k values are >= tau and every chunk holding a larger value is selected; values equal to tau in an unselected
chunk come after, in column order, at least as many equal values in the selected chunks (lower chunks were
preferred), so they are never needed. Each selection orders (value, column) pairs packed into one int64 key
(the float's bits made order-preserving, high word; the complement of the column, low word), so a single max
reduction picks the largest value and, among equal values, the lowest column: the result is torch.topk's values,
sorted descending, ties in ascending column order (a stable descending sort's order; torch.topk's own order
among ties is unspecified). -0.0 counts as +0.0 (the value returned is +0.0, equal to it); NaN is not supported.
Grids depend on shapes only: safe to capture in a CUDA graph.

This module imports triton at import time: import it only through `models/dflash2.py`, which does so lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.kernels.triton_fused import _DTYPES, interpreted

CHUNK = 1024  # columns per chunk (stage 1 and 3 programs)
FLOOR = ((-8388608) ^ 0x7FFFFFFF) << 32  # the key of (-inf, column 2^32 - 1): below every key of a real column


@triton.jit
def _key(x, column):
    """fp32 x and int64 column -> int64 key ordered by (x, -column)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # NOTE: + 0.0 turns -0.0 into +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (4294967295 - column)


@triton.jit
def _chunk_max_kernel(logits, maxima, stride, vocab, num_chunks, CHUNK: tl.constexpr):
    row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits + row * stride + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    tl.store(maxima + row * num_chunks + c, tl.max(x, 0))


@triton.jit
def _select_kernel(maxima, chosen, num_chunks, floor, K: tl.constexpr, CB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, CB)
    inside = lanes < num_chunks
    m = tl.load(maxima + row * num_chunks + lanes, mask=inside, other=float("-inf"))
    keys = tl.where(inside, _key(m, lanes.to(tl.int64)), floor)
    for i in tl.static_range(K):
        top = tl.max(keys, 0)
        chunk = tl.where(top > floor, 4294967295 - (top & 4294967295), -1)  # -1: fewer than K chunks
        tl.store(chosen + row * K + i + lanes * 0, chunk + lanes * 0, mask=lanes == 0)
        keys = tl.where(keys == top, floor, keys)


@triton.jit
def _chunk_topk_kernel(logits, chosen, candidates, stride, vocab, floor, K: tl.constexpr, SLOTS: tl.constexpr,
                       CHUNK: tl.constexpr):
    row, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    lanes = tl.arange(0, CHUNK)
    chunk = tl.load(chosen + row * K + s + lanes * 0)  # [CHUNK], all equal (a vector: the interpreter masks by blocks)
    cols = chunk * CHUNK + lanes
    inside = (chunk >= 0) & (cols < vocab)
    x = tl.load(logits + row * stride + cols, mask=inside, other=float("-inf")).to(tl.float32)
    keys = tl.where(inside, _key(x, cols), floor)
    out = candidates + (row * SLOTS + s) * K
    for i in tl.static_range(K):
        top = tl.max(keys, 0)
        tl.store(out + i + lanes * 0, top + lanes * 0, mask=lanes == 0)
        keys = tl.where(keys == top, floor, keys)


@triton.jit
def _merge_kernel(candidates, values, indices, floor, K: tl.constexpr, COUNT: tl.constexpr, KKB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, KKB)
    keys = tl.load(candidates + row * COUNT + lanes, mask=lanes < COUNT, other=floor)
    for i in tl.static_range(K):
        top = tl.max(keys, 0)
        ordered = (top >> 32).to(tl.int32)
        bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        first = lanes == 0
        tl.store(values + row * K + i + lanes * 0, bits.to(tl.float32, bitcast=True) + lanes * 0.0, mask=first)
        tl.store(indices + row * K + i + lanes * 0, 4294967295 - (top & 4294967295) + lanes * 0, mask=first)
        keys = tl.where(keys == top, floor, keys)


@triton.jit
def _small_topk_kernel(logits, values, indices, num_rows, stride, vocab, floor, K: tl.constexpr, ROWS: tl.constexpr,
                       COLS: tl.constexpr):
    """Rows of at most COLS columns, ROWS rows per program: the top k of each directly (one chunk per row)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, COLS).to(tl.int64)
    inside = (rows < num_rows)[:, None] & (cols < vocab)[None, :]
    x = tl.load(logits + rows[:, None] * stride + cols[None, :], mask=inside, other=float("-inf")).to(tl.float32)
    keys = tl.where(inside, _key(x, cols[None, :]), floor)
    for i in tl.static_range(K):
        top = tl.max(keys, 1)  # [ROWS]
        ordered = (top >> 32).to(tl.int32)
        bits = ordered ^ ((ordered >> 31) & 0x7FFFFFFF)
        ok = rows < num_rows
        tl.store(values + rows * K + i, bits.to(tl.float32, bitcast=True), mask=ok)
        tl.store(indices + rows * K + i, 4294967295 - (top & 4294967295), mask=ok)
        keys = tl.where(keys == top[:, None], floor, keys)


def topk_triton(logits: torch.Tensor, k: int, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows logits [R, V] (unit column stride) -> (values [R, k] fp32, columns [R, k] int64): torch.topk's values,
    sorted descending, equal values in ascending column order (module docstring; `dflash2.candidate_topk_ref` is
    the definition)."""
    rows, vocab = logits.shape
    assert logits.dtype in _DTYPES and logits.stride(1) == 1 and 0 < k <= vocab and vocab < 2 ** 31, logits.shape
    assert chunk & (chunk - 1) == 0, "chunk: a power of two"
    if not logits.is_cuda and not interpreted():
        raise RuntimeError("the Triton top-k on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 before "
                           "triton is imported, or use DSCALE_FUSED=ref (KernelChoice.fused='ref')")
    chunk = min(chunk, max(16, triton.next_power_of_2(vocab)))  # NOTE: small vocabularies: one short chunk
    device = logits.device
    values = torch.empty(rows, k, dtype=torch.float32, device=device)
    indices = torch.empty(rows, k, dtype=torch.long, device=device)
    if rows == 0:
        return values, indices
    num_chunks = triton.cdiv(vocab, chunk)
    if num_chunks == 1:  # NOTE: a vocabulary of one chunk (toy models): one launch, rows grouped
        group = min(16, triton.next_power_of_2(rows))
        _small_topk_kernel[(triton.cdiv(rows, group),)](logits, values, indices, rows, logits.stride(0), vocab, FLOOR,
                                                        K=k, ROWS=group, COLS=chunk, num_warps=4)
        return values, indices
    maxima = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    chosen = torch.empty(rows, k, dtype=torch.long, device=device)
    slots = min(k, num_chunks)  # NOTE: the selected chunks past the row's chunk count are none: not launched
    candidates = torch.empty(rows, slots * k, dtype=torch.long, device=device)
    warps = max(1, min(8, chunk // 256))
    _chunk_max_kernel[(rows, num_chunks)](logits, maxima, logits.stride(0), vocab, num_chunks, CHUNK=chunk,
                                          num_warps=warps)
    _select_kernel[(rows,)](maxima, chosen, num_chunks, FLOOR, K=k, CB=triton.next_power_of_2(num_chunks),
                            num_warps=4)
    _chunk_topk_kernel[(rows, slots)](logits, chosen, candidates, logits.stride(0), vocab, FLOOR, K=k, SLOTS=slots,
                                      CHUNK=chunk, num_warps=warps)
    _merge_kernel[(rows,)](candidates, values, indices, FLOOR, K=k, COUNT=slots * k,
                           KKB=triton.next_power_of_2(slots * k), num_warps=4)
    return values, indices

