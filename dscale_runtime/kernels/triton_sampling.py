"""Triton kernels of the sampler: chunk sums of a tempered softmax's weights, read straight from the logits (one
pass, any float dtype), and the counter-based uniforms of `kernels.sampling.keyed_uniforms_ref`, bit for bit.

`chunk_exp_sums_triton(logits [R, V], shift [R], inv_t [R], chunk)` -> [R, C] fp32, C = ceil(V / chunk):
sum over each chunk of exp((l - shift) * inv_t) (with a floor [R]: over the entries with (l - shift) * inv_t >=
floor, the top-k / top-p policies of `kernels/filters.py`), one program per (row, chunk), static grid
(graph-safe). The sampler's two-level inverse CDF (`dscale_runtime.sampling`) needs nothing else of the full
row, so no fp32 copy of the [R, V] logits is ever written.

This module imports triton at import time: import it only through `dscale_runtime.kernels.sampling`, which
does so lazily. With TRITON_INTERPRET=1 set before triton is imported, it runs in Triton's interpreter on CPU
tensors too (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.kernels.filters import KEY_ALL, KEY_BITS, MASS_BITS, ROW_PROGRAM_VOCAB
from dscale_runtime.kernels.triton_filters import _DTYPES16, _row_floor
from dscale_runtime.kernels.triton_fused import interpreted, require_interpreter_on_cpu

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _chunk_exp_sums_kernel(logits, shift, inv_t, floor, out, vocab, stride_row, num_chunks, CHUNK: tl.constexpr,
                           FLOOR: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    m = tl.load(shift + row)
    s = (x - m) * tl.load(inv_t + row)
    e = tl.exp(s)  # exp(-inf) = 0 past the vocabulary
    if FLOOR:
        e = tl.where(s >= tl.load(floor + row), e, 0.0)  # top-k / top-p: entries below the row's floor weigh 0
    tl.store(out + row * num_chunks + chunk, tl.sum(e, 0))


@triton.jit
def _mix32(x):
    """lowbias32 on uint64 lanes holding 32-bit values (products of two 32-bit values fit in 64 bits)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _keyed_uniforms_kernel(seed_lo, seed_hi, positions, out, total, per_row, key, second_key,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total
    row = offs // per_row
    lo = tl.load(seed_lo + row, mask=inside, other=0).to(tl.uint64) & 0xFFFFFFFF
    hi = tl.load(seed_hi + row, mask=inside, other=0).to(tl.uint64) & 0xFFFFFFFF
    pos = tl.load(positions + offs, mask=inside, other=0).to(tl.uint64) & 0xFFFFFFFF
    k = tl.full([BLOCK], key, tl.uint64)
    h = _mix32(lo ^ _mix32(hi ^ _mix32(pos ^ _mix32(k))))
    h2 = _mix32(h ^ second_key)
    bits = ((h >> 11) << 32) | h2  # < 2^53: exact in float64
    tl.store(out + offs, bits.to(tl.float64) * (1.0 / 9007199254740992.0), mask=inside)


@triton.jit
def _sample_kernel(values, shift, inv_t, floor, chunk_sums, u, out, vocab, stride_row, num_chunks,
                   LOGITS: tl.constexpr, FLOOR: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """One row: locate the chunk where u x total falls (its chunk sums' running total), then the token inside
    it (the running total of that chunk's weights, recomputed from the logits)."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    valid = c < num_chunks
    sums = tl.load(chunk_sums + row * num_chunks + c, mask=valid, other=0.0).to(tl.float64)
    # NOTE: a parallel scan rounds each prefix in its own order, so its values need not be monotone (zeros added
    # can still change them): pick the first positive entry whose running total exceeds the value, else the last
    # positive entry; a zero-weight chunk or token is never chosen.
    cum = tl.cumsum(sums, 0)
    positive = valid & (sums > 0)
    last = tl.max(tl.where(positive, c, -1), 0)
    total = tl.max(tl.where(c == last, cum, 0.0), 0)
    value = tl.load(u + row).to(tl.float64) * total
    at = tl.minimum(tl.min(tl.where(positive & (cum > value), c, BLOCK_C), 0), last)
    prefix = tl.sum(tl.where(c < at, sums, 0.0), 0)
    lane = tl.arange(0, CHUNK)
    offs = at * CHUNK + lane
    inside = offs < vocab
    if LOGITS:
        x = tl.load(values + row * stride_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
        sl = (x - tl.load(shift + row)) * tl.load(inv_t + row)
        w = tl.exp(sl).to(tl.float64)
        if FLOOR:
            w = tl.where(sl >= tl.load(floor + row), w, 0.0)
    else:
        w = tl.load(values + row * stride_row + offs, mask=inside, other=0.0).to(tl.float64)
    w = tl.where(inside, w, 0.0)
    local = tl.cumsum(w, 0) + prefix
    live = w > 0
    k = tl.minimum(tl.min(tl.where(live & (local > value), lane, CHUNK), 0), tl.max(tl.where(live, lane, -1), 0))
    tl.store(out + row, (at * CHUNK + k).to(tl.int64))


@triton.jit
def _row_tokens_kernel(logits, stride_row, vocab, index, max_index, greedy, temperature, top_k, top_p, seed_lo,
                       seed_hi, positions, offset, out, key, second_key, SAMPLED: tl.constexpr, FILTERED: tl.constexpr,
                       INDEXED: tl.constexpr,
                       CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, VBLOCK: tl.constexpr,
                       KEY_ALL: tl.constexpr, KEY_BITS: tl.constexpr, SCALE: tl.constexpr, ACCURATE: tl.constexpr,
                       KEY16: tl.constexpr, DTYPE: tl.constexpr):
    """The target's token of one row whose vocabulary fits one tile: its argmax (the first maximal entry), or
    for a sampled row the inverse-CDF draw the unfused path makes, step by step in the same arithmetic (the row's
    floor as `triton_filters._row_kernel`, the chunk sums as `_chunk_exp_sums_kernel`, the uniform as
    `_keyed_uniforms_kernel`, the two-level search as `_sample_kernel`)."""
    row = tl.program_id(0)
    base = logits + row.to(tl.int64) * stride_row
    offs = tl.arange(0, VBLOCK)
    inside = offs < vocab
    raw = tl.load(base + offs, mask=inside, other=float("-inf"))
    x = raw.to(tl.float32)
    token = tl.argmax(x, 0, tie_break_left=True).to(tl.int64)
    if SAMPLED:
        req = row
        if INDEXED:
            req = tl.minimum(tl.load(index + row), max_index)
        if tl.load(greedy + req) == 0:
            m = tl.max(x, 0)
            # NOTE: IEEE division, as torch's 1 / T.clamp_min(1e-6) (`sampling._inv_t`)
            it = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.maximum(tl.load(temperature + req), 1e-6))
            floor = tl.full((), float("-inf"), tl.float32)
            if FILTERED:
                floor = _row_floor(raw, inside, m, it, tl.load(top_k + req).to(tl.int64), tl.load(top_p + req), vocab,
                                   KEY_ALL, KEY_BITS, SCALE, ACCURATE, KEY16, DTYPE)
            c = tl.arange(0, BLOCK_C)
            sums = tl.zeros([BLOCK_C], tl.float64)
            for i in tl.static_range(NUM_CHUNKS):
                co = i * CHUNK + tl.arange(0, CHUNK)
                sc = (tl.load(base + co, mask=co < vocab, other=float("-inf")).to(tl.float32) - m) * it
                e = tl.exp(sc)
                if FILTERED:
                    e = tl.where(sc >= floor, e, 0.0)
                sums = tl.where(c == i, tl.sum(e, 0).to(tl.float64), sums)
            lo = tl.load(seed_lo + req).to(tl.uint64) & 0xFFFFFFFF
            hi = tl.load(seed_hi + req).to(tl.uint64) & 0xFFFFFFFF
            pos = (tl.load(positions + row) + offset).to(tl.uint64) & 0xFFFFFFFF
            h = _mix32(lo ^ _mix32(hi ^ _mix32(pos ^ _mix32(tl.full((), key, tl.uint64)))))
            h2 = _mix32(h ^ second_key)
            u = (((h >> 11) << 32) | h2).to(tl.float64) * (1.0 / 9007199254740992.0)
            valid = c < NUM_CHUNKS
            cum = tl.cumsum(sums, 0)
            positive = valid & (sums > 0)
            last = tl.max(tl.where(positive, c, -1), 0)
            total = tl.max(tl.where(c == last, cum, 0.0), 0)
            value = u * total
            at = tl.minimum(tl.min(tl.where(positive & (cum > value), c, BLOCK_C), 0), last)
            prefix = tl.sum(tl.where(c < at, sums, 0.0), 0)
            lane = tl.arange(0, CHUNK)
            co = at * CHUNK + lane
            chunk_in = co < vocab
            sl = (tl.load(base + co, mask=chunk_in, other=float("-inf")).to(tl.float32) - m) * it
            w = tl.exp(sl).to(tl.float64)
            if FILTERED:
                w = tl.where(sl >= floor, w, 0.0)
            w = tl.where(chunk_in, w, 0.0)
            local = tl.cumsum(w, 0) + prefix
            live = w > 0
            k = tl.minimum(tl.min(tl.where(live & (local > value), lane, CHUNK), 0),
                           tl.max(tl.where(live, lane, -1), 0))
            token = (at * CHUNK + k).to(tl.int64)
    tl.store(out + row, token)



def chunk_exp_sums_triton(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, chunk: int,
                          floor: torch.Tensor | None = None) -> torch.Tensor:
    if logits.dtype not in _DTYPES:
        raise ValueError(f"Triton chunk sums take {_DTYPES} logits, got {logits.dtype}: use DSCALE_FUSED=ref "
                         "(KernelChoice.fused='ref')")
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [R, V] with contiguous rows"
    assert chunk & (chunk - 1) == 0, "the chunk must be a power of two"
    require_interpreter_on_cpu(logits, "Triton chunk sums", "fused")
    rows, vocab = logits.shape
    num_chunks = -(-vocab // chunk)
    # NOTE: allocated by torch on the logits' device: inside a CUDA graph capture, from the graph's pool.
    out = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    if rows:
        shift = shift.float().contiguous()
        _chunk_exp_sums_kernel[(rows, num_chunks)](logits, shift, inv_t.float().contiguous(),
                                                   shift if floor is None else floor.float().contiguous(), out,
                                                   vocab, logits.stride(0), num_chunks, CHUNK=chunk,
                                                   FLOOR=floor is not None, num_warps=4)
    return out


def keyed_uniforms_triton(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, key: int,
                          second_key: int) -> torch.Tensor:
    """seeds [R] int64, positions [R, ...] int64 contiguous -> float64 [R, ...] (row r's seeds key all of its
    positions); `key` = the purpose's 32-bit key, `second_key` the chain's second constant."""
    assert positions.is_contiguous() and seed_lo.shape == seed_hi.shape == positions.shape[:1]
    require_interpreter_on_cpu(positions, "Triton draws", "fused")
    out = torch.empty(positions.shape, dtype=torch.float64, device=positions.device)
    total = positions.numel()
    if total:
        block = 256
        _keyed_uniforms_kernel[(triton.cdiv(total, block),)](
            seed_lo.long().contiguous(), seed_hi.long().contiguous(), positions.long(), out, total,
            max(total // positions.shape[0], 1), key, second_key, BLOCK=block, num_warps=4)
    return out


def sample_triton(values: torch.Tensor, shift: torch.Tensor | None, inv_t: torch.Tensor | None,
                  chunk_sums: torch.Tensor, u: torch.Tensor, chunk: int,
                  floor: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of a policy (`dscale_runtime.sampling.Policy`: logits with shift / inv_t and an optional
    floor, or dense weights when shift is None) at uniforms u [R] -> int64 [R], in one launch."""
    assert values.dim() == 2 and values.stride(-1) == 1 and chunk & (chunk - 1) == 0
    require_interpreter_on_cpu(values, "Triton sampling", "fused")
    rows, vocab = values.shape
    out = torch.empty(rows, dtype=torch.long, device=values.device)
    if rows:
        logits = shift is not None
        dummy = chunk_sums  # NOTE: never read when LOGITS (FLOOR) is false
        floored = logits and floor is not None
        _sample_kernel[(rows,)](values, shift.float().contiguous() if logits else dummy,
                                inv_t.float().contiguous() if logits else dummy,
                                floor.float().contiguous() if floored else dummy, chunk_sums.contiguous(),
                                u.double().contiguous(), out, vocab, values.stride(0), chunk_sums.shape[1],
                                LOGITS=logits, FLOOR=floored, CHUNK=chunk,
                                BLOCK_C=triton.next_power_of_2(chunk_sums.shape[1]), num_warps=4)
    return out


def row_tokens_triton(logits: torch.Tensor, sampled: bool, filtered: bool, index: torch.Tensor | None = None,
                      max_index: int = 0, greedy: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                      top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                      seed_lo: torch.Tensor | None = None, seed_hi: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None, offset: int = 0, key: int = 0, second_key: int = 0,
                      chunk: int = 1024) -> torch.Tensor:
    """The target's token of every row of logits [R, V] (V <= ROW_PROGRAM_VOCAB, contiguous rows) in one launch: the
    argmax, or with `sampled` the keyed inverse-CDF draw of `sampling.target_tokens`'s unfused path for rows whose
    request is not greedy. Row r reads its request's parameters (greedy / temperature / top_k / top_p / seeds
    [B]) at min(index[r], max_index) (index None: at r) and draws at positions[r] + offset with the 32-bit `key` of its purpose."""
    rows, vocab = logits.shape
    assert vocab <= ROW_PROGRAM_VOCAB and logits.stride(-1) == 1 and chunk & (chunk - 1) == 0
    if logits.dtype not in _DTYPES:
        raise ValueError(f"Triton row tokens take {_DTYPES} logits, got {logits.dtype}: use DSCALE_FUSED=ref "
                         "(KernelChoice.fused='ref')")
    require_interpreter_on_cpu(logits, "Triton row tokens", "fused")
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    if sampled:
        params = (out if index is None else index.long().contiguous(), max_index, greedy.contiguous(), temperature.float().contiguous(),
                  top_k.long().contiguous(), top_p.float().contiguous(), seed_lo.long().contiguous(),
                  seed_hi.long().contiguous(), positions.long().contiguous(), offset)
    else:  # NOTE: never read without SAMPLED
        params = (out, 0, out, out, out, out, out, out, out, 0)
    num_chunks = -(-vocab // chunk)
    key16 = logits.dtype in _DTYPES16
    # NOTE: 4 warps as the unfused kernels: the chunk sums and scans then add in their order (same draws)
    _row_tokens_kernel[(rows,)](logits, logits.stride(0), vocab, *params, out, key, second_key, SAMPLED=sampled,
                                FILTERED=sampled and filtered, INDEXED=index is not None, CHUNK=chunk, NUM_CHUNKS=num_chunks,
                                BLOCK_C=triton.next_power_of_2(num_chunks),
                                VBLOCK=max(triton.next_power_of_2(vocab), chunk), KEY_ALL=KEY_ALL,
                                KEY_BITS=16 if key16 else KEY_BITS, SCALE=float(2**MASS_BITS),
                                ACCURATE=not interpreted(), KEY16=key16,
                                DTYPE=_DTYPES16.get(logits.dtype, tl.float16), num_warps=4)
    return out
