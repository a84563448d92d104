"""DFlash block-diffusion drafter (z-lab `DFlashDraftModel` parameter names) over its own paged cache.

Context: the outputs of the target layers `target_layer_ids`, concatenated, go through
`hidden_norm(fc(.))`; every draft layer projects that fused context with its own k/v projections
(k_norm, RoPE at the context positions) into the drafter cache, which holds context K/V only.
Block: the anchor plus W - 1 mask tokens, embedded with the target's embedding; the block attends
bidirectionally to [context + block]; draft logits at positions 1..W-1 come from the target's LM head.
The block's own K/V are written to the cache slots after the context and are never read again: the next
context injection overwrites them (the committed drafter length bounds what attention may read). The kernel
paths are the `KernelChoice` the drafter is built with; `use_kernels` changes them afterwards.
Under tensor parallelism (`tp`, `parallel.py`) the drafter is one rank's shard like its target: the draft
layers hold the rank's heads (its cache the rank's K/V), `fc` and the norms are whole on every rank (the
context features are the target's whole residual stream), and the draft logits are gathered to the whole
vocabulary from the target's sharded LM head, so the drafts are the same on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.kernels import KernelChoice, fused
from dscale_runtime.models.config import DFlashConfig
from dscale_runtime.models.layers import PORTABLE, KVLayerCache, Qwen3DecoderLayer, RMSNorm, rope_cos_sin, use_kernels
from dscale_runtime.models.parallel import TensorParallel, active
from dscale_runtime.models.qwen3 import check_shard
from dscale_runtime.sampling import greedy_tokens


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig, kernels: KernelChoice = PORTABLE, tp: TensorParallel | None = None) -> None:
        super().__init__()
        check_shard(cfg.layers, tp)
        self.config = cfg
        self.kernels = kernels  # the kernel path of every layer (see use_kernels)
        self.tp = active(tp)  # None: the whole drafter on this process
        d = cfg.layers.hidden_size
        self.layers = nn.ModuleList(self._layer(cfg, kernels, self.tp) for _ in range(cfg.layers.num_hidden_layers))
        self.fc = nn.Linear(len(cfg.target_layer_ids) * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.layers.rms_norm_eps, kernels)
        self.norm = RMSNorm(d, cfg.layers.rms_norm_eps, kernels)
        self._head: tuple[torch.Tensor, torch.Tensor] | None = None  # (target LM head, its copy in our dtype)
        # every layer's context K/V projection [L x 2 Hkv D, d] (and bias) and k_norm weights [L, D]: fuse_projections
        self._context_kv: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None

    def _layer(self, cfg: DFlashConfig, kernels: KernelChoice, tp: TensorParallel | None) -> Qwen3DecoderLayer:
        """One draft layer (DFlash 2 wraps its sub-layers in convolutions: `dflash2.DFlash2DecoderLayer`)."""
        return Qwen3DecoderLayer(cfg.layers, kernels, tp)

    def use_kernels(self, kernels: KernelChoice) -> "DFlashDraftModel":
        """Run every draft layer through `kernels` from now on (see Qwen3ForCausalLM.use_kernels)."""
        use_kernels(self, kernels)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse_projections(self) -> "DFlashDraftModel":
        """Fused q/k/v and gate/up weights in every draft layer (see Qwen3DecoderLayer.fuse_projections), and the
        context injection's K/V projection of every layer as one weight (`_context_kv`): one GEMM and one store
        launch per injection instead of one of each per layer. That weight is a copy of the layers' k and v rows
        (2 x Hkv x D x d per layer: 84 MB over a Qwen3-8B drafter's five layers in bf16)."""
        for layer in self.layers:
            layer.fuse_projections()
        attns = [layer.self_attn for layer in self.layers]
        if attns and self._context_kv is None:
            q_rows = attns[0].num_heads * attns[0].head_dim
            weight = torch.cat([a.qkv[0][q_rows:] for a in attns])
            bias = torch.cat([a.qkv[1][q_rows:] for a in attns]) if attns[0].qkv[1] is not None else None
            self._context_kv = (weight, bias, torch.stack([a.k_norm.weight.detach() for a in attns]))
        return self

    def fuse_context(self, target_features: torch.Tensor) -> torch.Tensor:
        """Concatenated target layer outputs [T, L_t * d] (any float dtype) -> fused context [T, d]."""
        return self.hidden_norm(self.fc(target_features.to(self.dtype)))

    def inject_context(
        self,
        target_features: torch.Tensor,  # [T, L_t * d]
        positions: torch.Tensor,  # [T]
        slots: torch.Tensor,  # [T]
        caches: list[KVLayerCache],
        rope: dict | None = None,  # a forward's `AttentionMetadata.rope` over these `positions`: its tables reused
    ) -> None:
        """Write the context K/V of T verified rows into every draft layer's cache."""
        context = self.fuse_context(target_features)
        attn = self.layers[0].self_attn
        key = (attn.head_dim, attn.rope_theta, context.dtype)
        cos_sin = (rope or {}).get(key) or rope_cos_sin(positions, attn.head_dim, attn.rope_theta, context.dtype)
        if self._context_kv is not None:  # NOTE: every layer's K/V in one GEMM, stored in one launch (Triton path)
            weight, bias, k_norms = self._context_kv
            fused.kv_norm_rope_store_layers(F.linear(context, weight, bias), attn.num_kv_heads, k_norms, *cos_sin,
                                            attn.k_norm.eps, slots, [c.k for c in caches], [c.v for c in caches],
                                            backend=self.kernels.fused)
            return
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.write_kv(context, positions, slots, cache, cos_sin)

    def forward(
        self,
        block_embeds: torch.Tensor,  # [N * W, d], target embedding of anchor + mask tokens
        meta: AttentionMetadata,  # causal=False, kv_lens = context + W
        caches: list[KVLayerCache],
        drafts_of: int = 0,  # W > 1: only the draft slots' states (1..W-1 of each block) -> [N * (W-1), d]
    ) -> torch.Tensor:  # [N * W, d], final-normed hidden states of every block slot
        x, delta = block_embeds.to(self.dtype), None
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        for layer, cache in zip(self.layers, caches):
            x, delta = layer(x, meta, cache, delta)
        # NOTE: `drafts_of`: the final norm writes the draft rows contiguous, the LM head's input without a copy
        return fused.add_rms_norm(x, delta, self.norm.weight, self.norm.eps, backend=self.kernels.fused,
                                  skip=drafts_of)[1]

    def head_weight(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The target's LM head [V, d] (this rank's rows under tensor parallelism) in the drafter's dtype: the
        tensor itself when the dtypes agree, else a copy made on the first call and kept (the engine makes it at
        start-up, before any graph capture)."""
        if lm_head.dtype == self.dtype:
            return lm_head
        if self._head is None or self._head[0] is not lm_head or self._head[1].dtype != self.dtype:
            self._head = (lm_head, lm_head.detach().to(self.dtype))
        return self._head[1]

    def head_logits(self, hidden: torch.Tensor, target: nn.Module) -> torch.Tensor:
        """Hidden states [N, P, d] -> raw draft logits [N, P, V] through the target's LM head, in our dtype."""
        n, p = hidden.shape[:2]
        # NOTE: the LM head takes contiguous 2-D rows: on a strided 3-D slice F.linear falls back to a batched
        # matmul that reads the whole vocab-sized weight once per request (0.3 ms each at Qwen3-8B).
        logits = F.linear(hidden.reshape(n * p, -1), self.head_weight(target.lm_head.weight))
        return target.vocab_logits(logits).view(n, p, -1)  # NOTE: gathered under tensor parallelism

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The checkpoint's `output_multiplier` and `final_logit_softcapping` (z-lab's `compute_logits`); the
        tensor itself when it sets neither. Monotone: the argmax and the top-k are those of the raw logits."""
        cfg = self.config
        if cfg.output_multiplier != 1.0:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits

    def propose(
        self,
        block: torch.Tensor,  # [N, W] anchor + mask token ids; slots 1..W-1 are overwritten with the drafts
        target: nn.Module,  # the Qwen3ForCausalLM whose embedding and LM head the drafter shares
        meta: AttentionMetadata,
        caches: list[KVLayerCache],
        float_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One parallel forward over N blocks -> (draft logits [N, W-1, V], fp32 or, when not `float_logits`,
        in the drafter's dtype; hidden states [N, W-1, d] at the draft positions); writes the greedy drafts
        into `block[:, 1:]` (the argmax is the same either way: the upcast is exact)."""
        n, w = block.shape
        hidden = self(target.embed(block.view(-1)), meta, caches, drafts_of=w).view(n, w - 1, -1)
        logits = self.scale_logits(self.head_logits(hidden, target))
        if float_logits:
            logits = logits.float()
        greedy_tokens(logits, self.kernels.fused, out=block[:, 1:])  # NOTE: written into the block by one launch
        return logits, hidden
