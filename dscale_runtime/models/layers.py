"""Qwen3 building blocks with Hugging Face parameter names: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

The target and the DFlash drafter share these. Attention reads and writes the paged KV cache through
`AttentionMetadata`; `write_kv` is split out because the drafter also writes K/V for context rows that
never become queries (the fused target features). Every layer holds the `KernelChoice` it was built with
(`kernels`) and passes its fields to the kernel routers on each call; `use_kernels` changes it afterwards.
Under tensor parallelism (`tp`, see `parallel.py`) a layer is built from its rank's `Qwen3Config.shard`:
attention holds its rank's heads (and writes only those to the KV cache), the MLP its rank's columns, and
o_proj / down_proj sum their partial products over the group; without `tp` nothing of that runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.kernels import KernelChoice, fused, paged_attention
from dscale_runtime.models.config import Qwen3Config
from dscale_runtime.models.parallel import TensorParallel, active

PORTABLE = KernelChoice()  # what a layer built without a choice runs: the references everywhere


def use_kernels(module: nn.Module, kernels: KernelChoice) -> None:
    """Give `module` and every layer inside it the kernel choice `kernels` (the models' `use_kernels`)."""
    if not isinstance(kernels, KernelChoice):
        raise TypeError(f"use_kernels takes a KernelChoice (dscale_runtime.kernels), got {kernels!r}")
    for m in module.modules():
        if isinstance(getattr(m, "kernels", None), KernelChoice):
            m.kernels = kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: KernelChoice = PORTABLE) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in fp32, cast back, then scale: the order transformers' Qwen3RMSNorm uses
        # (`kernels.fused.rms_norm_ref`; the Triton path on CUDA rounds at the same points).
        return fused.rms_norm(x, self.weight, self.eps, backend=self.kernels.fused)


