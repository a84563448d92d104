"""Triton kernel of DFlash 2's grouped dynamic causal convolution over packed blocks (`models/dflash2.py`).

One launch per convolution (the reference, `dflash2.block_convolve_ref`, takes about six torch launches: flips,
the zero padding, the tap weights, their product and the sum): a program per (block row, channel tile) reads
the row's `taps` predecessors inside its own block (slot = row % W; taps before slot 0 read zeros, so no tap
reaches another request's block), the base taps and the row's dynamic taps, and writes the row. It rounds
where the reference's torch sequence rounds: each tap weight base + dynamic and each product to the tensor
dtype, the fp32 sum over the taps once at the end (added in the reference's order, oldest slot first; torch
may reduce those few terms in another order, so the last bit of a 16-bit output may differ; fp32 agrees to
rounding). Grids depend on shapes only: safe to capture in a CUDA graph.

This module imports triton at import time: import it only through `models/dflash2.py`'s router, which does so
lazily. With TRITON_INTERPRET=1 set before triton is imported, the kernel runs in the interpreter (CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.kernels.triton_fused import _DTYPES, _LAUNCH, _round, interpreted

BLOCK_COLUMNS = 1024  # channels per program


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


_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def block_convolve_triton(
    x: torch.Tensor,  # [N * W, d] block rows, contiguous
    dynamic: torch.Tensor,  # [N, W, taps, G] dynamic taps (unit group stride; rows evenly strided)
    base: torch.Tensor,  # [taps, d] base taps, contiguous
    group_size: int,
) -> torch.Tensor:  # [N * W, d]
    """`block_convolve_ref` on packed rows in one launch (see the module docstring for its rounding)."""
    n, width, taps, groups = dynamic.shape
    rows, d = x.shape
    assert x.dtype in _DTYPES and dynamic.dtype == base.dtype == x.dtype, (x.dtype, dynamic.dtype, base.dtype)
    assert rows == n * width and d == groups * group_size and base.shape == (taps, d), (x.shape, dynamic.shape)
    assert x.is_contiguous() and base.is_contiguous() and dynamic.stride(-1) == 1
    assert dynamic.stride(0) == width * dynamic.stride(1), "dynamic taps: rows must be evenly strided"
    if not x.is_cuda and not interpreted():
        raise RuntimeError("the Triton convolution on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported, or use DSCALE_FUSED=ref (KernelChoice.fused='ref')")
    out = torch.empty_like(x)
    if rows == 0:
        return out
    block = min(BLOCK_COLUMNS, triton.next_power_of_2(d))
    grid = (rows, triton.cdiv(d, block))
    _block_conv_kernel[grid](x, dynamic, base, out, d, width, dynamic.stride(1), dynamic.stride(2), TAPS=taps,
                             GROUP=group_size, BLOCK=block, DTYPE=_TL[x.dtype], num_warps=4, **_LAUNCH)
    return out
