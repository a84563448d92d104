"""Qwen3 target model (`Qwen3ForCausalLM` parameter names) over the paged KV cache.

One forward takes T packed rows of N ragged requests (prefill chunks, verification blocks, decode rows),
writes their K/V, and returns the logits of the rows asked for plus the outputs of the target layers the
DFlash drafter fuses into its context (`hidden_states[layer_id + 1]` in transformers' numbering). The
kernel paths are the `KernelChoice` the model is built with (the loader resolves one for the device and
dtype); `use_kernels` changes them afterwards.
"""

from __future__ import annotations

import torch
from torch import nn

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.kernels import KernelChoice
from dscale_runtime.models.config import Qwen3Config
from dscale_runtime.models.layers import PORTABLE, KVLayerCache, Qwen3DecoderLayer, RMSNorm, use_kernels


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernels: KernelChoice = PORTABLE) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, kernels) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernels: KernelChoice = PORTABLE) -> None:
        super().__init__()
        self.config = cfg
        self.kernels = kernels  # the kernel path of every layer (see use_kernels)
        self.model = Qwen3Model(cfg, kernels)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_kernels(self, kernels: KernelChoice) -> "Qwen3ForCausalLM":
        """Run every layer through `kernels` from now on (e.g. the benchmarks' forced 128-row attention tile:
        `model.use_kernels(dataclasses.replace(model.kernels, attention_tile=128))`). Do it outside a CUDA
        graph capture: graphs captured before keep the paths they captured."""
        use_kernels(self, kernels)
        return self

    def fuse_projections(self) -> "Qwen3ForCausalLM":
        """Fused q/k/v and gate/up weights in every layer (fewer, larger GEMMs; names and memory unchanged).
        Call it after the model is on its device and dtype: the fused weights are plain tensors, not buffers."""
        for layer in self.model.layers:
            layer.fuse_projections()
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [R, d] -> fp32 logits [R, vocab]."""
        return self.lm_head(hidden).float()

    def forward(
        self,
        token_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        caches: list[KVLayerCache],
        logits_rows: torch.Tensor | None = None,  # [R] row indices whose logits are wanted (None: all)
        capture_layers: tuple[int, ...] = (),
        float_logits: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits [R, vocab] fp32, or in the model's dtype when not `float_logits` (an exact upcast
        away: enough for greedy argmax), features [T, len(capture_layers) * d] or None)."""
        x, delta = self.embed(token_ids), None
        captured: dict[int, torch.Tensor] = {}
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            x, delta = layer(x, meta, caches[i], delta)
            if i in capture_layers or i == last:
                x, delta = x + delta, None
            if i in capture_layers:
                # NOTE: transformers' hidden_states[last + 1] is the final-normed state; match it.
                captured[i] = self.model.norm(x) if i == last else x
        features = torch.cat([captured[i] for i in capture_layers], dim=-1) if capture_layers else None
        if logits_rows is not None:
            x = x[logits_rows]
        hidden = self.model.norm(x)
        return (self.compute_logits(hidden) if float_logits else self.lm_head(hidden)), features
