"""Triton kernels of the sampler: chunk sums of a tempered softmax's weights, read straight from the logits (one
pass, any float dtype), and the counter-based uniforms of `kernels.sampling.keyed_uniforms_ref`, bit for bit.

`chunk_exp_sums_triton(logits [R, V], shift [R], inv_t [R], chunk)` -> [R, C] fp32, C = ceil(V / chunk):
sum over each chunk of exp((l - shift) * inv_t) (with a floor [R]: over the entries with (l - shift) * inv_t >=
floor, the top-k / top-p policies of `kernels/filters.py`), one program per (row, chunk), static grid
(graph-safe). The sampler's two-level inverse CDF (`dscale_runtime.sampling`) needs nothing else of the full
row, so no fp32 copy of the [R, V] logits is ever written.

`row_tokens_triton` draws a token per row of a one-tile vocabulary in one launch (and can store each row's policy
beside it); `accept_rules_triton` accepts every request's drafts by its rule in one launch (one program per request,
the residual of a rejected sampled draft drawn over the vocabulary in chunks): the sampled step's two fused kernels.

This module imports triton at import time: import it only through `dscale_runtime.kernels.sampling`, which
does so lazily. With TRITON_INTERPRET=1 set before triton is imported, it runs in Triton's interpreter on CPU
tensors too (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

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
def _keyed_uniform(lo, hi, positions, key, second_key):
    """The keyed draw of seeds (lo, hi) (uint64 holding 32 bits) at positions (any int shape; their low 32 bits key):
    h = mix(lo ^ mix(hi ^ mix(pos ^ mix(key)))), h2 = mix(h ^ second_key), ((h >> 11) * 2^32 + h2) / 2^53
    (`kernels.sampling.keyed_uniforms_ref`, bit for bit: < 2^53, exact in float64)."""
    pos = positions.to(tl.uint64) & 0xFFFFFFFF
    h = _mix32(lo ^ _mix32(hi ^ _mix32(pos ^ _mix32(tl.full((), key, tl.uint64)))))
    h2 = _mix32(h ^ second_key)
    return (((h >> 11) << 32) | h2).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _keyed_uniforms_kernel(seed_lo, seed_hi, positions, out, total, per_row, key, second_key,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total
    row = offs // per_row
    lo = tl.load(seed_lo + row, mask=inside, other=0).to(tl.uint64) & 0xFFFFFFFF
    hi = tl.load(seed_hi + row, mask=inside, other=0).to(tl.uint64) & 0xFFFFFFFF
    pos = tl.load(positions + offs, mask=inside, other=0)
    tl.store(out + offs, _keyed_uniform(lo, hi, pos, key, second_key), mask=inside)


@triton.jit
def _locate_chunk(sums, valid, c, u, BLOCK_C: tl.constexpr):
    """The inverse CDF's first level over one row's chunk sums [BLOCK_C] float64 (0 where not `valid`) at the uniform
    u: (the chunk, the weight of the chunks before it, u x the total, the total)."""
    # NOTE: a parallel scan rounds each prefix in its own order, so its values need not be monotone (zeros added
    # can still change them): pick the first positive entry whose running total exceeds the value, else the last
    # positive entry; a zero-weight chunk or token is never chosen.
    cum = tl.cumsum(sums, 0)
    positive = valid & (sums > 0)
    last = tl.max(tl.where(positive, c, -1), 0)
    total = tl.max(tl.where(c == last, cum, 0.0), 0)
    value = u * total
    at = tl.minimum(tl.min(tl.where(positive & (cum > value), c, BLOCK_C), 0), last)
    return at, tl.sum(tl.where(c < at, sums, 0.0), 0), value, total


@triton.jit
def _locate_token(w, prefix, value, CHUNK: tl.constexpr):
    """The second level: the lane of the chunk's weights w [CHUNK] float64 where the running total (from `prefix`)
    first exceeds `value`, else its last positive lane."""
    lane = tl.arange(0, CHUNK)
    local = tl.cumsum(w, 0) + prefix
    live = w > 0
    return tl.minimum(tl.min(tl.where(live & (local > value), lane, CHUNK), 0), tl.max(tl.where(live, lane, -1), 0))


@triton.jit
def _sample_kernel(values, shift, inv_t, floor, chunk_sums, u, out, vocab, stride_row, num_chunks,
                   LOGITS: tl.constexpr, FLOOR: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    """One row: locate the chunk where u x total falls (its chunk sums' running total), then the token inside
    it (the running total of that chunk's weights, recomputed from the logits)."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    valid = c < num_chunks
    sums = tl.load(chunk_sums + row * num_chunks + c, mask=valid, other=0.0).to(tl.float64)
    at, prefix, value, total = _locate_chunk(sums, valid, c, tl.load(u + row).to(tl.float64), BLOCK_C)
    offs = at * CHUNK + tl.arange(0, CHUNK)
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
    tl.store(out + row, (at * CHUNK + _locate_token(w, prefix, value, CHUNK)).to(tl.int64))


@triton.jit
def _row_tokens_kernel(logits, stride_row, vocab, index, max_index, greedy, temperature, top_k, top_p, seed_lo,
                       seed_hi, positions, offset, out, stat_shift, stat_inv_t, stat_floor, stat_total, key, second_key,
                       out_group, out_stride,
                       SAMPLED: tl.constexpr, FILTERED: tl.constexpr, INDEXED: tl.constexpr, PER_REQ: tl.constexpr,
                       STATS: tl.constexpr, OUT_MAP: tl.constexpr,
                       CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, VBLOCK: tl.constexpr,
                       KEY_ALL: tl.constexpr, KEY_BITS: tl.constexpr, SCALE: tl.constexpr, ACCURATE: tl.constexpr,
                       KEY16: tl.constexpr, DTYPE: tl.constexpr):
    """The target's token of one row whose vocabulary fits one tile: its argmax (the first maximal entry), or
    for a sampled row the inverse-CDF draw the unfused path makes, step by step in the same arithmetic (the row's
    floor as `triton_filters._row_kernel`, the chunk sums as `_chunk_exp_sums_kernel`, the uniform as
    `_keyed_uniforms_kernel`, the two-level search as `_sample_kernel`). PER_REQ rows per request: row r is slot
    r % PER_REQ of request r // PER_REQ and draws at positions[request] + offset + r % PER_REQ. With STATS the row's
    policy is stored beside its token (shift, inverse temperature, floor, total weight; greedy rows: their max, 1,
    -inf and 1, finite placeholders) so that no other pass over the row is needed to weigh its entries. OUT_MAP:
    row r's token goes to out[r // out_group, r % out_group] of rows `out_stride` apart (a block's draft slots)."""
    row = tl.program_id(0)
    base = logits + row.to(tl.int64) * stride_row
    offs = tl.arange(0, VBLOCK)
    inside = offs < vocab
    raw = tl.load(base + offs, mask=inside, other=float("-inf"))
    x = raw.to(tl.float32)
    token = tl.argmax(x, 0, tie_break_left=True).to(tl.int64)
    if SAMPLED:
        req = row // PER_REQ
        if INDEXED:
            req = tl.minimum(tl.load(index + row), max_index)
        m = tl.max(x, 0)
        it = tl.full((), 1.0, tl.float32)
        floor = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 1.0, tl.float64)
        if tl.load(greedy + req) == 0:
            # NOTE: IEEE division, as torch's 1 / T.clamp_min(1e-6) (`sampling._inv_t`)
            it = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.maximum(tl.load(temperature + req), 1e-6))
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
            u = _keyed_uniform(tl.load(seed_lo + req).to(tl.uint64) & 0xFFFFFFFF,
                               tl.load(seed_hi + req).to(tl.uint64) & 0xFFFFFFFF,
                               tl.load(positions + row // PER_REQ) + offset + row % PER_REQ, key, second_key)
            at, prefix, value, total = _locate_chunk(sums, c < NUM_CHUNKS, c, u, BLOCK_C)
            co = at * CHUNK + tl.arange(0, CHUNK)
            chunk_in = co < vocab
            sl = (tl.load(base + co, mask=chunk_in, other=float("-inf")).to(tl.float32) - m) * it
            w = tl.exp(sl).to(tl.float64)
            if FILTERED:
                w = tl.where(sl >= floor, w, 0.0)
            w = tl.where(chunk_in, w, 0.0)
            token = (at * CHUNK + _locate_token(w, prefix, value, CHUNK)).to(tl.int64)
        if STATS:
            tl.store(stat_shift + row, m)
            tl.store(stat_inv_t + row, it)
            tl.store(stat_floor + row, floor)
            tl.store(stat_total + row, total)
    if OUT_MAP:
        tl.store(out + (row // out_group).to(tl.int64) * out_stride + row % out_group, token)
    else:
        tl.store(out + row, token)


@triton.jit
def _wide_max_kernel(logits, stride_row, vocab, cmax, carg, num_chunks, CHUNK: tl.constexpr):
    """Program (row, chunk): the chunk's largest logit (fp32) and its first index."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits + row.to(tl.int64) * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    tl.store(cmax + row * num_chunks + chunk, m)
    tl.store(carg + row * num_chunks + chunk, tl.min(tl.where(x == m, offs, vocab), 0).to(tl.int64))


@triton.jit
def _wide_request(row, index, max_index, INDEXED: tl.constexpr, PER_REQ: tl.constexpr):
    """Row `row`'s request: min(index[row], max_index), or row // PER_REQ."""
    if INDEXED:
        return tl.minimum(tl.load(index + row), max_index)
    return (row // PER_REQ).to(tl.int64)


@triton.jit
def _wide_row_kernel(cmax, carg, num_chunks, index, max_index, temperature, shift_out, inv_t_out, arg_out,
                     INDEXED: tl.constexpr, PER_REQ: tl.constexpr, BLOCK_C: tl.constexpr):
    """One row: its largest logit (the policy's shift), its first argmax and its request's 1 / T (`sampling._inv_t`)."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    m = tl.load(cmax + row * num_chunks + c, mask=c < num_chunks, other=float("-inf"))
    top = tl.max(m, 0)
    first = tl.min(tl.where(m == top, c, BLOCK_C), 0)
    req = _wide_request(row, index, max_index, INDEXED, PER_REQ)
    tl.store(shift_out + row, top)
    tl.store(inv_t_out + row, tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.maximum(tl.load(temperature + req), 1e-6)))
    tl.store(arg_out + row, tl.load(carg + row * num_chunks + first))


@triton.jit
def _wide_draw_kernel(logits, stride_row, vocab, sums, num_chunks, shift, inv_t, floor, arg, index, max_index, greedy,
                      seed_lo, seed_hi, positions, offset, key, second_key, out, total_out,
                      INDEXED: tl.constexpr, PER_REQ: tl.constexpr, FLOOR: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """One row's token: its argmax where its request is greedy, else `_sample_kernel`'s draw at the keyed uniform of
    its position (`target_tokens` / `draft_draws` unfused, bit for bit); the total weight beside it."""
    row = tl.program_id(0)
    req = _wide_request(row, index, max_index, INDEXED, PER_REQ)
    c = tl.arange(0, BLOCK_C)
    valid = c < num_chunks
    chunk_sums = tl.load(sums + row * num_chunks + c, mask=valid, other=0.0).to(tl.float64)
    u = _keyed_uniform(tl.load(seed_lo + req).to(tl.uint64) & 0xFFFFFFFF,
                       tl.load(seed_hi + req).to(tl.uint64) & 0xFFFFFFFF,
                       tl.load(positions + row // PER_REQ) + offset + row % PER_REQ, key, second_key)
    at, prefix, value, total = _locate_chunk(chunk_sums, valid, c, u, BLOCK_C)
    token = tl.load(arg + row)
    if tl.load(greedy + req) == 0:
        offs = at * CHUNK + tl.arange(0, CHUNK)
        inside = offs < vocab
        x = tl.load(logits + row.to(tl.int64) * stride_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
        sl = (x - tl.load(shift + row)) * tl.load(inv_t + row)
        w = tl.exp(sl).to(tl.float64)
        if FLOOR:
            w = tl.where(sl >= tl.load(floor + row), w, 0.0)
        w = tl.where(inside, w, 0.0)
        token = (at * CHUNK + _locate_token(w, prefix, value, CHUNK)).to(tl.int64)
    tl.store(out + row, token)
    tl.store(total_out + row, total)


@triton.jit
def _policy_weights(logits, stride_row, rows, cols, mask, shift, inv_t, floor, FLOOR: tl.constexpr,
                    ACCURATE: tl.constexpr):
    """float64 weights exp(s), s = (l - shift) * inv_t in fp32, 0 below the row's floor (`Policy.weights_at`) of
    entries (rows, cols) of a policy kept as logits; masked entries weigh 0. ACCURATE: libdevice's expf, torch's
    own on CUDA (the interpreter has numpy's)."""
    x = tl.load(logits + rows.to(tl.int64) * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
    s = (x - tl.load(shift + rows, mask=mask, other=0.0)) * tl.load(inv_t + rows, mask=mask, other=1.0)
    e = tl.exp(s)
    if ACCURATE:
        e = libdevice.exp(s)
    w = e.to(tl.float64)
    if FLOOR:
        w = tl.where(s >= tl.load(floor + rows, mask=mask, other=float("-inf")), w, 0.0)
    return tl.where(mask, w, 0.0)


@triton.jit
def _accept_head(b, t_logits, t_stride, t_shift, t_inv_t, t_floor, t_total, num_rows,
                 d_logits, d_stride, d_shift, d_inv_t, d_floor, d_total, tokens, block, lens, offsets, rule,
                 seed_lo, seed_hi, ctx, rule_sampled, coin_key, second_key, W: tl.constexpr, BLOCK_J: tl.constexpr,
                 T_FLOOR: tl.constexpr, D_FLOOR: tl.constexpr, ACCURATE: tl.constexpr):
    """Request b's acceptance before any residual: (accepted drafts, successor by its rule's matches, whether the
    residual is drawn (a sampled-drafts request rejected a verified draft), the successor's row, the rejected
    draft's q row, the request's seeds and context)."""
    k = tl.load(lens + b)
    o = tl.load(offsets + b)
    j = tl.arange(0, BLOCK_J)  # lane j: draft slot j + 1
    in_block = j < W - 1
    verified = in_block & (j + 1 < k)
    rows = tl.minimum(tl.maximum(o + j, 0), num_rows - 1)  # the row that judges slot j + 1
    drafts = tl.load(block + b * W + 1 + j, mask=in_block, other=0)
    top1 = drafts == tl.load(tokens + rows, mask=in_block, other=-1)
    sampled = tl.load(rule + b) == rule_sampled
    p_x = _policy_weights(t_logits, t_stride, rows, drafts, in_block, t_shift, t_inv_t, t_floor, T_FLOOR,
                          ACCURATE) / tl.load(t_total + rows, mask=in_block, other=1.0)
    q_rows = b * (W - 1) + j
    q_x = _policy_weights(d_logits, d_stride, q_rows, drafts, in_block, d_shift, d_inv_t, d_floor, D_FLOOR,
                          ACCURATE) / tl.load(d_total + q_rows, mask=in_block, other=1.0)
    lo = tl.load(seed_lo + b).to(tl.uint64) & 0xFFFFFFFF
    hi = tl.load(seed_hi + b).to(tl.uint64) & 0xFFFFFFFF
    c0 = tl.load(ctx + b)
    coins = _keyed_uniform(lo, hi, c0 + 1 + j, coin_key, second_key)
    passed = tl.where(sampled, coins * q_x < p_x, top1) & verified
    acc = tl.min(tl.where(passed, BLOCK_J, j), 0)  # the first slot that failed: lanes past W - 2 always fail
    succ_row = tl.minimum(o + acc, num_rows - 1)
    q_row = b * (W - 1) + tl.minimum(acc, W - 2)  # the rejected draft's q
    return acc, tl.load(tokens + succ_row), sampled & (acc < k - 1), succ_row, q_row, lo, hi, c0


@triton.jit
def _residual_weights(cols, inside, t_logits, t_stride, t_shift, t_inv_t, t_floor, succ_row, p_total,
                      d_logits, d_stride, d_shift, d_inv_t, d_floor, q_row, q_total, T_FLOOR: tl.constexpr,
                      D_FLOOR: tl.constexpr, ACCURATE: tl.constexpr):
    """p's and q's probabilities (float64) at entries `cols` of the successor's row and the rejected draft's."""
    wp = _policy_weights(t_logits, t_stride, succ_row + 0 * cols, cols, inside, t_shift, t_inv_t, t_floor, T_FLOOR,
                         ACCURATE) / p_total
    wq = _policy_weights(d_logits, d_stride, q_row + 0 * cols, cols, inside, d_shift, d_inv_t, d_floor, D_FLOOR,
                         ACCURATE) / q_total
    return wp, wq


@triton.jit
def _accept_rules_kernel(t_logits, t_stride, t_shift, t_inv_t, t_floor, t_total, num_rows,
                         d_logits, d_stride, d_shift, d_inv_t, d_floor, d_total,
                         tokens, block, lens, offsets, rule, seed_lo, seed_hi, ctx, accepted_out, successor_out,
                         sums_in, vocab, num_chunks, rule_sampled, coin_key, residual_key, second_key,
                         W: tl.constexpr, BLOCK_J: tl.constexpr, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr,
                         T_FLOOR: tl.constexpr, D_FLOOR: tl.constexpr, ACCURATE: tl.constexpr, SPLIT: tl.constexpr):
    """One request: its accepted drafts and successor by its rule (`verify.accept_rules`'s reference: the top-1
    rule's matches, or the sampled-drafts rule's coins against p(x) / q(x) and, after a rejection, the draw from
    max(0, p - q) over the vocabulary in chunks, as `sampling.sample`'s two levels). SPLIT: the chunks' residual
    and p sums come from `_residual_sums_kernel` (sums_in [B, num_chunks, 2]) instead of this program's own pass."""
    b = tl.program_id(0)
    acc, succ, residual, succ_row, q_row, lo, hi, c0 = _accept_head(
        b, t_logits, t_stride, t_shift, t_inv_t, t_floor, t_total, num_rows, d_logits, d_stride, d_shift, d_inv_t,
        d_floor, d_total, tokens, block, lens, offsets, rule, seed_lo, seed_hi, ctx, rule_sampled, coin_key,
        second_key, W, BLOCK_J, T_FLOOR, D_FLOOR, ACCURATE)
    if residual:
        p_total = tl.load(t_total + succ_row)
        q_total = tl.load(d_total + q_row)
        c = tl.arange(0, BLOCK_C)
        lane = tl.arange(0, CHUNK)
        valid = c < num_chunks
        if SPLIT:
            at_c = (b * num_chunks + c).to(tl.int64) * 2
            sums_r = tl.load(sums_in + at_c, mask=valid, other=0.0)
            sums_p = tl.load(sums_in + at_c + 1, mask=valid, other=0.0)
        else:
            sums_r = tl.zeros([BLOCK_C], tl.float64)
            sums_p = tl.zeros([BLOCK_C], tl.float64)
            for i in range(0, num_chunks):
                cols = i * CHUNK + lane
                wp, wq = _residual_weights(cols, cols < vocab, t_logits, t_stride, t_shift, t_inv_t, t_floor,
                                           succ_row, p_total, d_logits, d_stride, d_shift, d_inv_t, d_floor, q_row,
                                           q_total, T_FLOOR, D_FLOOR, ACCURATE)
                sums_r = tl.where(c == i, tl.sum(tl.maximum(wp - wq, 0.0), 0), sums_r)
                sums_p = tl.where(c == i, tl.sum(wp, 0), sums_p)
        # NOTE: p == q at that row makes a rejection impossible: the residual is then p (never used)
        use_p = tl.sum(sums_r, 0) <= 0
        sums = tl.where(use_p, sums_p, sums_r)
        at, prefix, value, total = _locate_chunk(sums, valid, c, _keyed_uniform(lo, hi, c0 + 1, residual_key,
                                                                                 second_key), BLOCK_C)
        cols = at * CHUNK + lane
        wp, wq = _residual_weights(cols, cols < vocab, t_logits, t_stride, t_shift, t_inv_t, t_floor, succ_row,
                                   p_total, d_logits, d_stride, d_shift, d_inv_t, d_floor, q_row, q_total, T_FLOOR,
                                   D_FLOOR, ACCURATE)
        w = tl.where(use_p, wp, tl.maximum(wp - wq, 0.0))
        succ = (at * CHUNK + _locate_token(w, prefix, value, CHUNK)).to(tl.int64)
    tl.store(accepted_out + b, acc.to(tl.int64))
    tl.store(successor_out + b, succ)


@triton.jit
def _residual_sums_kernel(t_logits, t_stride, t_shift, t_inv_t, t_floor, t_total, num_rows,
                          d_logits, d_stride, d_shift, d_inv_t, d_floor, d_total,
                          tokens, block, lens, offsets, rule, seed_lo, seed_hi, ctx, sums_out, vocab, num_chunks,
                          rule_sampled, coin_key, second_key, W: tl.constexpr, BLOCK_J: tl.constexpr,
                          CHUNK: tl.constexpr, T_FLOOR: tl.constexpr, D_FLOOR: tl.constexpr, ACCURATE: tl.constexpr):
    """Program (b, i): request b's acceptance as `_accept_rules_kernel` finds it and, where it draws the residual,
    chunk i's sums of max(0, p - q) and of p -> sums_out[b, i, 0:2] (the sequential pass's sums, in parallel);
    other requests write nothing (their sums are never read)."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    acc, succ, residual, succ_row, q_row, lo, hi, c0 = _accept_head(
        b, t_logits, t_stride, t_shift, t_inv_t, t_floor, t_total, num_rows, d_logits, d_stride, d_shift, d_inv_t,
        d_floor, d_total, tokens, block, lens, offsets, rule, seed_lo, seed_hi, ctx, rule_sampled, coin_key,
        second_key, W, BLOCK_J, T_FLOOR, D_FLOOR, ACCURATE)
    if residual:
        cols = i * CHUNK + tl.arange(0, CHUNK)
        wp, wq = _residual_weights(cols, cols < vocab, t_logits, t_stride, t_shift, t_inv_t, t_floor, succ_row,
                                   tl.load(t_total + succ_row), d_logits, d_stride, d_shift, d_inv_t, d_floor, q_row,
                                   tl.load(d_total + q_row), T_FLOOR, D_FLOOR, ACCURATE)
        at = (b * num_chunks + i).to(tl.int64) * 2
        tl.store(sums_out + at, tl.sum(tl.maximum(wp - wq, 0.0), 0))
        tl.store(sums_out + at + 1, tl.sum(wp, 0))


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
                      chunk: int = 1024, per_request: int = 1, stats: bool = False, wide: bool | None = None,
                      out: torch.Tensor | None = None):
    """The target's token of every row of logits [R, V] (contiguous rows) in one launch: the argmax, or with `sampled`
    the keyed inverse-CDF draw of `sampling.target_tokens`'s unfused path for rows whose request is not greedy. Row r
    reads its request's parameters (greedy / temperature / top_k / top_p / seeds [B]) at min(index[r], max_index)
    (index None: at r // per_request) and draws at positions[r] + offset (index None and per_request > 1: at
    positions[r // per_request] + offset + r % per_request, a request's slots) with the 32-bit `key` of its
    purpose. With `stats` (sampled only) -> (tokens, (shift fp32, inv_t fp32, floor fp32, total fp64) [R]): each
    row's policy as `sampling.make_policy` keeps it, written by the same program.

    `wide` (default: V > ROW_PROGRAM_VOCAB; sampled only): rows too long for one program (Qwen3's 151,936 tokens)
    take four launches instead of the unfused path's ~20: the chunks' maxima, each row's shift / argmax / 1 / T, the
    chunk sums (`chunk_exp_sums_triton`; the floors between, for `filtered`), then the draw or argmax with the total;
    the same arithmetic, so the same tokens.

    `out` (one-program rows only): an int64 [G, P] view with unit last stride, G x P = R, that takes the tokens
    (row r at [r // P, r % P]; a block's draft slots `block[:, 1:]`) instead of a new [R] tensor."""
    rows, vocab = logits.shape
    wide = vocab > ROW_PROGRAM_VOCAB if wide is None else wide
    assert (wide or vocab <= ROW_PROGRAM_VOCAB) and logits.stride(-1) == 1 and chunk & (chunk - 1) == 0
    if logits.dtype not in _DTYPES:
        raise ValueError(f"Triton row tokens take {_DTYPES} logits, got {logits.dtype}: use DSCALE_FUSED=ref "
                         "(KernelChoice.fused='ref')")
    require_interpreter_on_cpu(logits, "Triton row tokens", "fused")
    assert not (stats and not sampled) and (per_request == 1 or index is None) and (sampled or not wide)
    if out is not None:
        assert not wide and out.dim() == 2 and out.numel() == rows and out.stride(-1) == 1 and out.dtype == torch.long
    if wide:
        out, policy = _wide_row_tokens(logits, filtered, index, max_index, greedy, temperature, top_k, top_p, seed_lo,
                                       seed_hi, positions, offset, key, second_key, chunk, per_request)
        return (out, policy) if stats else out
    mapped = out is not None
    out = out if mapped else torch.empty(rows, dtype=torch.long, device=logits.device)
    policy = None
    if stats:
        f32 = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
        policy = (f32[0], f32[1], f32[2], torch.empty(rows, dtype=torch.float64, device=logits.device))
    if rows == 0:
        return out if policy is None else (out, policy)
    if sampled:
        params = (out if index is None else index.long().contiguous(), max_index, greedy.contiguous(), temperature.float().contiguous(),
                  top_k.long().contiguous(), top_p.float().contiguous(), seed_lo.long().contiguous(),
                  seed_hi.long().contiguous(), positions.long().contiguous(), offset)
    else:  # NOTE: never read without SAMPLED
        params = (out, 0, out, out, out, out, out, out, out, 0)
    num_chunks = -(-vocab // chunk)
    key16 = logits.dtype in _DTYPES16
    # NOTE: 4 warps as the unfused kernels: the chunk sums and scans then add in their order (same draws)
    _row_tokens_kernel[(rows,)](logits, logits.stride(0), vocab, *params, out, *(policy or (out,) * 4), key, second_key,
                                out.shape[1] if mapped else 1, out.stride(0) if mapped else 0,
                                SAMPLED=sampled, FILTERED=sampled and filtered, INDEXED=index is not None,
                                PER_REQ=per_request, STATS=stats, OUT_MAP=mapped, CHUNK=chunk, NUM_CHUNKS=num_chunks,
                                BLOCK_C=triton.next_power_of_2(num_chunks),
                                VBLOCK=max(triton.next_power_of_2(vocab), chunk), KEY_ALL=KEY_ALL,
                                KEY_BITS=16 if key16 else KEY_BITS, SCALE=float(2**MASS_BITS),
                                ACCURATE=not interpreted(), KEY16=key16,
                                DTYPE=_DTYPES16.get(logits.dtype, tl.float16), num_warps=4)
    return out if policy is None else (out, policy)


def accept_rules_triton(target: tuple, draft: tuple, tokens: torch.Tensor, block: torch.Tensor, lens: torch.Tensor,
                        offsets: torch.Tensor, rule: torch.Tensor, rule_sampled: int, seed_lo: torch.Tensor,
                        seed_hi: torch.Tensor, ctx: torch.Tensor, coin_key: int, residual_key: int, second_key: int,
                        chunk: int = 1024, split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted drafts [B] and successors [B] of every request by its rule (one program per request).
    `target` / `draft`: (logits [R, V] with contiguous rows, shift fp32 [R], inv_t fp32 [R], floor fp32 [R] or None,
    total fp64 [R]): p at the M verification rows, q at the B x (W-1) draft slots (row b (W-1) + j - 1 for slot j);
    tokens [M]: the rows' target tokens; block [B, W]; rule [B] (== rule_sampled: the sampled-drafts rule, else
    the top-1 rule); draws keyed by the requests' seeds at ctx + slot (coins) and ctx + 1 (the residual). `chunk`
    only orders the residual's sums. `split` (default: above ROW_PROGRAM_VOCAB tokens) sums the residual's chunks in
    a first launch of B x chunks programs, so the request's program no longer walks the vocabulary alone (Qwen3's
    151,936 entries: 149 sequential chunks): two launches, the same sums, the same tokens."""
    t_logits, t_shift, t_inv_t, t_floor, t_total = target
    d_logits, d_shift, d_inv_t, d_floor, d_total = draft
    b, w = block.shape
    assert t_logits.stride(-1) == 1 and d_logits.stride(-1) == 1 and chunk & (chunk - 1) == 0
    assert t_logits.shape[1] == d_logits.shape[1] and d_logits.shape[0] == b * (w - 1)
    for name, logits in (("target", t_logits), ("draft", d_logits)):
        if logits.dtype not in _DTYPES:
            raise ValueError(f"Triton acceptance takes {_DTYPES} {name} logits, got {logits.dtype}: use DSCALE_FUSED=ref "
                             "(KernelChoice.fused='ref')")
    require_interpreter_on_cpu(block, "Triton acceptance", "fused")
    accepted = torch.empty(b, dtype=torch.long, device=block.device)
    successor = torch.empty(b, dtype=torch.long, device=block.device)
    if b == 0:
        return accepted, successor
    vocab = t_logits.shape[1]
    num_chunks = -(-vocab // chunk)
    if split is None:
        split = vocab > ROW_PROGRAM_VOCAB
    f32 = lambda t: t.float().contiguous()  # noqa: E731
    args = (t_logits, t_logits.stride(0), f32(t_shift), f32(t_inv_t), f32(t_shift if t_floor is None else t_floor),
            t_total.double().contiguous(), t_logits.shape[0], d_logits, d_logits.stride(0), f32(d_shift),
            f32(d_inv_t), f32(d_shift if d_floor is None else d_floor), d_total.double().contiguous(),
            tokens.contiguous(), block.contiguous(), lens.contiguous(), offsets.contiguous(), rule.contiguous(),
            seed_lo.long().contiguous(), seed_hi.long().contiguous(), ctx.long().contiguous())
    consts = dict(W=w, BLOCK_J=triton.next_power_of_2(w), CHUNK=chunk, T_FLOOR=t_floor is not None,
                  D_FLOOR=d_floor is not None, ACCURATE=not interpreted(), num_warps=4 if chunk <= 1024 else 8)
    # NOTE: allocated by torch on the logits' device: inside a CUDA graph capture, from the graph's pool.
    sums = torch.empty(b, num_chunks, 2, dtype=torch.float64, device=block.device) if split else accepted
    if split:
        _residual_sums_kernel[(b, num_chunks)](*args, sums, vocab, num_chunks, rule_sampled, coin_key, second_key,
                                               **consts)
    _accept_rules_kernel[(b,)](*args, accepted, successor, sums, vocab, num_chunks, rule_sampled, coin_key,
                               residual_key, second_key, BLOCK_C=triton.next_power_of_2(num_chunks), SPLIT=split,
                               **consts)
    return accepted, successor


def _wide_row_tokens(logits, filtered, index, max_index, greedy, temperature, top_k, top_p, seed_lo, seed_hi,
                     positions, offset, key, second_key, chunk, per_request):
    """`row_tokens_triton`'s wide form -> (tokens [R], (shift, inv_t, floor, total) [R])."""
    from dscale_runtime.kernels.filters import filter_floor

    rows, vocab = logits.shape
    device = logits.device
    num_chunks = -(-vocab // chunk)
    block_c = triton.next_power_of_2(num_chunks)
    # NOTE: allocated by torch on the logits' device: inside a CUDA graph capture, from the graph's pool.
    out = torch.empty(rows, dtype=torch.long, device=device)
    f32 = torch.empty(2, rows, dtype=torch.float32, device=device)
    shift, inv_t, total = f32[0], f32[1], torch.empty(rows, dtype=torch.float64, device=device)
    if rows == 0:
        return out, (shift, inv_t, shift, total)
    cmax = torch.empty(rows, num_chunks, dtype=torch.float32, device=device)
    carg = torch.empty(rows, num_chunks, dtype=torch.long, device=device)
    _wide_max_kernel[(rows, num_chunks)](logits, logits.stride(0), vocab, cmax, carg, num_chunks, CHUNK=chunk,
                                         num_warps=4)
    indexed = index is not None
    index = index.long().contiguous() if indexed else out  # NOTE: never read unless INDEXED
    consts = dict(INDEXED=indexed, PER_REQ=per_request, BLOCK_C=block_c)
    _wide_row_kernel[(rows,)](cmax, carg, num_chunks, index, max_index, temperature.float().contiguous(), shift, inv_t,
                              out, **consts, num_warps=4)
    floor = None
    if filtered:
        req = index.clamp(max=max_index) if indexed else torch.arange(rows, device=device) // per_request
        floor = filter_floor(logits, shift, inv_t, top_k[req], top_p[req], "triton")
    sums = chunk_exp_sums_triton(logits, shift, inv_t, chunk, floor)
    _wide_draw_kernel[(rows,)](logits, logits.stride(0), vocab, sums, num_chunks, shift, inv_t,
                               shift if floor is None else floor, out, index, max_index, greedy.contiguous(),
                               seed_lo.long().contiguous(), seed_hi.long().contiguous(), positions.long().contiguous(),
                               offset, key, second_key, out, total, **consts, FLOOR=floor is not None, CHUNK=chunk,
                               num_warps=4)
    return out, (shift, inv_t, shift if floor is None else floor, total)
