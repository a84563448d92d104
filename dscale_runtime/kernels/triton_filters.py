"""Triton radix select of the top-k / top-p floors: `kernels.filters.filter_floor_radix`, kept set for kept set.

`filter_floor_triton(logits [R, V], shift, inv_t, top_k, top_p)` -> floor [R] fp32 with a static grid and no host
reads (graph-safe). A vocabulary of at most `ROW_PROGRAM_VOCAB` tokens (the demo pair's 4,096) takes one launch:
one program per row holds the row in registers and finds each floor bit by bit from the top (31 masked sums per
search over the keys of s, 16 over the logits' own bits when they are bf16 / fp16; the same floor the rounds find,
from the same integer masses). Larger ones (Qwen3's 151,936) take
eight:
one memset of an int64 scratch [R, 8192 + 16] (the six rounds' histograms, 2048 / 1024 / 1024 bins per search,
and a little state), three rounds of the top-k search (counts), three of the top-p search (masses of what top-k
kept), and a one-program-per-row finish. A round's
grid is (R, parts): each program adds its slice of the row into the row's histogram with integer atomics
(order-independent, so the sums equal the reference's exactly); it first advances the search over the previous
round's histogram (the digit where the row's running count or mass reaches its target, as
`filters._radix_search` does), and its part 0 stores that state for the next round. Rows whose filter is off
skip the slices (their programs only run the prologue).

Weights: on CUDA the mass units take libdevice's expf, which is the CUDA math library's (torch's `exp`), so the
kernel and the torch paths see the same w; Triton's interpreter (CPU tests) takes numpy's exp, whose last bit
may differ from torch's CPU exp (a kept set can then differ only where a mass lies within that rounding of p Z).

This module imports triton at import time: import it only through `dscale_runtime.kernels.filters`, which
does so lazily. With TRITON_INTERPRET=1 set before triton is imported, it runs on CPU tensors too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dscale_runtime.kernels.filters import DIGITS, KEY_ALL, KEY_BITS, MASS_BITS, ROW_PROGRAM_VOCAB
from dscale_runtime.kernels.triton_fused import interpreted, require_interpreter_on_cpu

BLOCK = 1024  # tokens per tile
TARGET_PROGRAMS = 1024  # a round splits each row into parts so that about this many programs run
_STAGE_BINS = DIGITS + DIGITS  # stages 0-2: top-k rounds; 3-5: top-p rounds
_STAGE_OFFSETS = tuple(sum(1 << b for b in _STAGE_BINS[:i]) for i in range(6))
_STATE = sum(1 << b for b in _STAGE_BINS)  # state words after the histograms: (prefix, below) per stage, key_k
_ROW_WORDS = _STATE + 16
_KEY_K = 12  # state word of the top-k threshold key
_DTYPES16 = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}  # logits `_row_kernel` keys by their own bits


@triton.jit
def _advance(hist, prefix, below, target_count, target_mass, NB: tl.constexpr, MASS: tl.constexpr):
    """One radix step: the first of NB bins whose running total (from `below`) reaches the target (the last bin
    when none does) -> (prefix extended by that digit, total before it)."""
    bins = tl.arange(0, NB)
    h = tl.load(hist + bins)
    cum = below + tl.cumsum(h, 0)
    if MASS:
        hit = cum.to(tl.float64) >= target_mass
    else:
        hit = cum >= target_count
    digit = tl.min(tl.where(hit, bins, NB - 1), 0)
    return prefix * NB + digit, below + tl.sum(tl.where(bins < digit, h, 0), 0)


@triton.jit
def _mass_target(z_hist, top_p, Z_BINS: tl.constexpr):
    """p * Z in float64, Z = the kept mass (the first top-p round's histogram `z_hist` summed)."""
    z = tl.sum(tl.load(z_hist + tl.arange(0, Z_BINS)), 0)
    return top_p.to(tl.float64) * z.to(tl.float64)


@triton.jit
def _round_kernel(logits, shift, inv_t, top_k, top_p, scratch, vocab, stride_row, span,
                  STAGE: tl.constexpr, MASS: tl.constexpr, FIRST: tl.constexpr, OFFSET: tl.constexpr,
                  PREV_OFFSET: tl.constexpr, BITS: tl.constexpr, PREV_BITS: tl.constexpr, HIGH: tl.constexpr, STATE: tl.constexpr, ROW_WORDS: tl.constexpr,
                  Z_BINS: tl.constexpr, Z_OFFSET: tl.constexpr, KEY_K: tl.constexpr, KEY_ALL: tl.constexpr,
                  SCALE: tl.constexpr,
                  BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    words = scratch + row.to(tl.int64) * ROW_WORDS
    k = tl.load(top_k + row).to(tl.int64)
    p = tl.load(top_p + row)
    if MASS:
        active = p < 1.0
    else:
        active = (k > 0) & (k < vocab)
    prefix = tl.zeros((), tl.int64)
    below = tl.zeros((), tl.int64)
    key_k = tl.full((), KEY_ALL, tl.int64)
    if STAGE == 3:  # finish the top-k search: its threshold key masks every top-p round
        k_on = (k > 0) & (k < vocab)
        kp, _ = _advance(words + PREV_OFFSET, tl.load(words + STATE + 4), tl.load(words + STATE + 5), k, 0.0,
                         1 << PREV_BITS, False)
        key_k = tl.where(k_on, kp, key_k)
        if part == 0:
            tl.store(words + STATE + KEY_K, key_k)
    if MASS and not FIRST:
        key_k = tl.load(words + STATE + KEY_K)
    if not FIRST:
        if MASS:
            target = _mass_target(words + Z_OFFSET, p, Z_BINS)
        else:
            target = 0.0
        prefix, below = _advance(words + PREV_OFFSET, tl.load(words + STATE + 2 * (STAGE - 1)),
                                 tl.load(words + STATE + 2 * (STAGE - 1) + 1), k, target, 1 << PREV_BITS, MASS)
        if part == 0:
            tl.store(words + STATE + 2 * STAGE, prefix)
            tl.store(words + STATE + 2 * STAGE + 1, below)
    if active:
        m = tl.load(shift + row)
        it = tl.load(inv_t + row)
        lo = part * span
        hi = tl.minimum(lo + span, vocab)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < hi
            x = tl.load(logits + row.to(tl.int64) * stride_row + offs, mask=inside, other=0.0).to(tl.float32)
            s = (x - m) * it
            key = (s.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.int64)
            match = inside & ((key >> HIGH) == prefix)
            digit = (key >> (HIGH - BITS)) & ((1 << BITS) - 1)
            if MASS:
                if ACCURATE:
                    w = libdevice.exp(s)
                else:
                    w = tl.exp(s)
                q = (w * SCALE).to(tl.int64)
                tl.atomic_add(words + OFFSET + digit, q, mask=match & (key <= key_k) & (q > 0), sem="relaxed")
            else:
                tl.atomic_add(words + OFFSET + digit, tl.full([BLOCK], 1, tl.int64), mask=match, sem="relaxed")


@triton.jit
def _finish_kernel(top_k, top_p, scratch, floor, OFFSET: tl.constexpr, BITS: tl.constexpr, STATE: tl.constexpr,
                   ROW_WORDS: tl.constexpr, Z_BINS: tl.constexpr, Z_OFFSET: tl.constexpr, KEY_K: tl.constexpr,
                   KEY_ALL: tl.constexpr):
    row = tl.program_id(0)
    words = scratch + row.to(tl.int64) * ROW_WORDS
    p = tl.load(top_p + row)
    key = tl.load(words + STATE + KEY_K)
    if p < 1.0:
        key_p, _ = _advance(words + OFFSET, tl.load(words + STATE + 10), tl.load(words + STATE + 11), 0,
                            _mass_target(words + Z_OFFSET, p, Z_BINS), 1 << BITS, True)
        key = tl.minimum(key, key_p)
    key = tl.minimum(key, KEY_ALL).to(tl.int32)
    tl.store(floor + row, -(key.to(tl.float32, bitcast=True)))


@triton.jit
def _bisect(key, weight, target_count, target_mass, MASS: tl.constexpr, KEY_BITS: tl.constexpr):
    """Smallest v < 2^KEY_BITS with F(v) = sum of `weight` over key <= v reaching the target (all ones when none
    does), bit by bit from the top: the radix rounds' answer, one bit per step over a row held in registers."""
    v = tl.zeros((), tl.int64)
    for i in range(KEY_BITS):
        bit = tl.full((), 1, tl.int64) << (KEY_BITS - 1 - i)
        f = tl.sum(tl.where(key <= (v | (bit - 1)), weight, 0), 0)
        if MASS:
            hit = f.to(tl.float64) >= target_mass
        else:
            hit = f >= target_count
        v = tl.where(hit, v, v | bit)
    return v


@triton.jit
def _logit_key16(bits):
    """16-bit float bit patterns (int32, 0..0xFFFF) -> order keys, smaller = larger value (-0 keyed as +0)."""
    magnitude = bits & 0x7FFF
    negative = ((bits & 0x8000) != 0) & (magnitude != 0)
    return tl.where(negative, 0x8000 + magnitude, 0x7FFF - magnitude)


@triton.jit
def _key16_floor(v, shift, inv_t, DTYPE: tl.constexpr):
    """The s floor of the 16-bit order key v (`_logit_key16`'s inverse, then the policy's own scaling)."""
    bits = tl.where(v >= 0x8000, 0x8000 | (v - 0x8000), 0x7FFF - v).to(tl.int16)
    x = bits.to(DTYPE, bitcast=True).to(tl.float32)
    return tl.where(v > 0xFF80, float("-inf"), (x - shift) * inv_t)  # NOTE: past -inf's key: NaN patterns


@triton.jit
def _row_floor(raw, inside, m, it, k, p, vocab, KEY_ALL: tl.constexpr, KEY_BITS: tl.constexpr, SCALE: tl.constexpr,
               ACCURATE: tl.constexpr, KEY16: tl.constexpr, DTYPE: tl.constexpr):
    """Both floors of one row held in registers: raw [VBLOCK] logits (their own dtype; `inside` masks the
    vocabulary), shift m, inverse temperature it, top_k k, top_p p -> the row's floor (fp32, -inf: no filter).
    With KEY16 (bf16 / fp16 logits) the searches run over the logits' own 16-bit order (16 steps, not 31): s is
    non-decreasing in the logit, so the smallest key reaching a target is a logit whose s is the floor the
    31-bit search over s finds (logits that the scaling maps to one s count together either way)."""
    k_on = (k > 0) & (k < vocab)
    p_on = p < 1.0
    floor_out = tl.full((), float("-inf"), tl.float32)
    if k_on | p_on:
        s = (raw.to(tl.float32) - m) * it
        if KEY16:
            key = tl.where(inside, _logit_key16(raw.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF).to(tl.int64),
                           1 << 20)  # pad: never kept
        else:
            key = tl.where(inside, (s.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.int64), 1 << 40)
        floor_k = tl.full((), float("-inf"), tl.float32)
        if k_on:
            v = _bisect(key, inside.to(tl.int64), k, 0.0, False, KEY_BITS)
            if KEY16:
                floor_k = _key16_floor(v, m, it, DTYPE)
            else:
                floor_k = -(tl.minimum(v, KEY_ALL).to(tl.int32).to(tl.float32, bitcast=True))
        floor_out = floor_k
        if p_on:
            if ACCURATE:
                w = libdevice.exp(s)
            else:
                w = tl.exp(s)
            q = tl.where(inside & (s >= floor_k), (w * SCALE).to(tl.int64), 0)
            target = p.to(tl.float64) * tl.sum(q, 0).to(tl.float64)
            v = _bisect(key, q, 0, target, True, KEY_BITS)
            if KEY16:
                floor_p = _key16_floor(v, m, it, DTYPE)
            else:
                floor_p = -(tl.minimum(v, KEY_ALL).to(tl.int32).to(tl.float32, bitcast=True))
            floor_out = tl.maximum(floor_p, floor_k)
    return floor_out


@triton.jit
def _row_kernel(logits, shift, inv_t, top_k, top_p, floor, vocab, stride_row, KEY_ALL: tl.constexpr,
                KEY_BITS: tl.constexpr, SCALE: tl.constexpr, VBLOCK: tl.constexpr, ACCURATE: tl.constexpr,
                KEY16: tl.constexpr, DTYPE: tl.constexpr):
    """Both floors of one row whose tokens fit one tile (`ROW_PROGRAM_VOCAB`): one program per row, no scratch
    (`_row_floor`)."""
    row = tl.program_id(0)
    offs = tl.arange(0, VBLOCK)
    inside = offs < vocab
    raw = tl.load(logits + row.to(tl.int64) * stride_row + offs, mask=inside, other=0.0)
    tl.store(floor + row, _row_floor(raw, inside, tl.load(shift + row), tl.load(inv_t + row),
                                     tl.load(top_k + row).to(tl.int64), tl.load(top_p + row), vocab, KEY_ALL, KEY_BITS,
                                     SCALE, ACCURATE, KEY16, DTYPE))



def parts_per_row(rows: int, vocab: int) -> int:
    """Programs per row of a round: about TARGET_PROGRAMS in all, each at least one BLOCK of the row."""
    return max(1, min(triton.cdiv(vocab, BLOCK), triton.cdiv(TARGET_PROGRAMS, max(rows, 1))))


def filter_floor_triton(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [R, V] with contiguous rows"
    assert sum(DIGITS) == KEY_BITS
    require_interpreter_on_cpu(logits, "Triton top-k / top-p", "fused")
    rows, vocab = logits.shape
    # NOTE: allocated by torch on the logits' device: inside a CUDA graph capture, from the graph's pool.
    floor = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return floor
    if vocab <= ROW_PROGRAM_VOCAB:  # NOTE: one launch in all (no scratch, no rounds): small vocabularies
        block = triton.next_power_of_2(vocab)
        key16 = logits.dtype in _DTYPES16
        _row_kernel[(rows,)](logits, shift.float().contiguous(), inv_t.float().contiguous(),
                             top_k.long().contiguous(), top_p.float().contiguous(), floor, vocab, logits.stride(0),
                             KEY_ALL=KEY_ALL, KEY_BITS=16 if key16 else KEY_BITS, SCALE=float(2**MASS_BITS),
                             VBLOCK=block, ACCURATE=not interpreted(), KEY16=key16,
                             DTYPE=_DTYPES16.get(logits.dtype, tl.float16), num_warps=4 if block <= 4096 else 8)
        return floor
    scratch = torch.zeros(rows, _ROW_WORDS, dtype=torch.int64, device=logits.device)
    parts = parts_per_row(rows, vocab)
    span = triton.cdiv(triton.cdiv(vocab, parts), BLOCK) * BLOCK
    parts = triton.cdiv(vocab, span)
    args = (logits, shift.float().contiguous(), inv_t.float().contiguous(), top_k.long().contiguous(),
            top_p.float().contiguous(), scratch, vocab, logits.stride(0), span)
    constants = dict(STATE=_STATE, ROW_WORDS=_ROW_WORDS, Z_BINS=1 << DIGITS[0], Z_OFFSET=_STAGE_OFFSETS[3],
                     KEY_K=_KEY_K, KEY_ALL=KEY_ALL)
    high = KEY_BITS
    for stage, bits in enumerate(_STAGE_BINS):
        if stage == 3:
            high = KEY_BITS
        prev = max(stage - 1, 0)
        _round_kernel[(rows, parts)](*args, STAGE=stage, MASS=stage >= 3, FIRST=stage in (0, 3),
                                     OFFSET=_STAGE_OFFSETS[stage], PREV_OFFSET=_STAGE_OFFSETS[prev], BITS=bits,
                                     PREV_BITS=_STAGE_BINS[prev], HIGH=high, SCALE=float(2**MASS_BITS), BLOCK=BLOCK,
                                     ACCURATE=not interpreted(), num_warps=4, **constants)
        high -= bits
    _finish_kernel[(rows,)](args[3], args[4], scratch, floor, OFFSET=_STAGE_OFFSETS[5], BITS=_STAGE_BINS[5],
                            num_warps=4, **constants)
    return floor
