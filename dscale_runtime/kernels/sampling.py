"""The sampler's one pass over the vocabulary: chunk sums of exp((l - shift) / T), reference and Triton router.

`chunk_exp_sums_ref` is the definition (fp64 sums of the fp32 weights of each chunk of `chunk` logits, the last
chunk shorter) and the oracle of the Triton kernel (`triton_sampling.py`, imported lazily), which reads the
logits once in their own dtype and writes only the [R, C] sums. `chunk_exp_sums` takes the path from its caller
(`backend=`: the runner passes the target's KernelChoice `fused`); 'auto' applies the auto rule to the logits.
"""

from __future__ import annotations

import torch

from dscale_runtime.kernels.choice import auto_backend, check_backend


def chunk_exp_sums_ref(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, chunk: int) -> torch.Tensor:
    """logits [R, V], shift [R], inv_t [R] -> [R, ceil(V / chunk)] float64: sum of exp((l - shift) * inv_t)."""
    r, vocab = logits.shape
    weights = torch.exp((logits.float() - shift.float()[:, None]) * inv_t.float()[:, None])
    pad = -vocab % chunk
    if pad:
        weights = torch.cat([weights, weights.new_zeros(r, pad)], dim=1)
    return weights.view(r, -1, chunk).sum(-1, dtype=torch.float64)


def chunk_exp_sums(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, chunk: int,
                   backend: str = "auto") -> torch.Tensor:
    """The chunk sums through the path `backend` names -> [R, C] float64 (the Triton path sums in fp32)."""
    check_backend(backend, "DSCALE_FUSED")
    if backend == "auto":
        backend = auto_backend(logits.device, logits.dtype)
    if backend == "ref":
        return chunk_exp_sums_ref(logits, shift, inv_t, chunk)
    from dscale_runtime.kernels.triton_sampling import chunk_exp_sums_triton

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return chunk_exp_sums_triton(logits, shift, inv_t, chunk).double()
