"""Fused elementwise ops of the Qwen3 layer behind one API, each beside its portable reference (`*_ref`).

The references are exactly the torch op sequence of `models/layers.py` (every op rounding to the tensor
dtype): RMSNorm, the residual add before `post_attention_layernorm`, q_norm / k_norm followed by RoPE, and
the SwiGLU activation. The routers take the path from their caller (`backend=`: the layers pass their
KernelChoice's `fused`): 'triton' runs the Triton kernels (`triton_fused.py`, imported lazily; on CPU
tensors that is Triton's interpreter, for tests), 'ref' the reference, and 'auto' (direct calls) applies the
auto rule to the tensor. No router reads the environment (DSCALE_FUSED is read once, by
`KernelChoice.resolve`). See `triton_fused.py` for what is bit-identical to the reference and what may
differ by 1 ulp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dscale_runtime.kernels.choice import TRITON_DTYPES, auto_backend, check_backend


def fused_backend(x: torch.Tensor, backend: str = "auto", *others: torch.Tensor) -> str:
    """'ref' or 'triton' for this call: `backend` as given ('auto': the auto rule on x). The kernels are for
    inference: a call that autograd records (training) or whose other operands (`others`: weights, RoPE
    tables, the residual) differ from x in dtype or device (autocast) takes the reference even when
    'triton' is chosen; these are checks of the tensors, not of any setting."""
    check_backend(backend, "DSCALE_FUSED")
    if backend == "ref":
        return "ref"
    operands = (x, *others)
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        return "ref"
    if any(t.dtype != x.dtype or t.device != x.device for t in others) or x.dtype not in TRITON_DTYPES:
        return "ref"
    return auto_backend(x.device, x.dtype) if backend == "auto" else backend


# ------------------------------------------------------------------------------------------ references
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d], weight [d] -> [..., d]: layers.RMSNorm (normalise in fp32, cast back, then scale)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [T, d] -> (x + delta, rms_norm(x + delta)), both [T, d]."""
    total = x + delta
    return total, rms_norm_ref(total, weight, eps)


def qk_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """x [T, H, D], weight [D], cos/sin [T, D] -> [T, H, D]: q_norm (or k_norm), then layers.apply_rope."""
    x = rms_norm_ref(x, weight, eps)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate) * up [T, I] (the MLP's activation)."""
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


# -------------------------------------------------------------------------------------------- routers
def rms_norm(
    x: torch.Tensor,  # [..., d], rows with unit feature stride
    weight: torch.Tensor,  # [d]
    eps: float,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,  # [..., d]
) -> torch.Tensor:  # [..., d]
    """RMSNorm over the last dim through the chosen path (same result contract as `rms_norm_ref`)."""
    if fused_backend(x, backend, weight) == "ref":
        result = rms_norm_ref(x, weight, eps)
        return result if out is None else out.copy_(result)
    from dscale_runtime.kernels.triton_fused import rms_norm_triton

    return rms_norm_triton(x, weight, eps, out=out)


def add_rms_norm(
    x: torch.Tensor,  # [T, d], the residual stream
    delta: torch.Tensor,  # [T, d], the sublayer's output
    weight: torch.Tensor,  # [d]
    eps: float,
    *,
    backend: str = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,  # (sum, normed) buffers [T, d]; the sum may be x
) -> tuple[torch.Tensor, torch.Tensor]:  # x + delta [T, d], rms_norm(x + delta) [T, d]
    """The residual add and the following RMSNorm (`add_rms_norm_ref`'s contract) in one pass."""
    if fused_backend(x, backend, delta, weight) == "ref":
        total, normed = add_rms_norm_ref(x, delta, weight, eps)
        return (total, normed) if out is None else (out[0].copy_(total), out[1].copy_(normed))
    from dscale_runtime.kernels.triton_fused import add_rms_norm_triton

    return add_rms_norm_triton(x, delta, weight, eps, out=out)


def qk_norm_rope(
    x: torch.Tensor,  # [T, H, D]; may be a strided view of the fused qkv projection
    weight: torch.Tensor,  # [D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    eps: float,
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,  # [T, H, D]
) -> torch.Tensor:  # [T, H, D]
    """q_norm / k_norm then RoPE (`qk_norm_rope_ref`'s contract), reading x in place on the Triton path."""
    if fused_backend(x, backend, weight, cos, sin) == "ref":
        result = qk_norm_rope_ref(x, weight, cos, sin, eps)
        return result if out is None else out.copy_(result)
    from dscale_runtime.kernels.triton_fused import qk_norm_rope_triton

    return qk_norm_rope_triton(x, weight, cos, sin, eps, out=out)


def silu_mul(
    gate_up: torch.Tensor,  # [T, 2I]
    *,
    backend: str = "auto",
    out: torch.Tensor | None = None,  # [T, I]
) -> torch.Tensor:  # [T, I]
    """silu(gate) * up (`silu_mul_ref`'s contract)."""
    if fused_backend(gate_up, backend) == "ref":
        result = silu_mul_ref(gate_up)
        return result if out is None else out.copy_(result)
    from dscale_runtime.kernels.triton_fused import silu_mul_triton

    return silu_mul_triton(gate_up, out=out)
