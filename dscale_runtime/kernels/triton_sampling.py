"""Triton chunk sums of a tempered softmax's weights, read straight from the logits (one pass, any float dtype).

`chunk_exp_sums_triton(logits [R, V], shift [R], inv_t [R], chunk)` -> [R, C] fp32, C = ceil(V / chunk):
sum over each chunk of exp((l - shift) * inv_t), one program per (row, chunk), static grid (graph-safe). The
sampler's two-level inverse CDF (`dscale_runtime.sampling`) needs nothing else of the full row, so no fp32
copy of the [R, V] logits is ever written.

This module imports triton at import time: import it only through `dscale_runtime.kernels.sampling`, which
does so lazily. With TRITON_INTERPRET=1 set before triton is imported, it runs in Triton's interpreter on CPU
tensors too (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _chunk_exp_sums_kernel(logits, shift, inv_t, out, vocab, stride_row, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits + row * stride_row + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    m = tl.load(shift + row)
    s = tl.load(inv_t + row)
    e = tl.exp((x - m) * s)  # exp(-inf) = 0 past the vocabulary
    tl.store(out + row * num_chunks + chunk, tl.sum(e, 0))


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return not isinstance(_chunk_exp_sums_kernel, triton.runtime.JITFunction)


def chunk_exp_sums_triton(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, chunk: int) -> torch.Tensor:
    if logits.dtype not in _DTYPES:
        raise ValueError(f"Triton chunk sums take {_DTYPES} logits, got {logits.dtype}: use DSCALE_FUSED=ref "
                         "(KernelChoice.fused='ref')")
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [R, V] with contiguous rows"
    assert chunk & (chunk - 1) == 0, "the chunk must be a power of two"
    if not logits.is_cuda and not interpreted():
        raise RuntimeError("Triton chunk sums on CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported, or use DSCALE_FUSED=ref (KernelChoice.fused='ref')")
    rows, vocab = logits.shape
    num_chunks = -(-vocab // chunk)
    # NOTE: allocated by torch on the logits' device: inside a CUDA graph capture, from the graph's pool.
    out = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    if rows:
        _chunk_exp_sums_kernel[(rows, num_chunks)](logits, shift.float().contiguous(), inv_t.float().contiguous(),
                                                   out, vocab, logits.stride(0), num_chunks, CHUNK=chunk,
                                                   num_warps=4)
    return out
