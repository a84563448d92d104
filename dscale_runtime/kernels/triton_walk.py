"""Triton kernel of DFlash 2's candidate-selector walk (`models/dflash2.py`, `CandidateSelector.walk`) in one launch.

A program per request walks its W - 1 draft slots left to right, as `walk_ref` does: at slot j it reads the
predecessor's codebook row (the anchor's at slot 0), the slot's projected hidden state and the K candidates'
successor rows, scores the K candidates, picks the argmax (first maximum, torch's rule) or, for rows that
sample their drafts, draws from q = softmax(scores / T) (float64) by the inverse CDF at the slot's keyed
uniform (`sampling.sample_inverse_cdf_ref`'s rule), and writes the chosen token straight into the block. Only
the K scores of the predecessor actually chosen are computed (the torch form computes all K x K transitions
and then runs a chain of W - 1 gathers: ~40 launches).

Rounding follows the torch sequence: the codebook row times the projection rounded to the tensor dtype, the
fp32 dot product over the rank rounded to the dtype (torch's matmul output), then added to the fp32 unary
logits. The dot product's fp32 sum may be reduced in another order than cuBLAS's, so the last bit of a 16-bit
score can differ from the torch form's (fp32 agrees to rounding). q's exp is CUDA's `exp` (libdevice) on the
GPU, numpy's in the interpreter; its cumulative sum is a scan (another order than torch's cumsum: float64
rounding only). Grids depend on shapes only: safe to capture in a CUDA graph; no host synchronisation.

This module imports triton at import time: import it only through `models/dflash2.py`, which does so lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from dscale_runtime.kernels.triton_fused import _DTYPES, _LAUNCH, _round, interpreted

_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _walk_kernel(proj, unary, cand, anchor, pred_cb, succ_cb, temp, draw, uni, path, scores, q, slots,
                 path_row, uni_row, uni_col, anchor_step, RANK: tl.constexpr, K: tl.constexpr, RB: tl.constexpr,
                 KB: tl.constexpr, SAMPLED: tl.constexpr, DTYPE: tl.constexpr, ACCURATE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, KB)
    rs = tl.arange(0, RB)
    k_in, r_in = ks < K, rs < RANK
    prev = tl.load(anchor + n * anchor_step).to(tl.int64)
    if SAMPLED:
        t = tl.maximum(tl.load(temp + n).to(tl.float64), 1e-6)
        drawing = tl.load(draw + n + ks * 0) != 0  # NOTE: a vector: the interpreter masks by blocks
    for j in range(slots):
        row = n * slots + j
        token = tl.load(cand + row * K + ks, mask=k_in, other=0).to(tl.int64)  # [KB]
        h = tl.load(proj + row * RANK + rs, mask=r_in, other=0.0).to(tl.float32)  # [RB]
        p = tl.load(pred_cb + prev * RANK + rs, mask=r_in, other=0.0).to(tl.float32)
        left = _round(p * h, DTYPE)
        succ = tl.load(succ_cb + token[:, None] * RANK + rs[None, :], mask=k_in[:, None] & r_in[None, :],
                       other=0.0).to(tl.float32)  # [KB, RB]
        dot = _round(tl.sum(succ * left[None, :], axis=1), DTYPE)
        score = tl.load(unary + row * K + ks, mask=k_in, other=0.0) + dot
        score = tl.where(k_in, score, float("-inf"))
        tl.store(scores + row * K + ks, score, mask=k_in)
        choice = tl.argmax(score, 0)  # NOTE: the first maximum, as torch's argmax
        if SAMPLED:
            x = score.to(tl.float64) / t
            if ACCURATE:
                e = libdevice.exp(x - tl.max(x, 0))  # NOTE: __nv_exp in float64, as torch's CUDA softmax
            else:
                e = tl.exp(x - tl.max(x, 0))  # NOTE: the interpreter has no libdevice (numpy's exp)
            e = tl.where(k_in, e, 0.0)
            w = e / tl.sum(e, 0)
            tl.store(q + row * K + ks, w, mask=k_in)
            cdf = tl.cumsum(w, 0)
            total = tl.max(tl.where(k_in, cdf, 0.0), 0)
            value = tl.load(uni + n * uni_row + j * uni_col + ks * 0).to(tl.float64) * total  # [KB], all equal
            drawn = tl.sum(tl.where(k_in & (cdf <= value), 1, 0), 0)  # searchsorted(cdf, value, right=True)
            last = tl.sum(tl.where(k_in & (cdf < total), 1, 0), 0)  # the last token of positive weight
            drawn = tl.minimum(drawn, last)
            choice = tl.max(tl.where(drawing, drawn, choice), 0)
        prev = tl.sum(tl.where(ks == choice, token, 0), 0)
        tl.store(path + n * path_row + j + ks * 0, prev + ks * 0, mask=ks == 0)


def selector_walk_triton(
    proj: torch.Tensor,  # [N, P, r] projected hidden states (the codebooks' dtype)
    unary: torch.Tensor,  # [N, P, K] fp32 the candidates' (scaled) logits
    candidates: torch.Tensor,  # [N, P, K] int64 token ids
    anchors: torch.Tensor,  # [N] the blocks' slot-0 tokens (any stride: the block's column 0)
    predecessor: torch.Tensor,  # [V, r]
    successor: torch.Tensor,  # [V, r]
    out: torch.Tensor,  # [N, P] int64 written with the path (a view of the block's slots 1.., rows strided)
    temperature: torch.Tensor | None = None,  # [N]
    draw: torch.Tensor | None = None,  # [N] bool
    uniforms: torch.Tensor | None = None,  # [N, P] float64
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`CandidateSelector.walk` in one launch: writes the path into `out` -> (scores [N, P, K] fp32 along the path,
    q [N, P, K] float64 when `draw` is given)."""
    n, p, k = candidates.shape
    rank = proj.shape[-1]
    assert proj.dtype in _DTYPES and predecessor.dtype == successor.dtype == proj.dtype, (proj.dtype,)
    assert unary.dtype == torch.float32 and candidates.dtype == torch.long and out.shape == (n, p)
    assert out.stride(1) == 1 and predecessor.shape[1] == successor.shape[1] == rank
    if not proj.is_cuda and not interpreted():
        raise RuntimeError("the Triton selector walk on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is imported, or use DSCALE_FUSED=ref (KernelChoice.fused='ref')")
    proj, unary, candidates = proj.contiguous(), unary.contiguous(), candidates.contiguous()
    predecessor, successor = predecessor.contiguous(), successor.contiguous()
    scores = torch.empty(n, p, k, dtype=torch.float32, device=proj.device)
    sampled = draw is not None
    q = torch.empty(n, p, k, dtype=torch.float64, device=proj.device) if sampled else None
    if n == 0:
        return scores, q
    if sampled:
        temp, flag, uni = temperature.contiguous(), draw.contiguous(), uniforms
    else:
        temp, flag, uni = unary, unary, unary  # NOTE: unread (SAMPLED is off)
    _walk_kernel[(n,)](proj, unary, candidates, anchors, predecessor, successor, temp, flag, uni, out, scores,
                       scores if q is None else q, p, out.stride(0), *(uni.stride() if sampled else (0, 0)),
                       anchors.stride(0), RANK=rank, K=k,
                       RB=triton.next_power_of_2(rank), KB=triton.next_power_of_2(k), SAMPLED=sampled,
                       DTYPE=_TL[proj.dtype], ACCURATE=not interpreted(), num_warps=4, **_LAUNCH)
    return scores, q
