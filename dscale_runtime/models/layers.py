"""Qwen3 building blocks with Hugging Face parameter names: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

The target and the DFlash drafter share these. Attention reads and writes the paged KV cache through
`AttentionMetadata`; `write_kv` is split out because the drafter also writes K/V for context rows that
never become queries (the fused target features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.kernels import paged_attention
from dscale_runtime.models.config import Qwen3Config


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: normalise in fp32, cast back, then scale: the order transformers' Qwen3RMSNorm uses.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [T, head_dim] for absolute positions [T] (computed in fp32, like transformers)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim))
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
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def write_kv(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache: KVLayerCache,
                 cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Project rows x [T, d] to K/V (k_norm, RoPE at `positions`) and store them at `slots` [T]."""
        cos, sin = cos_sin or rope_cos_sin(positions, self.head_dim, self.rope_theta, x.dtype)
        k = self.k_norm(self.k_proj(x).view(-1, self.num_kv_heads, self.head_dim))
        cache.k[slots] = apply_rope(k, cos, sin).to(cache.k.dtype)
        cache.v[slots] = self.v_proj(x).view(-1, self.num_kv_heads, self.head_dim).to(cache.v.dtype)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVLayerCache) -> torch.Tensor:
        key = (self.head_dim, self.rope_theta, x.dtype)
        if key not in meta.rope:  # NOTE: computed once per forward, shared by every layer of that shape
            meta.rope[key] = rope_cos_sin(meta.positions, self.head_dim, self.rope_theta, x.dtype)
        cos, sin = meta.rope[key]
        q = self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim))
        q = apply_rope(q, cos, sin)
        self.write_kv(x, meta.positions, meta.slot_mapping, cache, (cos, sin))
        out = paged_attention(q, cache.k, cache.v, meta, cache.page_size, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1).to(x.dtype))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, cache: KVLayerCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))