_INV_FREQ: dict[tuple, torch.Tensor] = {}


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2] fp32 (transformers' formula), computed once per (head_dim, theta,
    device) on that device and kept: every step and prefill builds its tables from it with five launches fewer. One
    computed while a CUDA graph is being captured is used, not kept (capture records kernels without running them)."""
    key = (head_dim, float(theta), device)
    inv_freq = _INV_FREQ.get(key)
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
        if not (inv_freq.is_cuda and torch.cuda.is_current_stream_capturing()):
            _INV_FREQ[key] = inv_freq
    return inv_freq


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [T, head_dim] for absolute positions [T] (computed in fp32, like transformers)."""
    inv_freq = rope_inv_freq(head_dim, theta, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class KVLayerCache:
    """One layer's view of a paged cache: flat slot tensors plus the page size."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, page_size: int) -> None:
        self.k = k  # [num_slots, KVH, D]
        self.v = v  # [num_slots, KVH, D]
        self.page_size = page_size


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernels: KernelChoice = PORTABLE, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp = active(tp)  # NOTE: cfg is this rank's shard: num_heads / num_kv_heads are its own heads
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, kernels)
        self.qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # fused (weight, bias), see fuse_projections

    def fuse_projections(self) -> None:
        """One [q + k + v, d] weight (one GEMM instead of three); q/k/v_proj become views into it, so the
        Hugging Face parameter names and the memory stay as they were."""
        if self.qkv is not None:
            return
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([p.weight.detach() for p in projs])
        bias = torch.cat([p.bias.detach() for p in projs]) if self.q_proj.bias is not None else None
        start = 0
        for p in projs:
            rows = p.weight.shape[0]
            p.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
            start += rows
        self.qkv = (weight, bias)

    def _kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows x [T, d] -> (k, v) [T, KVH, D] before k_norm and RoPE."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        if self.qkv is None:
            return self.k_proj(x).view(shape), self.v_proj(x).view(shape)
        q_rows = self.num_heads * self.head_dim
        weight, bias = self.qkv
        kv = F.linear(x, weight[q_rows:], None if bias is None else bias[q_rows:])
        k, v = kv.split(self.num_kv_heads * self.head_dim, dim=-1)
        return k.view(shape), v.view(shape)

    def write_kv(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVLayerCache,
                 cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Project rows x [T, d] to K/V (k_norm, RoPE at `positions`) and store them at `slots` [T]."""
        cos, sin = cos_sin or rope_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        if self.qkv is not None:  # NOTE: the k and v rows of the fused weight, normed, roped and stored in one pass
            weight, bias = self.qkv
            q_rows = self.num_heads * self.head_dim
            kv = F.linear(x, weight[q_rows:], None if bias is None else bias[q_rows:])
            fused.qkv_norm_rope_store(kv, 0, self.num_kv_heads, None, self.k_norm.weight, cos, sin, self.k_norm.eps,
                                      slots, cache.k, cache.v, backend=self.kernels.fused)
            return
        k, v = self._kv(x)
        self._store(k, v, cos, sin, slots, cache)

    def _store(self, k, v, cos, sin, slots, cache: KVLayerCache) -> None:
        k = fused.qk_norm_rope(k, self.k_norm.weight, cos, sin, self.k_norm.eps, backend=self.kernels.fused)
        cache.k[slots] = k.to(cache.k.dtype)
        cache.v[slots] = v.to(cache.v.dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVLayerCache) -> torch.Tensor:
        key = (self.head_dim, self.rope_theta, x.dtype)
        if key not in meta.rope:  # NOTE: computed once per forward, shared by every layer of that shape
            meta.rope[key] = rope_cos_sin(meta.positions, self.head_dim, self.rope_theta, x.dtype)
        cos, sin = meta.rope[key]
        if self.qkv is None:
            q = fused.qk_norm_rope(self.q_proj(x).view(-1, self.num_heads, self.head_dim), self.q_norm.weight, cos,
                                   sin, self.q_norm.eps, backend=self.kernels.fused)
            k, v = self._kv(x)
            self._store(k, v, cos, sin, meta.slot_mapping, cache)
        else:  # NOTE: q and k normed and roped, k and v stored at their slots: one launch on the Triton path
            q = fused.qkv_norm_rope_store(F.linear(x, *self.qkv), self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                          self.k_norm.weight, cos, sin, self.q_norm.eps, meta.slot_mapping, cache.k,
                                          cache.v, backend=self.kernels.fused)
        out = paged_attention(q, cache.k, cache.v, meta, cache.page_size, self.scale,
                              backend=self.kernels.attention, tile_rows=self.kernels.attention_tile)
        out = out.reshape(x.shape[0], -1).to(x.dtype)
        return self.o_proj(out) if self.tp is None else self.tp.row_parallel(out, self.o_proj)


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernels: KernelChoice = PORTABLE, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.tp = active(tp)  # NOTE: cfg.intermediate_size is this rank's share of the MLP columns
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: torch.Tensor | None = None  # fused [2 I, d] weight, see fuse_projections

    def fuse_projections(self) -> None:
        """One [gate + up, d] weight; gate/up_proj become views into it (names and memory unchanged)."""
        if self.gate_up is not None:
            return
        weight = torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()])
        rows = self.gate_proj.weight.shape[0]
        self.gate_proj.weight = nn.Parameter(weight[:rows], requires_grad=False)
        self.up_proj.weight = nn.Parameter(weight[rows:], requires_grad=False)
        self.gate_up = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = fused.silu_mul(F.linear(x, self.gate_up), backend=self.kernels.fused)
        return self.down_proj(h) if self.tp is None else self.tp.row_parallel(h, self.down_proj)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config, kernels: KernelChoice = PORTABLE, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.kernels = kernels
        self.self_attn = Qwen3Attention(cfg, kernels, tp)
        self.mlp = Qwen3MLP(cfg, kernels, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)

    def fuse_projections(self) -> None:
        self.self_attn.fuse_projections()
        self.mlp.fuse_projections()

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVLayerCache,
                delta: torch.Tensor | None = None,
                into: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream x [T, d] (plus the previous layer's pending output `delta`, added here in the
        same pass as this layer's input norm) -> (residual stream, this layer's pending MLP output): the
        layer's output is their sum, left to the next layer (or the caller) to add. `into` [T, d] (any row
        stride): where that sum, the previous layer's output, is written (a captured layer's features)."""
        norm, backend = self.input_layernorm, self.kernels.fused
        if delta is None:
            assert into is None, "the first layer's input is the embedding: nothing to capture"
            x, h = x, norm(x)
        else:
            x, h = fused.add_rms_norm(x, delta, norm.weight, norm.eps, backend=backend,
                                      out=None if into is None else (into, None))
        norm = self.post_attention_layernorm
        x, h = fused.add_rms_norm(x, self.self_attn(h, meta, cache), norm.weight, norm.eps, backend=backend)
        return x, self.mlp(h)
