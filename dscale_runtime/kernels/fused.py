"""Fused elementwise ops of the Qwen3 layer behind one API, each beside its portable reference (`*_ref`).

The references are exactly the torch op sequence of `models/layers.py` (every op rounding to the tensor dtype):
RMSNorm, the residual add before `post_attention_layernorm`, q_norm / k_norm followed by RoPE (alone, and with
the K/V cache store after it), and the SwiGLU activation. The routers take the path from their caller
(`backend=`: the layers pass their KernelChoice's `fused`): 'triton' runs the Triton kernels (`triton_fused.py`,
imported lazily; on CPU tensors that is Triton's interpreter, for tests), 'ref' the reference, and 'auto' (direct
calls) applies the auto rule to the tensor. No router reads the environment (DSCALE_FUSED is read once, by
`KernelChoice.resolve`). See `triton_fused.py` for what is bit-identical to the reference and what may differ by
1 ulp.
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


def qkv_norm_rope_store_ref(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_weight: torch.Tensor | None,
                            k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                            slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor | None:
    """qkv [T, (Hq + 2 Hkv) * D] (q, k, v heads) -> q after q_norm and RoPE [T, Hq, D] (None when Hq = 0); k after
    k_norm and RoPE and v stored into the caches [slots, Hkv, D] at `slots` [T]: the attention layer's sequence."""
    head_dim = k_cache.shape[-1]
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    k = qk_norm_rope_ref(k.reshape(-1, num_kv_heads, head_dim), k_weight, cos, sin, eps)
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.reshape(-1, num_kv_heads, head_dim).to(v_cache.dtype)
    if num_q_heads == 0:
        return None
    return qk_norm_rope_ref(q.reshape(-1, num_q_heads, head_dim), q_weight, cos, sin, eps)


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
    # (sum, normed) buffers [T, d] with unit feature stride, either None (a new tensor); the sum may be x
    out: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    skip: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # x + delta [T, d], rms_norm(x + delta) [T, d]
    """The residual add and the following RMSNorm (`add_rms_norm_ref`'s contract) in one pass. `skip` > 1 (a
    DFlash block's width): only the rows that are not first in their group of `skip` rows, normed -> [T - T / skip,
    d] contiguous (what the LM head reads: the drafts, not the anchors); the sum holds those rows only."""
    if fused_backend(x, backend, delta, weight) == "ref":
        total_out, normed_out = out if out is not None else (None, None)
        assert not skip or (normed_out is None and x.shape[0] % skip == 0), (skip, x.shape)
        total = x + delta if total_out is None else torch.add(x, delta, out=total_out)
        if skip:
            dim = x.shape[-1]
            return total, rms_norm_ref(total.view(-1, skip, dim)[:, 1:], weight, eps).reshape(-1, dim)
        normed = rms_norm_ref(total, weight, eps)
        return total, (normed if normed_out is None else normed_out.copy_(normed))
    from dscale_runtime.kernels.triton_fused import add_rms_norm_triton

    return add_rms_norm_triton(x, delta, weight, eps, out=out, skip=skip)


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


def qkv_norm_rope_store(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]: the fused projection's output, q heads, k heads, v heads
    num_q_heads: int,  # 0: k and v rows only (context rows that never become queries)
    num_kv_heads: int,
    q_weight: torch.Tensor | None,  # [D] q_norm (None when num_q_heads = 0)
    k_weight: torch.Tensor,  # [D] k_norm
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    eps: float,
    slots: torch.Tensor,  # [T] flat cache slots
    k_cache: torch.Tensor,  # [num_slots, Hkv, D]
    v_cache: torch.Tensor,  # [num_slots, Hkv, D]
    *,
    backend: str = "auto",
) -> torch.Tensor | None:  # [T, Hq, D]
    """q_norm / k_norm and RoPE of a row's heads, K and V stored at their slots (`qkv_norm_rope_store_ref`'s
    contract); the Triton path does it in one launch. Caches of another dtype than qkv take the reference."""
    weights = (k_weight,) if q_weight is None else (q_weight, k_weight)
    if (k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype
            or fused_backend(qkv, backend, *weights, cos, sin) == "ref"):
        return qkv_norm_rope_store_ref(qkv, num_q_heads, num_kv_heads, q_weight, k_weight, cos, sin, eps, slots,
                                       k_cache, v_cache)
    from dscale_runtime.kernels.triton_fused import qkv_norm_rope_store_triton

    return qkv_norm_rope_store_triton(qkv, num_q_heads, num_kv_heads, q_weight, k_weight, cos, sin, eps, slots,
                                      k_cache, v_cache)


def kv_norm_rope_store_layers(
    kv: torch.Tensor,  # [T, L * 2 Hkv * D]: per layer its k heads, then its v heads (one projection of every layer)
    num_kv_heads: int,
    k_weights: torch.Tensor,  # [L, D] each layer's k_norm
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
    eps: float,
    slots: torch.Tensor,  # [T] flat cache slots
    k_caches: list[torch.Tensor],  # L x [num_slots, Hkv, D]
    v_caches: list[torch.Tensor],
    *,
    backend: str = "auto",
) -> None:
    """`qkv_norm_rope_store` without q heads for L layers' K/V of the same rows (the drafter's context): each layer's
    columns k_norm'ed, roped and stored into its caches. The Triton path takes one launch for all layers when their
    caches are equally spaced views of one allocation (a `PagedKVCache`'s layers), else one per layer."""
    width = kv.shape[1] // max(1, len(k_caches))
    one = (fused_backend(kv, backend, k_weights, cos, sin) == "triton"
           and all(c.dtype == kv.dtype for c in (*k_caches, *v_caches)))
    if one:
        from dscale_runtime.kernels.triton_fused import kv_norm_rope_store_layers_triton, layer_stride

        one = layer_stride(k_caches) is not None and layer_stride(v_caches) is not None
        if one:
            kv_norm_rope_store_layers_triton(kv, num_kv_heads, k_weights, cos, sin, eps, slots, k_caches, v_caches)
            return
    for i, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches)):
        qkv_norm_rope_store(kv[:, i * width:(i + 1) * width], 0, num_kv_heads, None, k_weights[i], cos, sin, eps, slots,
                            k_cache, v_cache, backend=backend)


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
