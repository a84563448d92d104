"""Triton kernels for the Qwen3 layer's elementwise work: RMSNorm (alone and after the residual add), q/k norm
with RoPE (also fused with the K/V cache store), and SiLU-and-multiply. Each replaces several torch launches by
one and rounds where torch rounds.

Every value is computed in fp32 and rounded to the tensor dtype at the points where the torch sequence of
`fused.py`'s references stores a tensor, so the elementwise arithmetic is bit-identical. What can differ:
- the fp32 sum of squares of a norm is reduced in another order than torch's (torch's CPU and CUDA kernels
  differ from each other too), so on general inputs its last bits may differ. A 16-bit output then moves by
  at most 1 ulp on the normalised value and 1 more through the weight's product (2 ulps), an fp32 output by
  a few ulps; RoPE's sum may cancel, so its error is bounded by the ulps of its two terms. When the sum of
  squares is exact in any order the norms are bit-identical (the tests use such inputs to check every
  rounding point). In practice bf16 rows rarely differ at all: the squares of bf16 values sum almost exactly;
- `exp` in SiLU is CUDA's `expf` (libdevice) on the GPU, as torch's kernel uses, but numpy's in the
  interpreter, which differs from torch's CPU `exp` in the last fp32 bit (bf16 results still agree: every
  bf16 input checked).
Division is IEEE-rounded (`div_rn`, not Triton's approximate `/`), 1/sqrt is `rsqrt` (on the GPU the
hardware approximation that torch's CUDA rms_norm also uses, `rsqrtf`; in the interpreter 1/sqrt rounded
twice, as torch's CPU path), and fp32 multiply-adds are never fused into FMAs (`enable_fp_fusion=False`).
fp32 -> bf16 rounding is written out in integer arithmetic (round to nearest even), because the
interpreter's conversion truncates (it also mishandles bf16 subnormals, which the CPU tests avoid). Grids
depend on shapes only: every launch is safe to capture in a CUDA graph.

This module imports triton at import time: import it only through `dscale_runtime.kernels.fused`, which does
so lazily. CUDA tensors run the compiled kernels; with TRITON_INTERPRET=1 set before triton is imported, the
kernels run in Triton's interpreter, on CPU tensors too (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LAUNCH = {"enable_fp_fusion": False}  # NOTE: x*a + y*b must round both products, as torch does
MAX_DIM = 8192  # longest normalised row: one program holds a whole row in registers
ELEMENTS_PER_PROGRAM = 2048  # rows of short norms, heads of q/k and SiLU columns are grouped up to this


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (to nearest, ties to even) and widened back: what a torch op's store does."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _inv_rms(sum_sq, n: tl.constexpr, eps):
    """1 / sqrt(mean + eps) as torch computes it: sum / n rounded, plus eps rounded, then rsqrt."""
    return tl.math.rsqrt(tl.math.div_rn(sum_sq, n * 1.0) + eps)


@triton.jit
def _rms_norm_kernel(
    X, Delta, W, Sum, Out,  # x, delta, sum, out [T, d] (delta and sum only with HAS_DELTA); weight [d]
    num_rows, stride_x, stride_delta, stride_sum, stride_out, eps, skip,
    DIM: tl.constexpr,  # d
    BLOCK_D: tl.constexpr,  # d rounded up to a power of two
    ROWS: tl.constexpr,  # rows per program
    HAS_DELTA: tl.constexpr,  # add_rms_norm: normalise x + delta, and store that sum
    SKIP: tl.constexpr,  # out row r reads (and sums into) row r + r // (skip - 1) + 1 of x, delta and sum: every
    #                      group of `skip` input rows without its first (a DFlash block's drafts without the anchor)
):
    DTYPE: tl.constexpr = Out.dtype.element_ty
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    src = rows
    if SKIP:
        src = rows + rows // (skip - 1) + 1
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < num_rows)[:, None] & (cols < DIM)[None, :]  # [ROWS, BLOCK_D]
    x = tl.load(X + src[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(Delta + src[:, None] * stride_delta + cols[None, :], mask=mask, other=0.0)
        x = _round(x + delta.to(tl.float32), DTYPE)
        tl.store(Sum + src[:, None] * stride_sum + cols[None, :], x.to(DTYPE), mask=mask)
    inv = _inv_rms(tl.sum(x * x, 1), DIM, eps)  # [ROWS]
    w = tl.load(W + cols, mask=cols < DIM, other=0.0).to(tl.float32)
    out = _round(w[None, :] * _round(x * inv[:, None], DTYPE), DTYPE)
    tl.store(Out + rows[:, None] * stride_out + cols[None, :], out.to(DTYPE), mask=mask)


@triton.jit
def _norm_rope(lo, hi, w_lo, w_hi, cos_lo, cos_hi, sin_lo, sin_hi, eps, HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr):
    """Heads [HEADS, HALF] as their two halves (fp32) -> q_norm / k_norm then RoPE, rounded where torch rounds."""
    inv = _inv_rms(tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1), HEAD_DIM, eps)[:, None]  # [HEADS, 1]
    lo = _round(w_lo * _round(lo * inv, DTYPE), DTYPE)  # q_norm / k_norm output
    hi = _round(w_hi * _round(hi * inv, DTYPE), DTYPE)
    out_lo = _round(_round(lo * cos_lo, DTYPE) + _round(-hi * sin_lo, DTYPE), DTYPE)  # x*cos + rotate_half(x)*sin
    out_hi = _round(_round(hi * cos_hi, DTYPE) + _round(lo * sin_hi, DTYPE), DTYPE)
    return out_lo, out_hi


@triton.jit
def _qk_norm_rope_kernel(
    X, W, Cos, Sin, Out,  # x [T, H, D] (any row and head strides); weight [D]; cos, sin [T, D]; out [T, H, D]
    num_heads, stride_xt, stride_xh, stride_ct, stride_st, stride_ot, stride_oh, eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,  # HEAD_DIM / 2 rounded up to a power of two
    HEADS: tl.constexpr,  # heads per program
):
    DTYPE: tl.constexpr = Out.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS]
    offs = tl.arange(0, BLOCK_HALF)
    half_ok = offs < HALF
    mask = (heads < num_heads)[:, None] & half_ok[None, :]  # [HEADS, BLOCK_HALF]
    # NOTE: each head is read as its two halves, so rotate-half pairs element j with element j of the other
    # half in registers (no shuffles, no second read).
    x_ptrs = X + t * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    lo = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)  # [HEADS, BLOCK_HALF]
    hi = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    w_lo = tl.load(W + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    w_hi = tl.load(W + HALF + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    cos_lo = tl.load(Cos + t * stride_ct + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(Cos + t * stride_ct + HALF + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(Sin + t * stride_st + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(Sin + t * stride_st + HALF + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    out_lo, out_hi = _norm_rope(lo, hi, w_lo, w_hi, cos_lo, cos_hi, sin_lo, sin_hi, eps, HEAD_DIM, DTYPE)
    o_ptrs = Out + t * stride_ot + heads[:, None] * stride_oh + offs[None, :]
    tl.store(o_ptrs, out_lo.to(DTYPE), mask=mask)
    tl.store(o_ptrs + HALF, out_hi.to(DTYPE), mask=mask)


@triton.jit
def _qkv_norm_rope_store_kernel(
    X,  # [T, (Hq + 2 Hkv) * D]: the fused projection's row (q heads, k heads, v heads), unit head stride D
    QW, KW, Cos, Sin,  # q_norm / k_norm weights [D]; cos, sin [T, D]
    QOut,  # [T, Hq, D] (unused when Hq = 0)
    KCache, VCache,  # [slots, Hkv, D] each
    Slots,  # [T] the flat cache slot of each row
    num_q_heads, num_kv_heads, stride_xt, stride_ct, stride_st, stride_qt, stride_qh, stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_xl, stride_wl, stride_kl, stride_vl,  # layer l (grid axis 2; k, v only): X, KW, caches offset by l x these
    eps,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HEADS: tl.constexpr,  # heads per program, over the q heads then the k heads of a row
):
    DTYPE: tl.constexpr = KCache.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(2).to(tl.int64)  # NOTE: 0 but for the drafter's context K/V of every layer in one launch
    X += layer * stride_xl
    KW += layer * stride_wl
    KCache += layer * stride_kl
    VCache += layer * stride_vl
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)  # [HEADS] q heads [0, Hq), then k heads
    is_q = heads < num_q_heads
    is_k = (heads >= num_q_heads) & (heads < num_q_heads + num_kv_heads)
    offs = tl.arange(0, BLOCK_HALF)
    half_ok = offs < HALF
    mask = (is_q | is_k)[:, None] & half_ok[None, :]
    x_ptrs = X + t * stride_xt + heads[:, None] * HEAD_DIM + offs[None, :]
    lo = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(x_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    qw_lo = tl.load(QW + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    qw_hi = tl.load(QW + HALF + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    kw_lo = tl.load(KW + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    kw_hi = tl.load(KW + HALF + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    w_lo = tl.where(is_q[:, None], qw_lo, kw_lo)
    w_hi = tl.where(is_q[:, None], qw_hi, kw_hi)
    cos_lo = tl.load(Cos + t * stride_ct + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    cos_hi = tl.load(Cos + t * stride_ct + HALF + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    sin_lo = tl.load(Sin + t * stride_st + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    sin_hi = tl.load(Sin + t * stride_st + HALF + offs, mask=half_ok, other=0.0).to(tl.float32)[None, :]
    out_lo, out_hi = _norm_rope(lo, hi, w_lo, w_hi, cos_lo, cos_hi, sin_lo, sin_hi, eps, HEAD_DIM, DTYPE)
    q_mask = is_q[:, None] & half_ok[None, :]
    q_ptrs = QOut + t * stride_qt + heads[:, None] * stride_qh + offs[None, :]
    tl.store(q_ptrs, out_lo.to(DTYPE), mask=q_mask)
    tl.store(q_ptrs + HALF, out_hi.to(DTYPE), mask=q_mask)
    # NOTE: k heads go to the cache at the row's slot; each k head's program also copies its v head there
    slot = tl.load(Slots + t).to(tl.int64)
    kv = tl.where(is_k, heads - num_q_heads, 0)  # [HEADS] kv head index
    k_mask = is_k[:, None] & half_ok[None, :]
    k_ptrs = KCache + slot * stride_ks + kv[:, None] * stride_kh + offs[None, :]
    tl.store(k_ptrs, out_lo.to(DTYPE), mask=k_mask)
    tl.store(k_ptrs + HALF, out_hi.to(DTYPE), mask=k_mask)
    v_src = X + t * stride_xt + (heads + num_kv_heads)[:, None] * HEAD_DIM + offs[None, :]
    v_dst = VCache + slot * stride_vs + kv[:, None] * stride_vh + offs[None, :]
    tl.store(v_dst, tl.load(v_src, mask=k_mask, other=0.0), mask=k_mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=k_mask, other=0.0), mask=k_mask)


@triton.jit
def _silu_mul_kernel(
    GateUp, Out,  # gate_up [T, 2I] (gate, then up); out [T, I]
    inter, stride_g, stride_o,
    BLOCK: tl.constexpr,  # columns per program
    INTERPRET: tl.constexpr,  # Triton's interpreter has no libdevice
):
    DTYPE: tl.constexpr = Out.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(GateUp + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + t * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if INTERPRET:
        e = tl.exp(-gate)
    else:
        e = libdevice.exp(-gate)  # NOTE: CUDA's expf, as torch's silu; tl.exp is the approximate ex2 path
    silu = _round(tl.math.div_rn(gate, 1.0 + e), DTYPE)
    tl.store(Out + t * stride_o + cols, _round(silu * up, DTYPE).to(DTYPE), mask=mask)


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    return not isinstance(_silu_mul_kernel, triton.runtime.JITFunction)


def require_interpreter_on_cpu(tensor: torch.Tensor, what: str, option: str) -> None:
    """Every Triton wrapper's check before a launch: CUDA tensors run the compiled kernel, CPU tensors only in
    Triton's interpreter; otherwise the error names both ways out (the interpreter, or the reference path of
    `KernelChoice.<option>` through its environment variable)."""
    if not tensor.is_cuda and not interpreted():
        from dscale_runtime.kernels.choice import ENVIRONMENT

        raise RuntimeError(f"{what} on CPU tensors: Triton's interpreter is needed (set TRITON_INTERPRET=1 before "
                           f"triton is imported), or use {ENVIRONMENT[option]}=ref (KernelChoice.{option}='ref')")


def _warps(elements: int) -> int:
    return max(1, min(16, elements // 512))


def rms_norm_config(dim: int) -> dict:
    """Compile-time arguments and warps of `_rms_norm_kernel` for rows of `dim` (static sizes only)."""
    assert 1 <= dim <= MAX_DIM, f"rms_norm over {dim} features: at most {MAX_DIM}"
    block = triton.next_power_of_2(dim)
    rows = max(1, ELEMENTS_PER_PROGRAM // block)
    return {"DIM": dim, "BLOCK_D": block, "ROWS": rows, "num_warps": _warps(rows * block)}


def qk_norm_rope_config(num_heads: int, head_dim: int) -> dict:
    """Compile-time arguments and warps of `_qk_norm_rope_kernel` (static sizes only)."""
    assert head_dim % 2 == 0, f"RoPE needs an even head_dim, got {head_dim}"
    block_half = triton.next_power_of_2(head_dim // 2)
    heads = min(triton.next_power_of_2(num_heads), max(1, ELEMENTS_PER_PROGRAM // (2 * block_half)))
    return {"HEAD_DIM": head_dim, "BLOCK_HALF": block_half, "HEADS": heads,
            "num_warps": _warps(2 * heads * block_half)}


def silu_mul_config(inter: int) -> dict:
    """Compile-time arguments and warps of `_silu_mul_kernel` (static sizes only)."""
    block = min(triton.next_power_of_2(inter), ELEMENTS_PER_PROGRAM)
    return {"BLOCK": block, "INTERPRET": interpreted(), "num_warps": _warps(block)}


def _check(x: torch.Tensor, *others: torch.Tensor) -> None:
    assert x.dtype in _DTYPES, f"fused kernels take {_DTYPES}, got {x.dtype}"
    for other in others:
        assert other.dtype == x.dtype and other.device == x.device, (x.dtype, other.dtype, x.device, other.device)
    require_interpreter_on_cpu(x, "Triton fused kernels", "fused")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, features] with unit feature stride (a view when possible)."""
    x = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def _out(like: torch.Tensor, out: torch.Tensor | None, shape) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    assert out.shape == torch.Size(shape) and out.dtype == like.dtype and out.device == like.device, out.shape
    assert out.is_contiguous() or out.dim() == 2 and out.stride(-1) == 1, "out needs unit feature stride"
    return out


