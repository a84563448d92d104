"""The confidence features (DESIGN 3.1): the portable reference and its router to one fused Triton pass.

`confidence_features_ref` is the definition of the per-position confidence columns (top1, gaps to ranks
2..num_ranks, top-1 log-probability, entropy) and the oracle of the Triton kernel (`triton_features.py`,
imported lazily). `confidence_features` takes the path from its caller (`backend=`: the runner passes its
KernelChoice's `features` through `dvl.features.acceptance_features`): 'triton' runs the kernel (on CPU
tensors that is Triton's interpreter, for tests), 'ref' the reference, and 'auto' (direct calls) applies the
auto rule to the logits. Vocabularies smaller than the rank count (toy models) always take the reference,
which pads the missing ranks. No call reads the environment (DSCALE_FEATURES is read once, by
`KernelChoice.resolve`).
"""

from __future__ import annotations

import torch

from dscale_runtime.kernels.choice import auto_backend, check_backend


def confidence_features_ref(draft_logits: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """draft_logits [N, P, V] -> [N, P * (num_ranks + 2)] (per position: top1, gaps, top1 logprob, entropy):
    the portable definition, and the oracle of the fused kernel."""
    logits = draft_logits.float()
    top = logits.topk(min(num_ranks, logits.shape[-1]), dim=-1).values  # [N, P, R]
    if top.shape[-1] < num_ranks:
        # NOTE: only toy vocabularies are smaller than the rank count; missing ranks repeat the last logit.
        top = torch.cat([top, top[..., -1:].expand(*top.shape[:-1], num_ranks - top.shape[-1])], dim=-1)
    top1 = top[..., :1]
    log_z = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, P, 1]
    log_p = logits - log_z
    entropy = -(log_p.exp() * log_p).sum(-1, keepdim=True)
    per_position = torch.cat([top1, top1 - top[..., 1:], top1 - log_z, entropy], dim=-1)  # [N, P, R + 2]
    return per_position.flatten(1)


def features_backend(draft_logits: torch.Tensor, num_ranks: int, backend: str = "auto") -> str:
    """'ref' or 'triton' for this call: `backend` as given ('auto': the auto rule on the logits), except that
    a vocabulary smaller than the rank count takes the reference."""
    check_backend(backend, "DSCALE_FEATURES")
    if draft_logits.shape[-1] < num_ranks:
        return "ref"
    return auto_backend(draft_logits.device, draft_logits.dtype) if backend == "auto" else backend


def confidence_features(
    draft_logits: torch.Tensor,  # [N, P, V] drafter logits at draft positions 1..P
    num_ranks: int,
    backend: str = "auto",
) -> torch.Tensor:  # [N, P * (num_ranks + 2)] float32, per position: top1, gaps, top1 logprob, entropy
    """The confidence features through the path `backend` names (same contract as the reference)."""
    if features_backend(draft_logits, num_ranks, backend) == "ref":
        return confidence_features_ref(draft_logits, num_ranks)
    from dscale_runtime.kernels.triton_features import confidence_features_triton

    num_requests, num_positions, vocab = draft_logits.shape
    rows = draft_logits.reshape(num_requests * num_positions, vocab)  # [N * P, V], a view when contiguous
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return confidence_features_triton(rows, num_ranks).view(num_requests, num_positions * (num_ranks + 2))
