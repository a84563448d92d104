"""Checkpoint loading: `config.json` + `model.safetensors`, or shards listed in `model.safetensors.index.json`,
and the target folder's tokenizer and end-of-sequence ids.

Every error names the file and the key to fix: missing or unexpected weights, shape mismatches, unknown
architectures, a drafter whose width or `fc` input does not match the target. The loaded models are built
with their kernel paths (`KernelChoice`): the one passed in, else the one resolved once for the device and
dtype (DSCALE_ATTENTION / DSCALE_ATTENTION_TILE / DSCALE_FUSED / DSCALE_FEATURES, else the auto rule).
Given a `TensorParallel` (`tp`), a loader builds this rank's shard and reads only its slices of the split
weights from the files (safetensors' lazy slices), the whole checkpoint's shapes checked all the same.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from dscale_runtime.kernels import KernelChoice
from dscale_runtime.models.config import (
    CheckpointError,
    DFlashConfig,
    Qwen3Config,
    load_drafter_config,
    load_target_config,
)
from dscale_runtime.models.dflash import DFlashDraftModel
from dscale_runtime.models.dflash2 import DFlash2DraftModel
from dscale_runtime.models.parallel import VOCAB_PARALLEL, TensorParallel, active, shard_dim
from dscale_runtime.models.qwen3 import Qwen3ForCausalLM

Reader = Callable[[str, object, Path], torch.Tensor]  # (key, open safetensors file, its path) -> tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({exc})") from exc
        owners = {}
        for key, shard in weight_map.items():
            path = folder / shard
            if not path.is_file():
                raise CheckpointError(f"{index}: key '{key}' points to missing shard {path}")
            owners[key] = path
        return owners
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{folder}: no {SINGLE_FILE} and no {INDEX_FILE}")
    with safe_open(single, framework="pt") as f:
        return {key: single for key in f.keys()}


def read_tensors(owners: dict[str, Path], reader: Reader | None = None) -> dict[str, tuple[torch.Tensor, Path]]:
    """Every tensor of `owners`, read whole, or by `reader` (e.g. one rank's slice: `rank_slices`)."""
    by_file: dict[Path, list[str]] = {}
    for key, path in owners.items():
        by_file.setdefault(path, []).append(key)
    tensors = {}
    for path, keys in by_file.items():
        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            for key in keys:
                if key not in present:
                    raise CheckpointError(f"{path}: key '{key}' is listed in the index but not in the file")
                tensors[key] = (f.get_tensor(key) if reader is None else reader(key, f, path), path)
    return tensors


def rank_slices(model: nn.Module, tp: TensorParallel, vocab_size: int, prefix: str = "") -> Reader:
    """A `read_tensors` reader of this rank's part of every weight that `model` (a shard, see `parallel.py`)
    holds split: the file's lazy slice of it, the last vocabulary part padded with zero rows; other tensors
    whole. The checkpoint's own shape is checked against the whole model's first (`prefix`: a key prefix the
    loader strips)."""
    local = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}

    def read(key: str, file, path: Path) -> torch.Tensor:
        name = key[len(prefix):] if prefix and key.startswith(prefix) else key
        dim = shard_dim(name)
        if name not in local or dim is None:
            return file.get_tensor(key)
        lazy = file.get_slice(key)
        shape = tuple(lazy.get_shape())
        want = list(local[name])
        want[dim] = vocab_size if name.split(".")[-2] in VOCAB_PARALLEL else want[dim] * tp.size
        if shape != tuple(want):
            raise CheckpointError(f"{path}: weight '{key}' has shape {shape}, the config implies {tuple(want)}")
        start, stop, part = tp.split(shape[dim])
        tensor = lazy[start:stop] if dim == 0 else lazy[:, start:stop]
        if stop - start < part:  # NOTE: padding rows of the vocabulary: never looked up, their logits cut off
            tensor = torch.cat([tensor, tensor.new_zeros((part - (stop - start),) + tuple(tensor.shape[1:]))])
        return tensor

    return read


def shard_config(cfg, tp: TensorParallel | None, folder: Path):
    """`cfg.shard(tp.size)`, or `cfg` itself without tensor parallelism; a size that does not divide the model
    is a `CheckpointError` naming the checkpoint's config file."""
    if tp is None:
        return cfg
    try:
        return cfg.shard(tp.size)
    except ValueError as exc:
        raise CheckpointError(f"{folder / 'config.json'}: {exc}") from exc


def _assign(
    model: nn.Module,
    tensors: dict[str, tuple[torch.Tensor, Path]],
    folder: Path,
    dtype: torch.dtype,
    device: torch.device,
    optional: set[str] = frozenset(),
) -> None:
    expected = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(k for k in expected if k not in tensors and k not in optional)
    if missing:
        raise CheckpointError(f"{folder}: missing weight(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(k for k in tensors if k not in expected)
    if unexpected:
        key = unexpected[0]
        raise CheckpointError(f"{tensors[key][1]}: unexpected weight '{key}' ({len(unexpected)} unexpected in all)")
    state = {}
    for key, param in expected.items():
        if key not in tensors:
            continue
        tensor, path = tensors[key]
        if tuple(tensor.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{path}: weight '{key}' has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}"
            )
        state[key] = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
    for key, value in state.items():
        owner_name, _, leaf = key.rpartition(".")
        setattr(model.get_submodule(owner_name), leaf, value)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"dtype '{dtype}' is not one of {sorted(table)}")
    return table[dtype]