def _norm_launch(x, delta, weight, eps, out, sum_out, skip: int = 0):
    _check(x, weight, *(t for t in (delta, out, sum_out) if t is not None))
    dim = x.shape[-1]
    assert weight.shape == (dim,) and weight.is_contiguous(), weight.shape
    rows = _rows(x)
    num = rows.shape[0]
    if skip:  # NOTE: the output holds every group of `skip` rows but its first (`add_rms_norm_triton`)
        assert skip > 1 and num % skip == 0 and out is None, (skip, num)
        num -= num // skip
    out = _out(x, out, (num, dim) if skip else x.shape)
    out2 = out.view(-1, dim)
    if delta is not None:
        assert delta.shape == x.shape, (delta.shape, x.shape)
        sum_out = _out(x, sum_out, x.shape)
        delta2, sum2 = _rows(delta), sum_out.view(-1, dim)
    else:
        delta2 = sum2 = rows  # unused (HAS_DELTA=False)
    if num == 0:
        return out, sum_out
    consts = rms_norm_config(dim)
    grid = (triton.cdiv(num, consts["ROWS"]),)
    _rms_norm_kernel[grid](rows, delta2, weight, sum2, out2, num, rows.stride(0), delta2.stride(0), sum2.stride(0),
                           out2.stride(0), eps, skip, HAS_DELTA=delta is not None, SKIP=bool(skip),
                           **consts, **_LAUNCH)
    return out, sum_out


