"""The confidence-feature router: one fused Triton pass over the drafter logits, or the portable reference.

`confidence_features` computes DESIGN 3.1's per-position confidence columns (top1, gaps to ranks 2..num_ranks,
top-1 log-probability, entropy) through Triton (`triton_features.py`, imported lazily) on CUDA tensors when
triton is importable, and through the reference in `dscale_runtime.dvl.features` otherwise, or when the
vocabulary is smaller than the rank count (toy vocabularies: the reference pads the missing ranks). CPU runs
are therefore exactly the reference. Force a path with `backend=` or the environment variable
`DSCALE_FEATURES=auto|ref|triton` (`triton` on CPU tensors runs Triton's interpreter, for tests).
NOTE: `dscale_runtime.dvl.features` is imported inside functions only: it may import this router itself.
"""

from __future__ import annotations


import torch

from dscale_runtime.kernels import TRITON_DTYPES, requested_backend, triton_available


def features_backend(draft_logits: torch.Tensor, num_ranks: int, backend: str | None = None) -> str:
    """'ref' or 'triton' for this call: the argument, else DSCALE_FEATURES, else auto."""
    choice = requested_backend("DSCALE_FEATURES", backend)
    if draft_logits.shape[-1] < num_ranks:
        return "ref"
    if choice == "auto":
        usable = draft_logits.is_cuda and draft_logits.dtype in TRITON_DTYPES and triton_available()
        return "triton" if usable else "ref"
    return choice


def reference():
    """The portable reference (`dscale_runtime.dvl.features`): the oracle of the Triton path."""
    from dscale_runtime.dvl import features

    # NOTE: `dvl.features.confidence_features` routes through this module; the portable one is `_ref`.
    return features.confidence_features_ref


def confidence_features(
    draft_logits: torch.Tensor,  # [N, P, V] drafter logits at draft positions 1..P
    num_ranks: int,
    backend: str | None = None,
) -> torch.Tensor:  # [N, P * (num_ranks + 2)] float32, per position: top1, gaps, top1 logprob, entropy
    """The confidence features through the chosen path (same contract as the reference)."""
    if features_backend(draft_logits, num_ranks, backend) == "ref":
        return reference()(draft_logits, num_ranks)
    from dscale_runtime.kernels.triton_features import confidence_features_triton

    num_requests, num_positions, vocab = draft_logits.shape
    rows = draft_logits.reshape(num_requests * num_positions, vocab)  # [N * P, V], a view when contiguous
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return confidence_features_triton(rows, num_ranks).view(num_requests, num_positions * (num_ranks + 2))
