"""The sampler's device work: chunk sums of exp((l - shift) / T) (its one pass over the vocabulary) and the
counter-based uniforms every draw inverts, each a reference (the definition) with a Triton router.

`chunk_exp_sums_ref` is the definition (fp64 sums of the fp32 weights of each chunk of `chunk` logits, the last
chunk shorter) and the oracle of the Triton kernel (`triton_sampling.py`, imported lazily), which reads the
logits once in their own dtype and writes only the [R, C] sums. `chunk_exp_sums` takes the path from its caller
(`backend=`: the runner passes the target's KernelChoice `fused`); 'auto' applies the auto rule to the logits.

`keyed_uniforms_ref` hashes (seed, position, purpose) with a 32-bit integer finaliser (xorshift-multiply,
lowbias32 constants) in about a hundred int64 tensor ops; the Triton kernel computes the same bits in one launch
(a captured sampled step otherwise spends hundreds of tiny launches on its four sets of draws).
"""

from __future__ import annotations

import torch

from dscale_runtime.kernels.choice import auto_backend, check_backend


_MASK32 = 0xFFFFFFFF
_PURPOSE_KEY = 0x9E3779B1  # a purpose p enters the hash as (p * _PURPOSE_KEY) mod 2^32
_SECOND_KEY = 0x68E31DA4  # the second hash of the chain: mix(h ^ _SECOND_KEY)


def purpose_key(purpose: int) -> int:
    """The 32-bit key a draw's purpose enters the hash with (the kernels take it as an argument)."""
    return purpose * _PURPOSE_KEY & _MASK32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow (c split into 16-bit halves)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xorshift-multiply, lowbias32 constants) on int64 tensors in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def keyed_uniforms_ref(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor,
                       purpose: int) -> torch.Tensor:
    """seeds and positions (broadcast, int64) -> float64 in [0, 1): h = mix(lo ^ mix(hi ^ mix(pos ^ mix(key)))),
    h2 = mix(h ^ _SECOND_KEY), u = ((h >> 11) * 2^32 + h2) / 2^53 (53 random bits)."""
    pos = positions & _MASK32
    key = torch.full_like(pos, purpose_key(purpose))
    h = _mix32(seed_lo ^ _mix32(seed_hi ^ _mix32(pos ^ _mix32(key))))
    h2 = _mix32(h ^ _SECOND_KEY)
    return (((h >> 11) << 32) | h2).double() / float(1 << 53)


def keyed_uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, positions: torch.Tensor, purpose: int,
                   backend: str = "ref") -> torch.Tensor:
    """Uniform draws keyed by counter, float64 in [0, 1), a pure function of (seed, position, purpose):
    `keyed_uniforms_ref` (the definition) through the path `backend` names, bit for bit. The Triton path takes
    seeds [R, 1, ...] (or [R]) broadcast along positions [R, ...]; other layouts take the reference."""
    check_backend(backend, "DSCALE_FUSED")
    if backend == "auto":
        backend = auto_backend(positions.device, torch.float32)
    rows = positions.shape[0] if positions.dim() else 1
    if (backend == "ref" or positions.dim() == 0 or seed_lo.numel() != rows or seed_hi.numel() != rows
            or seed_lo.dim() != positions.dim() or seed_hi.dim() != positions.dim()):
        return keyed_uniforms_ref(seed_lo, seed_hi, positions, purpose)
    from dscale_runtime.kernels.triton_sampling import keyed_uniforms_triton

    return keyed_uniforms_triton(seed_lo.reshape(-1), seed_hi.reshape(-1), positions.contiguous(),
                                 purpose_key(purpose), _SECOND_KEY)


def chunk_exp_sums_ref(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, chunk: int,
                       floor: torch.Tensor | None = None) -> torch.Tensor:
    """logits [R, V], shift [R], inv_t [R] -> [R, ceil(V / chunk)] float64: sum of exp(s), s = (l - shift) * inv_t,
    over the entries with s >= floor [R] (top-k / top-p, `kernels.filters`; None: every entry)."""
    r, vocab = logits.shape
    s = (logits.float() - shift.float()[:, None]) * inv_t.float()[:, None]
    weights = torch.exp(s) if floor is None else torch.where(s >= floor[:, None], torch.exp(s), 0.0)
    pad = -vocab % chunk
    if pad:
        weights = torch.cat([weights, weights.new_zeros(r, pad)], dim=1)
    return weights.view(r, -1, chunk).sum(-1, dtype=torch.float64)


def chunk_exp_sums(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, chunk: int,
                   backend: str = "auto", floor: torch.Tensor | None = None) -> torch.Tensor:
    """The chunk sums through the path `backend` names -> [R, C] float64 (the Triton path sums in fp32)."""
    check_backend(backend, "DSCALE_FUSED")
    if backend == "auto":
        backend = auto_backend(logits.device, logits.dtype)
    if backend == "ref":
        return chunk_exp_sums_ref(logits, shift, inv_t, chunk, floor)
    from dscale_runtime.kernels.triton_sampling import chunk_exp_sums_triton

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return chunk_exp_sums_triton(logits, shift, inv_t, chunk, floor).double()