def rms_norm_triton(
    x: torch.Tensor,  # [..., d]
    weight: torch.Tensor,  # [d]
    eps: float,
    out: torch.Tensor | None = None,  # [..., d]; may be x itself
) -> torch.Tensor:  # [..., d]
    """`weight * rms_norm(x.float()).to(x.dtype)` over the last dim, one launch."""
    return _norm_launch(x, None, weight, eps, out, None)[0]


def add_rms_norm_triton(
    x: torch.Tensor,  # [T, d]
    delta: torch.Tensor,  # [T, d]
    weight: torch.Tensor,  # [d]
    eps: float,
    # (sum [T, d], normed [T, d]), either None (a new tensor); the sum may be x, or strided rows (unit feature stride)
    out: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    skip: int = 0,  # > 1: normalise only rows not first in their group of `skip` (normed [T - T / skip, d])
) -> tuple[torch.Tensor, torch.Tensor]:  # x + delta [T, d], rms_norm(x + delta) [T, d]
    """The residual add and the next RMSNorm in one pass: the sum is rounded to the dtype, then normalised. With
    `skip` the rows first in each group of `skip` are neither summed nor normalised, and the normed rows of the
    others come out contiguous (a DFlash block's drafts, its anchors left out: the LM head's rows)."""
    sum_out, norm_out = out if out is not None else (None, None)
    norm_out, sum_out = _norm_launch(x, delta, weight, eps, norm_out, sum_out, skip)
    return sum_out, norm_out


