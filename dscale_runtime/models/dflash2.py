"""DFlash 2 drafter (z-lab `DFlash2DraftModel` parameter names): DFlash 1 plus block convolutions and a selector.

Every draft layer wraps its attention and its MLP in a grouped dynamic causal convolution over the block's own
slots (`GroupedDynamicCausalConv`): `prepare` convolves the sub-layer's normed input, `finish` its output, both
with taps base_kernel[side, o, c] + d[t, o, c // group], the dynamic part projected from the normed input. A
slot sees only the slots before it in its own block: blocks are packed request after request, exactly W rows
each, and the convolution runs over [N, W, d] with zeros before slot 0, so no tap reaches another request's
block or the injected context (whose K/V the attention reads as in DFlash 1).

The candidate selector (`CandidateSelector.walk`) turns the draft logits into a path: the top `selector_top_k`
logits of each draft slot (`candidate_topk`; at Qwen3's vocabulary one torch.topk costs about six times DFlash 1's
argmax on the H200) are rescored left to right, score(c) = logit(c) + <pred[prev] * proj(h_j), succ[c]>
with prev the token chosen at the slot before (the anchor at slot 1). Greedy rows take the best score; rows
that sample their drafts draw from q = softmax(score / T) over the candidates at a keyed uniform (`sampling.py`,
purpose DRAFT), temperature only, as z-lab's reference. Every transition's score and choice is computed at once
(a slot's predecessor is one of the K candidates before it), so the walk composes W - 1 maps of K indices on all
requests at once (`follow_choices`: a doubling scan, capturable), never a host loop per request (`walk_ref`: slot
by slot). Its scores are what DScale's
confidence features read here (`acceptance_features` over [N, W - 1, K]: top score, its gaps, log q(best) at
T = 1, entropy: feature versions `dscale-features-dflash2-v1`, `-v2` with the sampling columns and `-v3` with the
drafts' agreement columns as well), and its q is the sparse draft policy of the
sampled-drafts verification (`CandidatePolicy`). The convolutions run in one Triton launch each when the
KernelChoice's `fused` is 'triton' (`kernels/triton_conv.py`; `block_convolve_ref` is the definition).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.kernels import KernelChoice, fused
from dscale_runtime.kernels.fused import fused_backend
from dscale_runtime.models.config import DFlash2Config, DFlashConfig, Qwen3Config
from dscale_runtime.models.dflash import DFlashDraftModel
from dscale_runtime.models.layers import PORTABLE, KVLayerCache, Qwen3DecoderLayer
from dscale_runtime.models.parallel import TensorParallel
from dscale_runtime.sampling import sample_inverse_cdf_ref
from dscale_runtime.verify import CandidatePolicy


def block_convolve_ref(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [N, W, d], dynamic taps [N, W, taps, G], base taps [taps, d] -> [N, W, d]:
    out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group_size]) * x[t - o, c], with x[t - o] = 0 for o > t.
    The portable definition, and the oracle of the Triton kernel (`kernels/triton_conv.py`)."""
    n, w, d = x.shape
    taps, groups = base.shape[0], d // group_size
    # window k of slot t holds x[t - (taps - 1 - k)]: tap o = taps - 1 - k, so the taps are read reversed
    windows = F.pad(x, (0, 0, taps - 1, 0)).unfold(1, taps, 1).view(n, w, groups, group_size, taps)
    weights = base.flip(0).t().reshape(groups, group_size, taps).to(x.dtype) \
        + dynamic.flip(2).transpose(2, 3)[:, :, :, None, :].to(x.dtype)  # [N, W, G, gs, taps]
    return (weights * windows).sum(-1).view(n, w, d)


def block_convolve(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int,
                   backend: str = "ref") -> torch.Tensor:
    """Block rows x [N * W, d] convolved (`block_convolve_ref`'s contract, dynamic [N, W, taps, G]) through the
    path `backend` names (a KernelChoice's `fused`: 'triton' one launch, `kernels/triton_conv.py`)."""
    if fused_backend(x, backend, dynamic, base) == "triton" and x.is_contiguous():
        from dscale_runtime.kernels.triton_conv import block_convolve_triton

        return block_convolve_triton(x, dynamic, base.contiguous(), group_size)
    n, w = dynamic.shape[:2]
    return block_convolve_ref(x.view(n, w, -1), dynamic, base, group_size).view_as(x)