def load_target(folder: str | Path, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
                kernels: KernelChoice | None = None, tp: TensorParallel | None = None) -> Qwen3ForCausalLM:
    """The Qwen3 target in `folder` on `device` in `dtype`, running the kernel paths `kernels` (None:
    `KernelChoice.resolve(device, dtype)`); this rank's shard of it under the tensor parallelism `tp`."""
    folder = Path(folder)
    dtype = resolve_dtype(dtype)
    kernels = kernels if kernels is not None else KernelChoice.resolve(device, dtype)
    tp = active(tp)
    cfg = shard_config(load_target_config(folder), tp, folder)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, kernels, tp)
    tensors = read_tensors(weight_files(folder), None if tp is None else rank_slices(model, tp, cfg.vocab_size))
    if cfg.tie_word_embeddings:
        # NOTE: tied checkpoints normally omit lm_head.weight; a copy, if present, is ignored.
        tensors.pop("lm_head.weight", None)
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    _assign(model, tensors, folder, dtype, torch.device(device), optional)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def check_pair(target: Qwen3Config, drafter: DFlashConfig, folder: Path) -> None:
    path = folder / "config.json"
    if drafter.layers.hidden_size != target.hidden_size:
        raise CheckpointError(
            f"{path}: 'hidden_size' {drafter.layers.hidden_size} does not match the target's {target.hidden_size}"
        )
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise CheckpointError(
            f"{path}: 'target_layer_ids' {bad} out of range for a target of {target.num_hidden_layers} layers"
        )
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise CheckpointError(
            f"{path}: 'mask_token_id' {drafter.mask_token_id} is outside the target vocabulary ({target.vocab_size})"
        )
    if drafter.dflash2 is not None and drafter.layers.vocab_size != target.vocab_size:
        raise CheckpointError(f"{path}: 'vocab_size' {drafter.layers.vocab_size} differs from the target's "
                              f"{target.vocab_size} (the DFlash 2 selector's codebooks index target tokens)")


CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
DFLASH2_MARKS = (".attention_conv.", ".mlp_conv.", "candidate_selector.")


def _drafter_keys(tensors: dict[str, tuple[torch.Tensor, Path]], cfg: DFlashConfig, folder: Path) -> dict:
    """z-lab's stored names -> ours: the selector's codebooks are bare tensors (`...codebook`); a `.weight`
    suffix (an `nn.Embedding` export) is read as the same tensor, never both. DFlash 2 tensors beside a DFlash 1
    config are refused here with the reason (they would be left unread)."""
    for name in CODEBOOKS:
        if name + ".weight" in tensors:
            if name in tensors:
                raise CheckpointError(f"{tensors[name][1]}: both '{name}' and '{name}.weight' are stored; keep one")
            tensors[name] = tensors.pop(name + ".weight")
    if cfg.dflash2 is None:
        extra = sorted(k for k in tensors if any(m in "." + k for m in DFLASH2_MARKS))
        if extra:
            raise CheckpointError(f"{tensors[extra[0]][1]}: DFlash 2 weights ('{extra[0]}', {len(extra)} in all) "
                                  f"beside {folder / 'config.json'} declaring 'DFlashDraftModel'; a DFlash 2 "
                                  "checkpoint declares architectures ['DFlash2DraftModel'] and its dflash_config")
    return tensors


def load_drafter(
    folder: str | Path, target: Qwen3Config, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
    kernels: KernelChoice | None = None, tp: TensorParallel | None = None,
) -> DFlashDraftModel:
    """The DFlash drafter in `folder` (DFlash 1 or DFlash 2, by its config's `architectures`: a `DFlashDraftModel`
    or a `DFlash2DraftModel`), checked against its `target`'s config, on `device` in `dtype`, running
    the kernel paths `kernels` (None: `KernelChoice.resolve(device, dtype)`); this rank's shard of it under the
    tensor parallelism `tp` (the target's; `target` may be its whole config or its shard's)."""
    folder = Path(folder)
    dtype = resolve_dtype(dtype)
    kernels = kernels if kernels is not None else KernelChoice.resolve(device, dtype)
    tp = active(tp)
    cfg = shard_config(load_drafter_config(folder), tp, folder)
    check_pair(target, cfg, folder)
    with torch.device("meta"):
        model = (DFlash2DraftModel if cfg.dflash2 is not None else DFlashDraftModel)(cfg, kernels, tp)
    raw = read_tensors(weight_files(folder), None if tp is None else rank_slices(model, tp, target.vocab_size, "model."))
    # NOTE: some exports prefix every key with `model.`; strip it once, consistently.
    tensors = _drafter_keys({(k[len("model."):] if k.startswith("model.") else k): v for k, v in raw.items()},
                            cfg, folder)
    fc = tensors.get("fc.weight")
    want = len(cfg.target_layer_ids) * target.hidden_size
    if fc is not None and fc[0].ndim == 2 and fc[0].shape[1] != want:
        raise CheckpointError(
            f"{fc[1]}: weight 'fc.weight' takes {fc[0].shape[1]} inputs, but {len(cfg.target_layer_ids)} target "
            f"layers x hidden {target.hidden_size} = {want}"
        )
    _assign(model, tensors, folder, dtype, torch.device(device))
    return model.eval()


def load_tokenizer(folder: Path):
    """The target folder's tokenizer (transformers AutoTokenizer), or None when the folder has none."""
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def read_eos_ids(folder: Path, tokenizer) -> set[int]:
    """End-of-sequence ids from config.json, generation_config.json and the tokenizer."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids.update(eos if isinstance(eos, list) else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    """sha256 of a file, read in chunks (model weights can be many GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