def qk_norm_rope_triton(
    x: torch.Tensor,  # [T, H, D]; any row and head strides (a view of the fused qkv projection)
    weight: torch.Tensor,  # [D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    eps: float,
    out: torch.Tensor | None = None,  # [T, H, D] with unit last stride; may be x itself
) -> torch.Tensor:  # [T, H, D]
    """apply_rope(rms_norm over D (q_norm / k_norm), cos, sin) in one launch, reading x where it lies."""
    _check(x, weight, cos, sin, *(t for t in (out,) if t is not None))
    num_rows, num_heads, head_dim = x.shape
    assert weight.shape == (head_dim,) and weight.is_contiguous(), weight.shape
    assert cos.shape == sin.shape == (num_rows, head_dim), (cos.shape, sin.shape, x.shape)
    x = x if x.stride(-1) == 1 else x.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(-1) == 1, (out.shape, out.stride())
    if num_rows == 0:
        return out
    consts = qk_norm_rope_config(num_heads, head_dim)
    grid = (num_rows, triton.cdiv(num_heads, consts["HEADS"]))
    _qk_norm_rope_kernel[grid](x, weight, cos, sin, out, num_heads, x.stride(0), x.stride(1), cos.stride(0),
                               sin.stride(0), out.stride(0), out.stride(1), eps, **consts, **_LAUNCH)
    return out


