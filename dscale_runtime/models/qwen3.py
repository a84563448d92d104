"""Qwen3 target model (`Qwen3ForCausalLM` parameter names) over the paged KV cache.

One forward takes T packed rows of N ragged requests (prefill chunks, verification blocks, decode rows),
writes their K/V, and returns the logits of the rows asked for plus the outputs of the target layers the
DFlash drafter fuses into its context (`hidden_states[layer_id + 1]` in transformers' numbering). The
kernel paths are the `KernelChoice` the model is built with (the loader resolves one for the device and
dtype); `use_kernels` changes them afterwards.

Under tensor parallelism (`tp`, `parallel.py`) the model is one rank's shard: `config` is its
`Qwen3Config.shard` (its own heads, which size its KV cache), the embedding and the LM head hold its rows of
the vocabulary, and every forward still returns the whole vocabulary's logits (gathered), on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.kernels import KernelChoice, fused
from dscale_runtime.models.config import Qwen3Config
from dscale_runtime.models.layers import PORTABLE, KVLayerCache, Qwen3DecoderLayer, RMSNorm, use_kernels
from dscale_runtime.models.parallel import TensorParallel, active


def check_shard(cfg: Qwen3Config, tp: TensorParallel | None) -> None:
    """A model is built from the config of its own shard: `cfg.shard(tp.size)` under tensor parallelism."""
    size = tp.size if active(tp) is not None else 1
    if cfg.tensor_parallel_size != size:
        raise ValueError(f"the config is one of {cfg.tensor_parallel_size} shard(s), the tensor-parallel group "
                         f"has {size} rank(s): build the model from config.shard({size})")


class Qwen3Model(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernels: KernelChoice = PORTABLE, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = active(tp)
        vocab_rows = cfg.vocab_size if tp is None else tp.split(cfg.vocab_size)[2]
        self.embed_tokens = nn.Embedding(vocab_rows, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, kernels, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernels: KernelChoice = PORTABLE, tp: TensorParallel | None = None) -> None:
        super().__init__()
        check_shard(cfg, tp)
        self.config = cfg
        self.kernels = kernels  # the kernel path of every layer (see use_kernels)
        self.tp = active(tp)  # None: the whole model on this process
        self.model = Qwen3Model(cfg, kernels, self.tp)
        self.lm_head = nn.Linear(cfg.hidden_size, self.model.embed_tokens.num_embeddings, bias=False)
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
        if self.tp is None:
            return self.model.embed_tokens(token_ids)
        return self.tp.embed(token_ids, self.model.embed_tokens.weight)

    def vocab_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """LM-head outputs of this process [R, rows] -> the whole vocabulary's [R, vocab] (gathered under
        tensor parallelism; the tensor itself otherwise)."""
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.config.vocab_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [R, d] -> fp32 logits [R, vocab]."""
        return self.vocab_logits(self.lm_head(hidden)).float()

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
        away: enough for greedy argmax), features [T, len(capture_layers) * d] or None).

        A captured layer's output is the residual sum that the next layer's input norm computes anyway: that
        fused add + norm writes it straight into its columns of the features (`Qwen3DecoderLayer.forward`'s
        `into`), so capturing costs no add and no concatenation (four launches fewer in a DFlash verification
        over three layers); the last layer's sum and the final norm are one fused pass too."""
        layers = self.model.layers
        last = len(layers) - 1
        if any(not 0 <= i <= last for i in capture_layers):
            raise ValueError(f"capture_layers {capture_layers} must be layer indices of this {last + 1}-layer model "
                             "(the drafter's target_layer_ids)")
        x, delta = self.embed(token_ids), None
        d = x.shape[-1]
        features = x.new_empty(x.shape[0], len(capture_layers) * d) if capture_layers else None
        column: dict[int, torch.Tensor] = {}  # a captured layer -> its features columns [T, d] (strided)
        again: list[tuple[int, int]] = []  # (columns, layer) of a layer named twice: copied from its first
        for j, i in enumerate(capture_layers):
            if i in column:
                again.append((j, i))
            else:
                column[i] = features[:, j * d:(j + 1) * d]
        for i, layer in enumerate(layers):
            x, delta = layer(x, meta, caches[i], delta, into=column.get(i - 1))
        norm = self.model.norm
        if logits_rows is not None and last not in column:
            hidden = norm((x + delta)[logits_rows])
        else:
            # NOTE: transformers' hidden_states[last + 1] is the final-normed state; a captured last layer is that
            hidden = fused.add_rms_norm(x, delta, norm.weight, norm.eps, backend=self.kernels.fused,
                                        out=(None, column[last]) if last in column else None)[1]
            if logits_rows is not None:
                hidden = hidden[logits_rows]
        for j, i in again:
            features[:, j * d:(j + 1) * d].copy_(column[i])
        return (self.compute_logits(hidden) if float_logits else self.vocab_logits(self.lm_head(hidden))), features
