"""The v3 agreement columns (`dvl.features.agreement_features`) in one Triton launch, read straight from the token
ring of the runner's device state.

The reference is a fixed-shape tensor function of about fifty launches (the token window's gather, the [N, K, R]
equality tensor, its shifted spans, the prompt-lookup suffixes); in a captured DScale step each is a graph node of
a microsecond or two. Here a program per request loads its window from the ring (`DeviceState.tokens`: the token
at position t in column t % R; the anchor from the block), and for each span length i + 1 <= `agreement_ngram`
compares the window shifted by i with the drafts shifted by i, a [P, R] tile, keeping the running AND of the
shorter spans: the longest span ending at each draft is the count of lengths still found. Prompt lookup runs the
same AND over the suffixes ending at the anchor, keeps the latest end of the longest one that recurs, and compares
the tokens after it with the drafts. Every value is an integer count or flag: the columns equal the reference's
exactly.

The grid depends on shapes only: safe to capture in a CUDA graph. This module imports triton at import time: the
runner imports it lazily, where `KernelChoice.decision` is 'triton'. With TRITON_INTERPRET=1 set before
triton is imported, the kernel runs in Triton's interpreter (CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.kernels.triton_fused import interpreted, require_interpreter_on_cpu


@triton.jit
def _window(ring_ptr, row, ctx, anchor, idx, R: tl.constexpr):
    """Window entries idx (any shape; index R - 1 is the anchor at position ctx) -> (tokens, valid): valid where
    0 <= idx < R and the position ctx - (R - 1) + idx is >= 0."""
    position = ctx - (R - 1) + idx
    valid = (idx >= 0) & (idx < R) & (position >= 0)
    column = tl.where(position >= 0, position, 0) % R
    token = tl.load(ring_ptr + row + column, mask=valid & (idx < R - 1), other=-1)
    return tl.where(idx == R - 1, anchor, token), valid


@triton.jit
def _agreement_kernel(ring_ptr, slot_ptr, ctx_ptr, block_ptr, out_ptr, ring_stride, block_stride, out_stride,
                      P: tl.constexpr, PB: tl.constexpr, R: tl.constexpr, RB: tl.constexpr, NGRAM: tl.constexpr,
                      LOOKUP: tl.constexpr):
    n = tl.program_id(0)
    row = tl.load(slot_ptr + n) * ring_stride
    ctx = tl.load(ctx_ptr + n)
    anchor = tl.load(block_ptr + n * block_stride)
    back = NGRAM - 2  # the context tokens before the anchor that a span ending at draft 1 reaches
    p = tl.arange(0, RB)  # window entries; p >= R are never valid
    j = tl.arange(0, PB)
    live = j < P
    drafts = tl.load(block_ptr + n * block_stride + 1 + j, mask=live, other=-2)
    # spans ending at draft j: q index m = back + 1 + j - i (m <= back: the window's entry R - 1 - back + m)
    run = tl.zeros([PB, RB], dtype=tl.int32) + 1
    length = tl.zeros([PB], dtype=tl.int32)
    # prompt lookup, on the same shifted windows: the latest end e < R - 1 of the longest suffix (1..LOOKUP tokens
    # ending at the anchor) that recurs
    suffix = tl.zeros([RB], dtype=tl.int32) + 1
    latest = ctx * 0 - 1
    for i in tl.static_range(NGRAM):
        w, w_ok = _window(ring_ptr, row, ctx, anchor, p - i, R)
        m = back + 1 + j - i
        in_window = m <= back
        q, q_ok = _window(ring_ptr, row, ctx, anchor, tl.where(in_window, R - 1 - back + m, 0), R)
        q = tl.where(in_window, q, tl.load(block_ptr + n * block_stride + tl.where(in_window, 0, m - back),
                                           mask=live & ~in_window, other=-2))
        q_ok = tl.where(in_window, q_ok, live)
        e = (w[None, :] == q[:, None]) & w_ok[None, :] & q_ok[:, None]
        run = run * e.to(tl.int32)
        length += tl.max(run, axis=1)
        if i < LOOKUP:
            s, s_ok = _window(ring_ptr, row, ctx, anchor, tl.zeros([RB], dtype=tl.int32) + (R - 1 - i), R)
            suffix = suffix * ((w == s) & w_ok & s_ok).to(tl.int32)
            found = tl.max(tl.where((suffix > 0) & (p < R - 1), p, -1), axis=0)
            latest = tl.where(found >= 0, found, latest)
    after = latest + 1 + j
    follows, _ = _window(ring_ptr, row, ctx, anchor, tl.minimum(after, R - 1), R)
    equal = (latest >= 0) & (after <= R - 1) & (follows == drafts) & live
    leading = tl.min(tl.where(equal | ~live, PB, j), axis=0)  # the first draft that differs (P: none)
    leading = tl.minimum(leading, P)
    out = out_ptr + n * out_stride
    tl.store(out + j, length.to(tl.float32), mask=live)
    tl.store(out + P, leading.to(tl.float32))
    tl.store(out + P + 1 + j, equal.to(tl.float32), mask=live)


def agreement_columns_triton(ring: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor, block: torch.Tensor,
                             ngram: int, lookup: int) -> torch.Tensor:
    """ring [S + 1, R] int64 (the token at position t in column t % R), slots [N] int64 (each request's ring row),
    ctx [N] int64 (the anchor's position), block [N, W] int64 (the anchor, then the P = W - 1 drafts) ->
    [N, 2P + 1] float32: `dvl.features.agreement_features` of the request's window (positions ctx - R + 1 .. ctx,
    the anchor last) and block."""
    n, w = block.shape
    r = ring.shape[1]
    assert ring.dtype == slots.dtype == ctx.dtype == block.dtype == torch.int64, "token ids and indices are int64"
    assert ring.stride(1) == 1 and block.stride(1) == 1, (ring.stride(), block.stride())
    assert 1 <= lookup <= ngram - 1 and r > ngram - 2, (ngram, lookup, r)
    require_interpreter_on_cpu(ring, "the Triton agreement columns", "decision")
    p = w - 1
    out = torch.empty(n, 2 * p + 1, dtype=torch.float32, device=block.device)
    if n == 0:
        return out
    _agreement_kernel[(n,)](ring, slots, ctx, block, out, ring.stride(0), block.stride(0), out.stride(0), P=p,
                            PB=triton.next_power_of_2(max(p, 1)), R=r, RB=triton.next_power_of_2(r), NGRAM=ngram,
                            LOOKUP=lookup, num_warps=4)
    return out


def compile_offline(window: int = 128, width: int = 16, ngram: int = 8, lookup: int = 4, arch: int = 90):
    """The kernel compiled for an NVIDIA target without a GPU (`kernels.compile_for_gpu`): a CI check of the compiled
    path, which the interpreter does not make. Needs triton imported without TRITON_INTERPRET."""
    from dscale_runtime.kernels import compile_for_gpu

    assert not interpreted(), "compile_offline needs triton imported without TRITON_INTERPRET"
    consts = {"P": width - 1, "PB": triton.next_power_of_2(width - 1), "R": window,
              "RB": triton.next_power_of_2(window), "NGRAM": ngram, "LOOKUP": lookup}
    return compile_for_gpu(_agreement_kernel, consts, {"*": "*i64", "out_ptr": "*fp32"}, 4, arch)