def qkv_norm_rope_store_triton(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]: q heads, k heads, v heads (Hq may be 0: k and v only)
    num_q_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None,  # [D] (None when Hq = 0)
    k_weight: torch.Tensor,  # [D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    eps: float,
    slots: torch.Tensor,  # [T] int, flat cache slots
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    q_out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor | None:  # q after q_norm and RoPE [T, Hq, D] (None when Hq = 0)
    """q_norm + RoPE of the q heads, k_norm + RoPE of the k heads stored at `slots`, the v heads copied there: one
    launch for what the layer did in four (two qk_norm_rope, two index_put). The q and k values are those of
    `qk_norm_rope_triton` (the same arithmetic)."""
    num_rows = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert qkv.dim() == 2 and qkv.stride(-1) == 1, (qkv.shape, qkv.stride())
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim, (qkv.shape, num_q_heads, num_kv_heads)
    assert k_cache.shape[1:] == v_cache.shape[1:] == (num_kv_heads, head_dim), (k_cache.shape, v_cache.shape)
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1, (k_cache.stride(), v_cache.stride())
    assert slots.shape == (num_rows,) and not slots.dtype.is_floating_point, (slots.shape, slots.dtype)
    q_weight = k_weight if num_q_heads == 0 else q_weight
    _check(qkv, q_weight, k_weight, cos, sin, k_cache, v_cache, *(t for t in (q_out,) if t is not None))
    assert cos.shape == sin.shape == (num_rows, head_dim), (cos.shape, sin.shape, qkv.shape)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if num_q_heads:
        q_out = _out(qkv, q_out, (num_rows, num_q_heads, head_dim))
    if num_rows == 0:
        return q_out
    q_buf = q_out if num_q_heads else k_cache  # NOTE: never written when Hq = 0 (every q store is masked)
    consts = qk_norm_rope_config(num_q_heads + num_kv_heads, head_dim)
    grid = (num_rows, triton.cdiv(num_q_heads + num_kv_heads, consts["HEADS"]))
    _qkv_norm_rope_store_kernel[grid](
        qkv, q_weight, k_weight, cos, sin, q_buf, k_cache, v_cache, slots, num_q_heads, num_kv_heads, qkv.stride(0),
        cos.stride(0), sin.stride(0), q_buf.stride(0), q_buf.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), 0, 0, 0, 0, eps, **consts, **_LAUNCH)
    return q_out