class GroupedDynamicCausalConv(nn.Module):
    """The pair of convolutions around one sub-layer (z-lab names: `base_kernel` [2, taps, d] for the prepare and
    finish sides, `kernel_projection` d -> 2 x taps x groups dynamic taps, projected from the sub-layer's input)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, kernels: KernelChoice = PORTABLE) -> None:
        super().__init__()
        self.kernels = kernels  # `fused` picks the convolution's path (see use_kernels)
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block rows x [N * W, d] -> (x convolved [N * W, d], the finish side's dynamic taps [N, W, taps, G])."""
        dynamic = self.kernel_projection(x).view(-1, width, 2, self.kernel_size, self.groups)
        out = block_convolve(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size, self.kernels.fused)
        return out, dynamic[:, :, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The sub-layer's output y [N * W, d] convolved with the taps `prepare` returned."""
        return block_convolve(y, dynamic, self.base_kernel[1], self.group_size, self.kernels.fused)


class DFlash2DecoderLayer(Qwen3DecoderLayer):
    """A Qwen3 draft layer with `attention_conv` around attention and `mlp_conv` around the MLP."""

    def __init__(self, cfg: Qwen3Config, conv: DFlash2Config, kernels: KernelChoice = PORTABLE,
                 tp: TensorParallel | None = None) -> None:
        super().__init__(cfg, kernels, tp)
        self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, conv.conv_kernel_size, conv.conv_group_size,
                                                       kernels)
        self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, conv.conv_kernel_size, conv.conv_group_size, kernels)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVLayerCache,
                delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Block rows [N * W, d] (meta.max_q = W rows per request): `Qwen3DecoderLayer.forward`'s contract."""
        width, backend = meta.max_q, self.kernels.fused
        assert x.shape[0] % width == 0, "DFlash 2 blocks are packed exactly W rows per request"
        norm = self.input_layernorm
        x, h = (x, norm(x)) if delta is None else fused.add_rms_norm(x, delta, norm.weight, norm.eps, backend=backend)
        h, later = self.attention_conv.prepare(h, width)
        out = self.attention_conv.finish(self.self_attn(h, meta, cache), later)
        norm = self.post_attention_layernorm
        x, h = fused.add_rms_norm(x, out, norm.weight, norm.eps, backend=backend)
        h, later = self.mlp_conv.prepare(h, width)
        return x, self.mlp_conv.finish(self.mlp(h), later)


