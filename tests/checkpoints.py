"""Tiny checkpoints written by the tests in the real on-disk layouts (Qwen3 target, z-lab DFlash drafter)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dscale_runtime.models.config import load_drafter_config
from dscale_runtime.models.dflash import DFlashDraftModel


def write_target(folder: Path, *, vocab: int = 96, hidden: int = 32, layers: int = 4, heads: int = 4,
                 kv_heads: int = 2, head_dim: int = 8, tied: bool = False, shard_size: str | None = None,
                 seed: int = 0, tokenizer: bool = False) -> Path:
    """A random Qwen3 target saved by transformers' `save_pretrained` (sharded when shard_size is set)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      tie_word_embeddings=tied, rope_theta=10000.0, max_position_embeddings=512,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    # NOTE: default init gives near-uniform logits; a larger scale makes greedy choices well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0) if not tied else model.model.embed_tokens.weight.mul_(3.0)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    if tokenizer:
        write_byte_tokenizer(folder, vocab)
    return Path(folder)


def write_byte_tokenizer(folder: Path, vocab: int) -> None:
    """A character-level tokenizer over printable ASCII, so string prompts and stop strings work."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    chars = [chr(c) for c in range(32, 32 + vocab - 2)]
    table = {ch: i for i, ch in enumerate(chars)}
    table["<eos>"] = vocab - 2
    table["<mask>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(table, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>", "<mask>"])
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "mask_token": "<mask>"}))


def drafter_config_dict(*, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                        vocab: int = 96, block_size: int = 16, mask_token_id: int = 95,
                        target_layer_ids=(0, 2), num_target_layers: int = 4, nested: bool = True) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "block_size": block_size,
        "num_target_layers": num_target_layers,
        "torch_dtype": "float32",
    }
    extra = {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)}
    if nested:
        cfg["dflash_config"] = extra
    else:
        cfg.update(extra)
    return cfg


def write_drafter(folder: Path, *, prefix: str = "", seed: int = 1, **cfg_kwargs) -> Path:
    """A random DFlash drafter in the z-lab layout: config.json + model.safetensors (no embedding/LM head)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(drafter_config_dict(**cfg_kwargs)))
    torch.manual_seed(seed)
    model = DFlashDraftModel(load_drafter_config(folder))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def write_drafter2(folder: Path, *, seed: int = 1, conv_kernel_size: int = 3, conv_group_size: int = 8,
                   selector_rank: int = 8, selector_top_k: int = 16, dflash_extra: dict | None = None,
                   **cfg_kwargs) -> Path:
    """A random DFlash 2 drafter in z-lab's layout (`DFlash2DraftModel`: its dflash_config fields, the block
    convolutions' `base_kernel` / `kernel_projection`, the selector's bare codebook tensors). The codebooks are
    scaled so that the selector's rescoring often overturns the top logit."""
    from dscale_runtime.models.dflash2 import DFlash2DraftModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = drafter_config_dict(**cfg_kwargs)
    cfg["architectures"] = ["DFlash2DraftModel"]
    fields = {"conv_kernel_size": conv_kernel_size, "conv_group_size": conv_group_size,
              "selector_rank": selector_rank, "selector_top_k": selector_top_k, **(dflash_extra or {})}
    cfg.setdefault("dflash_config", cfg).update(fields)
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    model = DFlash2DraftModel(load_drafter_config(folder))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("base_kernel"):
                p.copy_(0.3 * torch.randn_like(p))
                p[:, 0] += 1.0  # near the identity at the slot itself, real weight on the slots before it
            elif name.endswith("codebook"):
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    return folder
