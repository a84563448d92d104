"""Triton kernels of DFlash 2's drafter (`models/dflash2.py`): the grouped dynamic causal convolution over packed
blocks, and the slice maxima of the candidates' top-k.

Convolution: one launch per convolution (the reference, `dflash2.block_convolve_ref`, takes about six torch
launches: flips, the zero padding, the tap weights, their product and the sum): a program per (block row, channel
tile) reads the row's `taps` predecessors inside its own block (slot = row % W; taps before slot 0 read zeros, so
no tap reaches another request's block), the base taps and the row's dynamic taps, and writes the row. (A program
per block walking its W slots, each row read once, took 4-10x longer at Qwen3-8B width on the H200: 32-128
programs are too few; docs/benchmarks.md, 2026-12-04.) It rounds
where the reference's torch sequence rounds: each tap weight base + dynamic and each product to the tensor
dtype, the fp32 sum over the taps once at the end (added in the reference's order, oldest slot first; torch
may reduce those few terms in another order, so the last bit of a 16-bit output may differ; fp32 agrees to
rounding).

Slice maxima: a program per (row, 16 slices) loads the slices as one tile and writes their maxima (exact: a
maximum does not round), about 6x faster than torch's `amax` over [R, 1,187, 128] at Qwen3's vocabulary.

Grids depend on shapes only: safe to capture in a CUDA graph.

This module imports triton at import time: import it only through `models/dflash2.py`'s router, which does so
lazily. With TRITON_INTERPRET=1 set before triton is imported, the kernels run in the interpreter (CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.kernels.triton_fused import _DTYPES, _LAUNCH, _round, interpreted, require_interpreter_on_cpu

BLOCK_COLUMNS = 1024  # channels per program of the per-row kernel
TILE_COLUMNS = 128  # channels per program of the tile kernel (its tile: the block's W slots x these channels)
# The convolution kernel `block_convolve_triton` runs: 'row' (a program per row and 1,024 channels; its base taps
# are read once per row, ~16 MB from L2 per convolution at Qwen3-8B shape, N = 32) or 'tile' (a program per
# block and 128 channels: base taps once per block, the block's rows once from memory). NOTE: 'tile' is not yet
# timed on the GPU; `benchmarks/dflash2_step.py --conv-kernel tile` times it beside 'row'.
CONV_KERNEL = "row"
# DFlash 2's candidates over vocabulary slices after the slice maxima (`dflash2.candidate_topk`, Triton path): 'torch'
# (two torch.topk calls, 0.095 ms of radix select at Qwen3-8B shape, N = 32, on the H200, and the slices' gather) or
# 'triton' (`slices_topk_triton`, one launch). NOTE: 'triton' is not yet timed on the GPU; `benchmarks/dflash2_step.py
# --topk-kernel triton` times it beside 'torch'.
TOPK_KERNEL = "torch"


@triton.jit
def _block_conv_kernel(x_ptr, dyn_ptr, base_ptr, out_ptr, d, width, dyn_row, dyn_tap,
                       TAPS: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < d
    slots = tl.zeros([BLOCK], dtype=tl.int32) + row % width  # NOTE: a vector: the interpreter masks by blocks
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TAPS):
        o = TAPS - 1 - k  # NOTE: the oldest tap first, the reference's window order
        x = tl.load(x_ptr + (row - o) * d + cols, mask=inside & (slots >= o), other=0.0).to(tl.float32)
        base = tl.load(base_ptr + o * d + cols, mask=inside, other=0.0).to(tl.float32)
        dyn = tl.load(dyn_ptr + row * dyn_row + o * dyn_tap + cols // GROUP, mask=inside, other=0.0).to(tl.float32)
        acc += _round(_round(base + dyn, DTYPE) * x, DTYPE)
    tl.store(out_ptr + row * d + cols, _round(acc, DTYPE).to(DTYPE), mask=inside)


@triton.jit
def _block_conv_tile_kernel(x_ptr, dyn_ptr, base_ptr, out_ptr, d, width, dyn_row, dyn_tap,
                            TAPS: tl.constexpr, GROUP: tl.constexpr, SLOTS: tl.constexpr, COLS: tl.constexpr,
                            DTYPE: tl.constexpr):
    """A program per (block, channel tile of COLS): the block's SLOTS x COLS tile at once, each tap a shifted
    load of it (the block's rows, from cache after the first), the tile's base taps loaded once."""
    block = tl.program_id(0)
    start = tl.program_id(1) * COLS
    cols = start + tl.arange(0, COLS)
    slots = tl.arange(0, SLOTS)
    inside = cols < d
    live = slots < width
    rows = block * width + slots
    acc = tl.zeros([SLOTS, COLS], dtype=tl.float32)
    for k in tl.static_range(TAPS):
        o = TAPS - 1 - k  # NOTE: the oldest tap first, the reference's window order
        ok = (live & (slots >= o))[:, None] & inside[None, :]
        x = tl.load(x_ptr + (rows - o)[:, None] * d + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        base = tl.load(base_ptr + o * d + cols, mask=inside, other=0.0).to(tl.float32)
        if GROUP % COLS == 0:  # NOTE: the tile lies in one group: one dynamic tap per row
            dyn = tl.load(dyn_ptr + rows * dyn_row + o * dyn_tap + start // GROUP, mask=live,
                          other=0.0).to(tl.float32)[:, None]
        else:
            dyn = tl.load(dyn_ptr + rows[:, None] * dyn_row + o * dyn_tap + (cols // GROUP)[None, :],
                          mask=live[:, None] & inside[None, :], other=0.0).to(tl.float32)
        acc += _round(_round(base[None, :] + dyn, DTYPE) * x, DTYPE)
    tl.store(out_ptr + rows[:, None] * d + cols[None, :], _round(acc, DTYPE).to(DTYPE),
             mask=live[:, None] & inside[None, :])


@triton.jit
def _slice_max_kernel(x_ptr, out_ptr, row_stride, chunks, width, SLICES: tl.constexpr, WIDTH: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # NOTE: rows x vocabulary may pass 2^31 elements
    at = tl.program_id(1) * SLICES + tl.arange(0, SLICES)
    cols = tl.arange(0, WIDTH)
    ok = at < chunks
    v = tl.load(x_ptr + row * row_stride + at[:, None] * width + cols[None, :],
                mask=ok[:, None] & (cols[None, :] < width), other=float("-inf"))
    tl.store(out_ptr + row * chunks + at, tl.max(v, axis=1), mask=ok)


@triton.jit
def _pick(x, alive, offs, BIG: tl.constexpr):
    """The position of the largest alive entry of x (the first among equals; the first alive one where the row's
    alive entries are all NaN) -> (its value, its position)."""
    m = tl.max(tl.where(alive, x, float("-inf")), 0)
    at = tl.min(tl.where(alive & (x >= m), offs, BIG), 0)
    at = tl.where(at == BIG, tl.min(tl.where(alive, offs, BIG), 0), at)
    return tl.max(tl.where(offs == at, x, float("-inf")), 0), at


@triton.jit
def _slices_topk_kernel(maxima_ptr, x_ptr, values_ptr, ids_ptr, row_stride, chunks, width, K: tl.constexpr,
                        CHUNKS: tl.constexpr, WIDTH: tl.constexpr):
    """One row: the K slices of largest maxima (the first among equals), then the K largest of their K x width
    entries, largest first, with their token ids; a chosen entry is never chosen again."""
    row = tl.program_id(0).to(tl.int64)  # NOTE: rows x vocabulary may pass 2^31 elements
    c = tl.arange(0, CHUNKS)
    maxima = tl.load(maxima_ptr + row * chunks + c, mask=c < chunks, other=float("-inf")).to(tl.float32)
    alive = c < chunks
    k = tl.arange(0, K)
    best = tl.zeros([K], dtype=tl.int64)
    for i in tl.static_range(K):
        _, at = _pick(maxima, alive, c, CHUNKS)
        alive = alive & (c != at)
        best = tl.where(k == i, at.to(tl.int64), best)
    cols = tl.arange(0, WIDTH)
    ok = (cols < width)[None, :] & (k < K)[:, None]
    token = best[:, None] * width + cols[None, :]  # [K, WIDTH]
    raw = tl.load(x_ptr + row * row_stride + token, mask=ok, other=float("-inf"))
    flat = tl.reshape(raw.to(tl.float32), [K * WIDTH])
    ids = tl.reshape(token, [K * WIDTH])
    offs = tl.arange(0, K * WIDTH)
    alive = tl.reshape(ok, [K * WIDTH])
    for i in tl.static_range(K):
        value, at = _pick(flat, alive, offs, K * WIDTH)
        alive = alive & (offs != at)
        tl.store(values_ptr + row * K + i, value.to(values_ptr.dtype.element_ty))
        tl.store(ids_ptr + row * K + i, tl.max(tl.where(offs == at, ids, -1), 0))


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def block_convolve_triton(
    x: torch.Tensor,  # [N * W, d] block rows, contiguous
    dynamic: torch.Tensor,  # [N, W, taps, G] dynamic taps (unit group stride; rows evenly strided)
    base: torch.Tensor,  # [taps, d] base taps, contiguous
    group_size: int,
    kernel: str | None = None,  # 'row' or 'tile' (default: CONV_KERNEL)
) -> torch.Tensor:  # [N * W, d]
    """`block_convolve_ref` on packed rows in one launch (see the module docstring for its rounding), by the
    per-row kernel or the per-(block, channel tile) one; both give the same bits."""
    n, width, taps, groups = dynamic.shape
    rows, d = x.shape
    assert x.dtype in _DTYPES and dynamic.dtype == base.dtype == x.dtype, (x.dtype, dynamic.dtype, base.dtype)
    assert rows == n * width and d == groups * group_size and base.shape == (taps, d), (x.shape, dynamic.shape)
    assert x.is_contiguous() and base.is_contiguous() and dynamic.stride(-1) == 1
    assert dynamic.stride(0) == width * dynamic.stride(1), "dynamic taps: rows must be evenly strided"
    require_interpreter_on_cpu(x, "the Triton convolution", "fused")
    out = torch.empty_like(x)
    if rows == 0:
        return out
    kernel = kernel or CONV_KERNEL
    if kernel == "tile":
        cols = min(TILE_COLUMNS, triton.next_power_of_2(d))
        slots = triton.next_power_of_2(width)
        _block_conv_tile_kernel[(n, triton.cdiv(d, cols))](
            x, dynamic, base, out, d, width, dynamic.stride(1), dynamic.stride(2), TAPS=taps, GROUP=group_size,
            SLOTS=slots, COLS=cols, DTYPE=_TL[x.dtype], num_warps=max(1, min(8, slots * cols // 512)), **_LAUNCH)
        return out
    if kernel != "row":
        raise ValueError(f"convolution kernel must be 'row' or 'tile', got {kernel!r}")
    block = min(BLOCK_COLUMNS, triton.next_power_of_2(d))
    grid = (rows, triton.cdiv(d, block))
    _block_conv_kernel[grid](x, dynamic, base, out, d, width, dynamic.stride(1), dynamic.stride(2), TAPS=taps,
                             GROUP=group_size, BLOCK=block, DTYPE=_TL[x.dtype], num_warps=4, **_LAUNCH)
    return out


SLICES_PER_PROGRAM = 16


def slice_max_triton(logits: torch.Tensor, chunks: int) -> torch.Tensor:
    """logits [R, V] (unit column stride) -> the maximum of each of `chunks` equal slices of every row [R, chunks]
    (`logits.view(R, chunks, V // chunks).amax(-1)`, exactly: a maximum does not round), in one launch of
    programs per (row, 16 slices); NaN logits are not propagated as torch.amax does."""
    r, vocab = logits.shape
    assert vocab % chunks == 0 and logits.stride(1) == 1, (logits.shape, logits.stride(), chunks)
    require_interpreter_on_cpu(logits, "the Triton slice maxima", "fused")
    out = torch.empty(r, chunks, dtype=logits.dtype, device=logits.device)
    if r == 0:
        return out
    width = vocab // chunks
    grid = (r, triton.cdiv(chunks, SLICES_PER_PROGRAM))
    _slice_max_kernel[grid](logits, out, logits.stride(0), chunks, width, SLICES=SLICES_PER_PROGRAM,
                            WIDTH=triton.next_power_of_2(width), num_warps=4)
    return out


def slices_topk_triton(logits: torch.Tensor, maxima: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row [R, V] and their token ids, largest first, given each of its equal slices'
    maximum [R, chunks] (`slice_max_triton`): the k slices of largest maxima, then the k largest of those slices'
    entries, in one launch of a program per row (`dflash2.candidate_topk`'s two `torch.topk` calls, the gather of
    the slices and the ids' arithmetic). The values are torch.topk's; among equal values the first slice picked,
    then the lowest column, wins (torch.topk keeps any of them)."""
    r, vocab = logits.shape
    chunks = maxima.shape[1]
    assert vocab % chunks == 0 and k <= chunks and logits.stride(1) == 1 and maxima.is_contiguous()
    assert k & (k - 1) == 0, "k must be a power of two (a tile of k slices)"
    require_interpreter_on_cpu(logits, "the Triton slice top-k", "fused")
    values = torch.empty(r, k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(r, k, dtype=torch.long, device=logits.device)
    if r == 0:
        return values, ids
    width = vocab // chunks
    _slices_topk_kernel[(r,)](maxima, logits, values, ids, logits.stride(0), chunks, width, K=k,
                              CHUNKS=triton.next_power_of_2(chunks), WIDTH=triton.next_power_of_2(width), num_warps=4)
    return values, ids


def compile_offline(dtype: torch.dtype, d: int = 4096, taps: int = 4, group: int = 128, slice_width: int = 128,
                    arch: int = 90) -> list:
    """The kernels (both convolutions, the slice maxima and top-k) compiled for an NVIDIA target without a GPU
    (`kernels.compile_for_gpu`), with the wrappers' launch options: a CI check of the compiled path, which Triton's
    interpreter does not make (it runs code the compiler refuses). Needs triton imported without TRITON_INTERPRET."""
    from dscale_runtime.kernels import compile_for_gpu

    assert not interpreted(), "compile_offline needs triton imported without TRITON_INTERPRET"
    elem = {"*": {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]}
    conv = {"TAPS": taps, "GROUP": group, "BLOCK": min(BLOCK_COLUMNS, triton.next_power_of_2(d)), "DTYPE": _TL[dtype]}
    tile = {"TAPS": taps, "GROUP": group, "SLOTS": 16, "COLS": min(TILE_COLUMNS, triton.next_power_of_2(d)),
            "DTYPE": _TL[dtype]}
    maxima = {"SLICES": SLICES_PER_PROGRAM, "WIDTH": triton.next_power_of_2(slice_width)}
    topk = {"K": 16, "CHUNKS": 2048, "WIDTH": triton.next_power_of_2(slice_width)}  # Qwen3's 1,187 slices
    return [compile_for_gpu(_block_conv_kernel, conv, elem, 4, arch, **_LAUNCH),
            compile_for_gpu(_block_conv_tile_kernel, tile, elem, max(1, min(8, 16 * tile["COLS"] // 512)), arch,
                            **_LAUNCH),
            compile_for_gpu(_slice_max_kernel, maxima, elem, 4, arch),
            compile_for_gpu(_slices_topk_kernel, topk, {**elem, "ids_ptr": "*i64"}, 4, arch)]