class CandidateSelector(nn.Module):
    """Rescoring of each draft slot's top-k candidates (z-lab names; the codebooks are bare tensors [V, rank])."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def walk(
        self,
        hidden: torch.Tensor,  # [N, P, d] drafter hidden states at the draft slots
        unary: torch.Tensor,  # [N, P, K] fp32 the candidates' (scaled) logits
        candidates: torch.Tensor,  # [N, P, K] their token ids
        anchors: torch.Tensor,  # [N] the block's slot-0 tokens
        temperature: torch.Tensor | None = None,  # [N] the rows' temperatures (sampling rows only)
        draw: torch.Tensor | None = None,  # [N] bool: rows that draw their path from q (None: all greedy)
        uniforms: torch.Tensor | None = None,  # [N, P] float64 keyed U[0, 1), one per slot
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """-> (path [N, P] token ids, scores [N, P, K] fp32 along it, q [N, P, K] float64 when `draw` is given).

        The predecessor of slot j is one of slot j-1's K candidates (the anchor at slot 0), so every score the
        walk can need is computed at once, [N, P, K_prev, K], and so is every choice (argmax, or the keyed draw
        from q): the walk itself is then P gathers, each slot's choice read at its predecessor's index."""
        n, p, k = candidates.shape
        # NOTE: 2-D rows: on a strided 3-D slice F.linear would read the weight once per request
        proj = self.hidden_projection(hidden.reshape(n * p, -1)).view(n, p, -1)  # [N, P, r]
        prev = torch.cat([anchors[:, None, None].expand(n, 1, k), candidates[:, :-1]], dim=1)  # [N, P, K_prev]
        left = self.predecessor_codebook[prev] * proj[:, :, None, :]  # [N, P, K_prev, r]
        right = self.successor_codebook[candidates]  # [N, P, K, r]
        scores = unary[:, :, None, :] + (left @ right.transpose(-1, -2)).float()  # [N, P, K_prev, K]
        choice = scores.argmax(dim=-1)  # [N, P, K_prev]
        q = None
        if draw is not None:
            q = torch.softmax(scores.double() / temperature.double().clamp_min(1e-6)[:, None, None, None], dim=-1)
            u = uniforms[:, :, None].expand(n, p, k).reshape(-1)
            drawn = sample_inverse_cdf_ref(q.reshape(-1, k), u).view(n, p, k)
            choice = torch.where(draw[:, None, None], drawn, choice)
        chosen = follow_choices(choice)  # [N, P] candidate index of each slot's choice
        before = torch.cat([torch.zeros_like(chosen[:, :1]), chosen[:, :-1]], dim=1)[..., None, None]  # [N, P, 1, 1]
        path = candidates.gather(2, chosen[..., None])[..., 0]
        along = lambda t: t.gather(2, before.expand(n, p, 1, k))[:, :, 0]  # noqa: E731 - rows at the predecessors
        return path, along(scores), along(q) if q is not None else None


def follow_choices(choice: torch.Tensor) -> torch.Tensor:
    """choice [N, P, K]: slot j's choice for each of slot j-1's K candidates (slot 0: row 0, the anchor's) -> the
    chosen index of every slot [N, P], walking from the anchor. Each slot is a map f_j of K indices; the walk reads
    (f_j o ... o f_0)(0), so an inclusive scan of the compositions (doubling: ceil(log2 P) gathers over all slots
    at once, capturable) replaces P sequential gathers."""
    maps, step = choice, 1
    while step < maps.shape[1]:
        # NOTE: out of place: slot j composes its map with slot j - step's map of the previous level
        maps = torch.cat([maps[:, :step], maps[:, step:].gather(2, maps[:, :-step])], dim=1)
        step *= 2
    return maps[:, :, 0]


CHUNKED_TOPK_VOCAB = 32768  # vocabularies from this size take `candidate_topk` over slices (`candidate_chunks`)


def candidate_chunks(vocab: int, k: int) -> int:
    """Slices for `candidate_topk` over a vocabulary: the divisor of `vocab` whose slice width is nearest
    sqrt(vocab / k) (Qwen3's 151,936 = 1,187 slices of 128), or 1 (one torch.topk) below CHUNKED_TOPK_VOCAB or
    without a divisor of at least k slices."""
    if vocab < CHUNKED_TOPK_VOCAB:
        return 1
    best = min((w for w in range(1, vocab // k + 1) if vocab % w == 0), key=lambda w: abs(w - (vocab / k) ** 0.5))
    return vocab // best


def candidate_topk(logits: torch.Tensor, k: int, chunks: int = 1,
                   backend: str = "ref") -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits of each row [R, V] and their token ids, largest first (`torch.topk`'s result). With
    `chunks` > 1 (k <= chunks, dividing V): the maximum of each of `chunks` equal slices (one pass over the row;
    one Triton launch when `backend`, a KernelChoice's `fused`, resolves to 'triton': `triton_conv.slice_max_triton`,
    the same maxima), the k slices with the largest maxima, then the top k of those k slices alone. Exact: a token
    among the row's k largest lies in a slice whose maximum is among the k largest maxima (else k slices would
    each hold a larger token); among tied values either keeps any of them, as torch.topk does."""
    if chunks <= 1:
        return logits.topk(k, dim=-1)
    r, vocab = logits.shape
    assert vocab % chunks == 0 and k <= chunks, "chunks must divide the vocabulary into at least k slices"
    width = vocab // chunks
    slices = logits.view(r, chunks, width)
    if fused_backend(logits, backend) == "triton" and logits.stride(1) == 1:
        from dscale_runtime.kernels import triton_conv

        maxima = triton_conv.slice_max_triton(logits, chunks)
        if triton_conv.TOPK_KERNEL == "triton" and k & (k - 1) == 0:  # NOTE: the rest in one launch (opt-in)
            return triton_conv.slices_topk_triton(logits, maxima, k)
    else:
        maxima = slices.amax(dim=-1)
    _, best = maxima.topk(k, dim=-1)  # [R, k] the slices with the k largest maxima
    picked = slices[torch.arange(r, device=logits.device)[:, None], best]  # [R, k, width] the k slices
    values, at = picked.view(r, k * width).topk(k, dim=-1)
    return values, best.gather(1, at // width) * width + at % width


def walk_ref(selector: CandidateSelector, hidden, unary, candidates, anchors, temperature=None, draw=None,
             uniforms=None):
    """`CandidateSelector.walk` slot by slot, the score of each slot computed from the choice before it: the
    portable definition and the oracle of the all-transitions form."""
    proj = selector.hidden_projection(hidden)
    prev, path, scores, qs = anchors, [], [], []
    for j in range(hidden.shape[1]):
        left = selector.predecessor_codebook[prev] * proj[:, j]  # [N, r]
        score = unary[:, j] + (selector.successor_codebook[candidates[:, j]] @ left[:, :, None])[..., 0].float()
        choice = score.argmax(dim=-1)
        if draw is not None:
            q = torch.softmax(score.double() / temperature.double().clamp_min(1e-6)[:, None], dim=-1)
            choice = torch.where(draw, sample_inverse_cdf_ref(q, uniforms[:, j]), choice)
            qs.append(q)
        prev = candidates[:, j].gather(1, choice[:, None])[:, 0]
        path.append(prev)
        scores.append(score)
    return torch.stack(path, 1), torch.stack(scores, 1), torch.stack(qs, 1) if qs else None


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 1's context injection and block forward through DFlash 2 layers, and the selector's `propose_walk`."""

    def __init__(self, cfg: DFlashConfig, kernels: KernelChoice = PORTABLE, tp: TensorParallel | None = None) -> None:
        assert cfg.dflash2 is not None, "a DFlash 2 drafter needs its config's dflash2 fields"
        super().__init__(cfg, kernels, tp)
        sel = cfg.dflash2
        self.candidate_selector = CandidateSelector(cfg.layers.vocab_size, cfg.layers.hidden_size, sel.selector_rank,
                                                    sel.selector_top_k)
        # NOTE: the candidates' top-k over vocabulary slices (exact; one torch.topk below CHUNKED_TOPK_VOCAB): at
        # Qwen3's vocabulary 1,187 slices, captured == eager, and the DFlash 2 step 2-4% faster on the H200
        # (docs/benchmarks.md, 2026-12-03; the slice maxima in Triton since 2026-12-04, ~6x torch's amax);
        # `benchmarks/dflash2_step.py --candidate-chunks` times a setting beside
        self.candidate_chunks = candidate_chunks(cfg.layers.vocab_size, sel.selector_top_k)

    def _layer(self, cfg: DFlashConfig, kernels: KernelChoice, tp: TensorParallel | None) -> Qwen3DecoderLayer:
        return DFlash2DecoderLayer(cfg.layers, cfg.dflash2, kernels, tp)

    def propose_walk(
        self,
        block: torch.Tensor,  # [N, W] anchor + mask token ids; slots 1..W-1 are overwritten with the path
        target: nn.Module,
        meta: AttentionMetadata,
        caches: list[KVLayerCache],
        temperature: torch.Tensor | None = None,  # [N] (with `draw`)
        draw: torch.Tensor | None = None,  # [N] bool: rows that sample their drafts (None: every row greedy)
        uniforms: torch.Tensor | None = None,  # [N, W-1] float64 keyed draws of the slots (with `draw`)
    ) -> tuple[torch.Tensor, torch.Tensor, CandidatePolicy | None]:
        """One parallel forward over N blocks and the selector's walk -> (scores [N, W-1, K] fp32, hidden states
        [N, W-1, d], the sparse draft policy q over the candidates, rows n * (W-1) + j - 1, when `draw`)."""
        n, w = block.shape
        hidden = self(target.embed(block.view(-1)), meta, caches, drafts_of=w).view(n, w - 1, -1)
        logits = self.head_logits(hidden, target)  # [N, W-1, V]
        unary, candidates = candidate_topk(logits.view(n * (w - 1), -1), self.candidate_selector.top_k,
                                           self.candidate_chunks, self.kernels.fused)
        unary, candidates = unary.view(n, w - 1, -1), candidates.view(n, w - 1, -1)
        # NOTE: the logit scaling is monotone (output_multiplier > 0, tanh cap): applied to the top-k only
        unary = self.scale_logits(unary.float())
        path, scores, q = self.candidate_selector.walk(hidden, unary, candidates, block[:, 0], temperature, draw,
                                                       uniforms)
        block[:, 1:] = path
        k = candidates.shape[-1]
        policy = None if q is None else CandidatePolicy(q.reshape(n * (w - 1), k), candidates.reshape(n * (w - 1), k))
        return scores, hidden, policy