def kv_norm_rope_store_layers_triton(
    kv: torch.Tensor,  # [T, L * 2 Hkv * D]: per layer its k heads, then its v heads
    num_kv_heads: int,
    k_weights: torch.Tensor,  # [L, D] each layer's k_norm
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    eps: float,
    slots: torch.Tensor,  # [T] int, flat cache slots (the same in every layer)
    k_caches: list[torch.Tensor],  # L x [num_slots, Hkv, D], equally spaced in one allocation (`layer_stride`)
    v_caches: list[torch.Tensor],
) -> None:
    """`qkv_norm_rope_store_triton` without q heads for L layers at once (the drafter's context K/V: one launch
    instead of L), each layer's values those of the one-layer call. The caches must lie at one distance from
    each other (`layer_stride`: the layers of one `PagedKVCache`)."""
    num_layers, head_dim = k_weights.shape
    num_rows = kv.shape[0]
    width = 2 * num_kv_heads * head_dim
    assert kv.dim() == 2 and kv.stride(-1) == 1 and kv.shape[1] == num_layers * width, (kv.shape, kv.stride())
    assert len(k_caches) == len(v_caches) == num_layers and k_weights.stride(-1) == 1, (len(k_caches), num_layers)
    k_stride, v_stride = layer_stride(k_caches), layer_stride(v_caches)
    assert k_stride is not None and v_stride is not None, "the layers' caches are not equally spaced"
    k_cache, v_cache = k_caches[0], v_caches[0]
    assert k_cache.shape[1:] == v_cache.shape[1:] == (num_kv_heads, head_dim), (k_cache.shape, v_cache.shape)
    assert k_cache.stride(-1) == v_cache.stride(-1) == 1, (k_cache.stride(), v_cache.stride())
    assert slots.shape == (num_rows,) and not slots.dtype.is_floating_point, (slots.shape, slots.dtype)
    _check(kv, k_weights, cos, sin, k_cache, v_cache)
    assert cos.shape == sin.shape == (num_rows, head_dim), (cos.shape, sin.shape, kv.shape)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if num_rows == 0 or num_layers == 0:
        return
    consts = qk_norm_rope_config(num_kv_heads, head_dim)
    grid = (num_rows, triton.cdiv(num_kv_heads, consts["HEADS"]), num_layers)
    _qkv_norm_rope_store_kernel[grid](
        kv, k_weights, k_weights, cos, sin, k_cache, k_cache, v_cache, slots, 0, num_kv_heads, kv.stride(0),
        cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), width, k_weights.stride(0), k_stride, v_stride, eps, **consts, **_LAUNCH)


