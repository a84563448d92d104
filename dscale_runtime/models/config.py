"""Model configurations parsed from Hugging Face `config.json` files (Qwen3 target, DFlash 1 and 2 drafters).

Only the fields the runtime needs are kept; anything the runtime cannot honour (sliding windows, RoPE
scaling other than the default) is refused with an error naming the file and the key. Under tensor
parallelism a model holds `shard(tp)` of its config: the heads and MLP width of one rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint folder, config file or weight file that the runtime cannot load as given."""


@dataclass(frozen=True)
class Qwen3Config:
    """Shape and numerics of a Qwen3 decoder stack (target model or DFlash draft layers)."""

    hidden_size: int
    """Model width d."""
    intermediate_size: int
    """MLP inner width."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA groups = num_attention_heads / num_key_value_heads)."""
    head_dim: int
    """Per-head width."""
    vocab_size: int
    """Rows of the embedding and the LM head."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1_000_000.0
    """RoPE base."""
    tie_word_embeddings: bool = False
    """LM head shares the embedding matrix (no `lm_head.weight` in the checkpoint)."""
    attention_bias: bool = False
    """q/k/v/o projections carry a bias."""
    max_position_embeddings: int = 40960
    """Longest context the model was configured for."""
    eos_token_id: tuple[int, ...] = ()
    """End-of-sequence token ids from the config (may be empty)."""
    torch_dtype: str = "bfloat16"
    """Dtype the checkpoint was saved in."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (`shard`); above 1, `num_attention_heads`, `num_key_value_heads` and
    `intermediate_size` are one rank's share (what its layers and its KV cache hold), every other field is
    the whole model's (`vocab_size` included)."""

    def shard(self, tensor_parallel_size: int) -> "Qwen3Config":
        """One rank's share of this (unsharded) model over `tensor_parallel_size` ranks: query and key/value
        heads and the MLP's inner width divided evenly (a `ValueError` names the field that does not divide)."""
        if self.tensor_parallel_size != 1:
            raise ValueError(f"this config is already one of {self.tensor_parallel_size} shards")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if tensor_parallel_size == 1:
            return self
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(self, name)
            if value % tensor_parallel_size:
                raise ValueError(f"'{name}' = {value} is not divisible by tensor_parallel_size="
                                 f"{tensor_parallel_size}; choose a tensor-parallel size that divides it")
        return replace(self, num_attention_heads=self.num_attention_heads // tensor_parallel_size,
                       num_key_value_heads=self.num_key_value_heads // tensor_parallel_size,
                       intermediate_size=self.intermediate_size // tensor_parallel_size,
                       tensor_parallel_size=tensor_parallel_size)


@dataclass(frozen=True)
class DFlash2Config:
    """What a DFlash 2 drafter (z-lab `DFlash2DraftModel`) adds to DFlash 1: block convolutions and a selector."""

    conv_kernel_size: int
    """Taps of each grouped dynamic causal convolution (over the block's own slots)."""
    conv_group_size: int
    """Channels per group of those convolutions (one dynamic tap weight per group)."""
    selector_rank: int
    """Rank of the candidate selector's bilinear term (codebooks [vocab, rank])."""
    selector_top_k: int
    """Candidates per draft slot (the drafter's top logits, rescored left to right)."""


@dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter: Qwen3 draft layers plus the block and context-fusion settings."""

    layers: Qwen3Config
    """Shape of the draft decoder layers (no embedding or LM head of their own)."""
    block_size: int
    """Slots per block W: anchor + (W - 1) mask positions."""
    mask_token_id: int
    """Token id that fills the W - 1 draft positions of a block."""
    target_layer_ids: tuple[int, ...]
    """Target layers whose outputs are concatenated into the context features."""
    num_target_layers: int
    """Number of layers of the target the drafter was trained against."""
    architecture: str = "DFlashDraftModel"
    """`DFlashDraftModel` (DFlash 1) or `DFlash2DraftModel` (then `dflash2` holds its fields)."""
    dflash2: DFlash2Config | None = None
    """The DFlash 2 fields, None for a DFlash 1 drafter."""
    input_embedding_scale: float = 1.0
    """Factor on the block's target embeddings (z-lab's `input_embedding_scale`)."""
    output_multiplier: float = 1.0
    """Factor on the draft logits (z-lab's `compute_logits`)."""
    final_logit_softcapping: float | None = None
    """c of the draft logits' tanh soft cap c * tanh(l / c) (None or <= 0: none)."""

    def shard(self, tensor_parallel_size: int) -> "DFlashConfig":
        """One rank's share of the drafter: its draft layers' `Qwen3Config.shard`."""
        return replace(self, layers=self.layers.shard(tensor_parallel_size))


def read_config_json(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json in the checkpoint folder {folder}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def _require(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg:
        raise CheckpointError(f"{path}: missing required key '{key}'")
    return cfg[key]


def _rope_theta(cfg: dict[str, Any], path: Path) -> float:
    # NOTE: transformers >= 5 writes `rope_parameters`; older files write `rope_theta` + `rope_scaling`.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for key, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        kind = block.get("rope_type", block.get("type", "default"))
        if kind not in ("default", None):
            raise CheckpointError(f"{path}: '{key}' of type '{kind}' is not supported (only default RoPE)")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def parse_qwen3_layers(cfg: dict[str, Any], path: Path) -> Qwen3Config:
    if cfg.get("use_sliding_window"):
        raise CheckpointError(f"{path}: 'use_sliding_window' is true; sliding-window attention is not supported")
    hidden = int(_require(cfg, "hidden_size", path))
    heads = int(_require(cfg, "num_attention_heads", path))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise CheckpointError(f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    return Qwen3Config(
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", path)),
        num_hidden_layers=int(_require(cfg, "num_hidden_layers", path)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg.get("vocab_size", 0)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(cfg, path),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
        eos_token_id=eos_ids,
        torch_dtype=str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))),
    )


def load_target_config(folder: str | Path) -> Qwen3Config:
    folder = Path(folder)
    cfg = read_config_json(folder)
    path = folder / "config.json"
    archs = cfg.get("architectures") or []
    if archs and "Qwen3ForCausalLM" not in archs:
        raise CheckpointError(f"{path}: unknown target architecture {archs}; expected ['Qwen3ForCausalLM']")
    if not archs and cfg.get("model_type") != "qwen3":
        raise CheckpointError(f"{path}: neither 'architectures' nor model_type 'qwen3' identifies a Qwen3 target")
    layers = parse_qwen3_layers(cfg, path)
    if layers.vocab_size <= 0:
        raise CheckpointError(f"{path}: missing required key 'vocab_size'")
    return layers


DRAFTER_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def load_drafter_config(folder: str | Path) -> DFlashConfig:
    """A DFlash 1 or DFlash 2 drafter's config, by its `architectures` (z-lab's `dflash` 0.1.0 layout)."""
    folder = Path(folder)
    cfg = read_config_json(folder)
    path = folder / "config.json"
    archs = cfg.get("architectures") or []
    known = [a for a in archs if a in DRAFTER_ARCHITECTURES]
    if len(known) != 1:
        raise CheckpointError(f"{path}: unknown drafter architecture {archs}; expected ['DFlashDraftModel'] "
                              "(DFlash 1) or ['DFlash2DraftModel'] (DFlash 2)")
    architecture = known[0]
    # NOTE: recent z-lab files nest these under `dflash_config`; older ones put them at the top level.
    nested = cfg.get("dflash_config") or {}

    def pick(key: str, default: Any = ...) -> Any:
        if key in nested:
            return nested[key]
        if key in cfg:
            return cfg[key]
        if default is not ...:
            return default
        raise CheckpointError(f"{path}: missing '{key}' (looked in 'dflash_config' and at the top level)")

    # NOTE: z-lab's drafter makes a layer causal (and windowed) only by `is_causal` or a sliding layer type.
    if cfg.get("is_causal") or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
        raise CheckpointError(f"{path}: 'is_causal' / 'layer_types' ask for causal or sliding draft layers; "
                              "only bidirectional full-attention DFlash blocks are supported")
    layers = parse_qwen3_layers(cfg, path)
    target_ids = tuple(int(i) for i in pick("target_layer_ids"))
    if not target_ids:
        raise CheckpointError(f"{path}: 'target_layer_ids' is empty")
    block_size = int(pick("block_size", 16))
    if block_size < 2:
        raise CheckpointError(f"{path}: 'block_size' must be >= 2, got {block_size}")
    multiplier = float(pick("output_multiplier", 1.0))
    if multiplier <= 0:
        raise CheckpointError(f"{path}: 'output_multiplier' must be > 0, got {multiplier}")
    softcap = pick("final_logit_softcapping", None)
    softcap = float(softcap) if softcap is not None and float(softcap) > 0 else None
    dflash2 = None
    if architecture == "DFlash2DraftModel":
        fields = {name: int(pick(name)) for name in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                      "selector_top_k")}
        for name, value in fields.items():
            if value < 1:
                raise CheckpointError(f"{path}: '{name}' must be >= 1, got {value}")
        if layers.hidden_size % fields["conv_group_size"]:
            raise CheckpointError(f"{path}: 'conv_group_size' {fields['conv_group_size']} does not divide "
                                  f"'hidden_size' {layers.hidden_size}")
        if layers.vocab_size and fields["selector_top_k"] > layers.vocab_size:
            raise CheckpointError(f"{path}: 'selector_top_k' {fields['selector_top_k']} exceeds 'vocab_size' "
                                  f"{layers.vocab_size}")
        dflash2 = DFlash2Config(**fields)
    return DFlashConfig(
        layers=layers,
        block_size=block_size,
        mask_token_id=int(pick("mask_token_id")),
        target_layer_ids=target_ids,
        num_target_layers=int(pick("num_target_layers", max(target_ids) + 1)),
        architecture=architecture,
        dflash2=dflash2,
        input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
        output_multiplier=multiplier,
        final_logit_softcapping=softcap,
    )