def layer_stride(caches: list[torch.Tensor]) -> int | None:
    """The distance in elements between consecutive layers' tensors of one shape, stride and dtype (the views of one
    `PagedKVCache`), or None when they are not equally spaced, overlap, or differ."""
    first = caches[0]
    if any(c.shape != first.shape or c.stride() != first.stride() or c.dtype != first.dtype
           or c.device != first.device for c in caches):
        return None
    if len(caches) == 1:
        return 0
    size = first.element_size()
    gaps = {(b.data_ptr() - a.data_ptr()) for a, b in zip(caches, caches[1:])}
    gap = gaps.pop()
    span = sum((n - 1) * st for n, st in zip(first.shape, first.stride())) + 1  # elements one layer's tensor covers
    # NOTE: layers that overlap (one tensor named twice) would race in one launch: None
    return gap // size if not gaps and gap % size == 0 and abs(gap // size) >= span else None


def silu_mul_triton(
    gate_up: torch.Tensor,  # [T, 2I]: gate columns, then up columns
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:  # [T, I]
    """silu(gate) * up, rounded where torch rounds, in one launch."""
    _check(gate_up, *(t for t in (out,) if t is not None))
    num_rows, width = gate_up.shape
    assert width % 2 == 0, f"gate_up needs 2 * intermediate columns, got {width}"
    inter = width // 2
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = _out(gate_up, out, (num_rows, inter))
    if num_rows == 0 or inter == 0:
        return out
    consts = silu_mul_config(inter)
    grid = (num_rows, triton.cdiv(inter, consts["BLOCK"]))
    _silu_mul_kernel[grid](gate_up, out, inter, gate_up.stride(0), out.stride(0), **consts, **_LAUNCH)
    return out


_KERNELS = {"rms_norm": _rms_norm_kernel, "qk_norm_rope": _qk_norm_rope_kernel,
            "qkv_norm_rope_store": _qkv_norm_rope_store_kernel, "silu_mul": _silu_mul_kernel}


def compile_offline(kernel: str, dtype: torch.dtype, arch: int = 90, **sizes):
    """Compile one kernel for an NVIDIA target without a GPU (Triton's bundled ptxas), with the wrappers' launch
    options: a CI check of the compiled path. `kernel` and its sizes: 'rms_norm' (dim, add: bool, skip: bool),
    'qk_norm_rope' and 'qkv_norm_rope_store' (num_heads: q heads + k heads, head_dim), 'silu_mul' (inter).
    Needs triton imported without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert not interpreted(), "compile_offline needs triton imported without TRITON_INTERPRET"
    if kernel == "rms_norm":
        consts = {**rms_norm_config(sizes["dim"]), "HAS_DELTA": bool(sizes.get("add", False)),
                  "SKIP": bool(sizes.get("skip", False))}
    elif kernel in ("qk_norm_rope", "qkv_norm_rope_store"):
        consts = qk_norm_rope_config(sizes["num_heads"], sizes["head_dim"])
    else:
        consts = silu_mul_config(sizes["inter"])
    options = {"num_warps": consts.pop("num_warps"), **_LAUNCH}
    elem = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    fn = _KERNELS[kernel]
    signature = {n: "constexpr" if n in consts else "*i64" if n == "Slots" else elem if n[0].isupper()
                 else "fp32" if n == "eps" else "i32" for n in fn.arg_names}
    # NOTE: as the JIT launcher does for 16-aligned pointers and 16-divisible strides (Qwen3 sizes), say so:
    # it decides the vector width of the loads.
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if signature[n].startswith("*") or n.startswith("stride") or n == "inter"}
    return triton.compile(ASTSource(fn, signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)
