"""Checkpoint loader (DESIGN 2): every refusal names the file and the key to fix; the accepted layout variants
(nested or top-level `dflash_config`, `model.`-prefixed drafter keys, tied targets without `lm_head`) load;
the loaded models hold the kernel choice passed in or resolved once for their device and dtype."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from checkpoints import drafter_config_dict, write_drafter, write_target
from dscale_runtime.kernels import KernelChoice
from dscale_runtime.models.config import CheckpointError, load_drafter_config, load_target_config
from dscale_runtime.models.loader import load_drafter, load_target

INDEX = "model.safetensors.index.json"


# --------------------------------------------------------------------------------------------------
# helpers


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def _shard_of(folder: Path, key: str) -> Path:
    return folder / json.loads((folder / INDEX).read_text())["weight_map"][key]


def _raises(fn, *substrings: str) -> str:
    with pytest.raises(CheckpointError) as info:
        fn()
    msg = str(info.value)
    for s in substrings:
        assert s in msg, f"{s!r} not in {msg!r}"
    return msg


@pytest.fixture(scope="module")
def target_cfg(tmp_path_factory):
    return load_target_config(write_target(tmp_path_factory.mktemp("cfg_target")))


@pytest.fixture
def target(tmp_path):
    return write_target(tmp_path / "target")


@pytest.fixture
def sharded(tmp_path):
    folder = write_target(tmp_path / "sharded", shard_size="20KB")
    assert (folder / INDEX).is_file()
    return folder


def test_checkpoint_error_is_value_error():
    assert issubclass(CheckpointError, ValueError)


# --------------------------------------------------------------------------------------------------
# target errors


def test_missing_target_weight_names_folder_and_key(target):
    key = "model.layers.1.mlp.up_proj.weight"
    _edit_tensors(target / "model.safetensors", lambda t: t.pop(key))
    _raises(lambda: load_target(target, "float32"), str(target), "missing weight", key)


def test_missing_untied_lm_head_is_an_error(target):
    _edit_tensors(target / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    _raises(lambda: load_target(target, "float32"), str(target), "lm_head.weight")


def test_unexpected_target_weight_names_file_and_key(target):
    key = "model.layers.0.self_attn.extra_proj.weight"
    _edit_tensors(target / "model.safetensors", lambda t: t.__setitem__(key, torch.zeros(4, 4)))
    _raises(lambda: load_target(target, "float32"), str(target / "model.safetensors"), "unexpected", key)


def test_shape_mismatch_names_file_key_and_shapes(target):
    key = "model.layers.2.mlp.up_proj.weight"
    _edit_tensors(target / "model.safetensors", lambda t: t.__setitem__(key, torch.zeros(63, 32)))
    _raises(lambda: load_target(target, "float32"), str(target / "model.safetensors"), key, "(63, 32)", "(64, 32)")


def test_shape_mismatch_in_a_shard_names_that_shard(sharded):
    key = "model.layers.3.self_attn.q_proj.weight"
    shard = _shard_of(sharded, key)
    _edit_tensors(shard, lambda t: t.__setitem__(key, torch.zeros(32, 31)))
    msg = _raises(lambda: load_target(sharded, "float32"), str(shard), key, "(32, 31)")
    others = {p.name for p in sharded.glob("model-*.safetensors")} - {shard.name}
    assert not any(o in msg for o in others)


def test_unknown_target_architecture(target):
    _edit_config(target, lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"]))
    _raises(lambda: load_target(target, "float32"), str(target / "config.json"), "architecture",
            "LlamaForCausalLM", "Qwen3ForCausalLM")


def test_target_without_architectures_needs_qwen3_model_type(target):
    _edit_config(target, lambda c: (c.pop("architectures"), c.__setitem__("model_type", "llama")))
    _raises(lambda: load_target(target, "float32"), str(target / "config.json"), "model_type")


def test_missing_config_json(target):
    (target / "config.json").unlink()
    _raises(lambda: load_target(target, "float32"), "config.json", str(target))


def test_missing_weights_file(target):
    (target / "model.safetensors").unlink()
    _raises(lambda: load_target(target, "float32"), str(target), "model.safetensors", INDEX)


def test_index_pointing_at_missing_shard(sharded):
    key = "model.layers.2.mlp.down_proj.weight"
    shard = _shard_of(sharded, key)
    shard.unlink()
    msg = _raises(lambda: load_target(sharded, "float32"), str(sharded / INDEX), shard.name)
    weight_map = json.loads((sharded / INDEX).read_text())["weight_map"]
    named = [k for k, s in weight_map.items() if s == shard.name and f"'{k}'" in msg]
    assert named, msg


def test_index_listing_a_key_absent_from_its_shard(sharded):
    index = sharded / INDEX
    data = json.loads(index.read_text())
    shard = next(iter(data["weight_map"].values()))
    data["weight_map"]["model.layers.0.ghost.weight"] = shard
    index.write_text(json.dumps(data))
    _raises(lambda: load_target(sharded, "float32"), str(sharded / shard), "model.layers.0.ghost.weight")


def test_unsupported_rope_and_sliding_window_name_the_key(target):
    _edit_config(target, lambda c: c.__setitem__("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}))
    _raises(lambda: load_target(target, "float32"), str(target / "config.json"), "rope_parameters", "yarn")
    _edit_config(target, lambda c: (c.__setitem__("rope_parameters", {"rope_type": "default", "rope_theta": 1e4}),
                                    c.__setitem__("use_sliding_window", True)))
    _raises(lambda: load_target(target, "float32"), str(target / "config.json"), "use_sliding_window")


def test_missing_required_config_key(target):
    _edit_config(target, lambda c: c.pop("intermediate_size"))
    _raises(lambda: load_target(target, "float32"), str(target / "config.json"), "intermediate_size")


# --------------------------------------------------------------------------------------------------
# drafter errors


def test_missing_drafter_weight(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d")
    _edit_tensors(folder / "model.safetensors", lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder), "layers.1.self_attn.k_norm.weight")


def test_unexpected_drafter_weight(tmp_path, target_cfg):
    """E.g. a drafter export that carries its own embedding: refused, naming file and key."""
    folder = write_drafter(tmp_path / "d")
    _edit_tensors(folder / "model.safetensors", lambda t: t.__setitem__("embed_tokens.weight", torch.zeros(96, 32)))
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "model.safetensors"),
            "unexpected", "embed_tokens.weight")


def test_drafter_shape_mismatch(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d")
    _edit_tensors(folder / "model.safetensors", lambda t: t.__setitem__("hidden_norm.weight", torch.ones(33)))
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "model.safetensors"),
            "hidden_norm.weight", "(33,)", "(32,)")


def test_unknown_drafter_architecture(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d")
    _edit_config(folder, lambda c: c.__setitem__("architectures", ["EagleDraftModel"]))
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "config.json"), "architecture",
            "EagleDraftModel", "DFlashDraftModel")


def test_drafter_hidden_size_differs_from_target(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d", hidden=48, head_dim=12)
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "config.json"), "hidden_size",
            "48", "32")


@pytest.mark.parametrize("prefix", ["", "model."])
def test_drafter_fc_width_must_match_target_layers_times_hidden(tmp_path, target_cfg, prefix):
    folder = write_drafter(tmp_path / "d", prefix=prefix)  # target_layer_ids (0, 2): fc takes 2 x 32 = 64
    _edit_tensors(folder / "model.safetensors", lambda t: t.__setitem__(prefix + "fc.weight", torch.zeros(32, 96)))
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "model.safetensors"), "fc.weight",
            "96", "64")


def test_drafter_config_with_more_target_layers_than_fc_inputs(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d")
    _edit_config(folder, lambda c: c["dflash_config"].__setitem__("target_layer_ids", [0, 1, 2]))
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "model.safetensors"), "fc.weight",
            "64", "96")


def test_target_layer_ids_out_of_range(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d", target_layer_ids=(0, 4))
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "config.json"), "target_layer_ids",
            "[4]", "4 layers")


def test_mask_token_outside_target_vocab(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d", mask_token_id=96)
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "config.json"), "mask_token_id")


def test_drafter_config_missing_target_layer_ids(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d")
    _edit_config(folder, lambda c: c["dflash_config"].pop("target_layer_ids"))
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder / "config.json"), "target_layer_ids")


def test_drafter_missing_config_and_weights(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d")
    (folder / "model.safetensors").unlink()
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder), "model.safetensors")
    (folder / "config.json").unlink()
    _raises(lambda: load_drafter(folder, target_cfg, "float32"), str(folder), "config.json")


# --------------------------------------------------------------------------------------------------
# accepted variants


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_dflash_config_nested_or_top_level(tmp_path, target_cfg):
    nested = write_drafter(tmp_path / "nested", nested=True, mask_token_id=90, target_layer_ids=(1, 3))
    flat = write_drafter(tmp_path / "flat", nested=False, mask_token_id=90, target_layer_ids=(1, 3))
    assert "dflash_config" in json.loads((nested / "config.json").read_text())
    flat_json = json.loads((flat / "config.json").read_text())
    assert flat_json == drafter_config_dict(nested=False, mask_token_id=90, target_layer_ids=(1, 3))
    assert "dflash_config" not in flat_json and flat_json["target_layer_ids"] == [1, 3]
    a, b = load_drafter_config(nested), load_drafter_config(flat)
    assert a == b
    assert a.target_layer_ids == (1, 3) and a.mask_token_id == 90 and a.block_size == 16
    assert a.num_target_layers == 4
    da, db = load_drafter(nested, target_cfg, "float32"), load_drafter(flat, target_cfg, "float32")
    sa, sb = _state(da), _state(db)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert da.config.target_layer_ids == db.config.target_layer_ids == (1, 3)


def test_drafter_keys_with_model_prefix(tmp_path, target_cfg):
    plain = write_drafter(tmp_path / "plain", seed=3)
    prefixed = write_drafter(tmp_path / "prefixed", prefix="model.", seed=3)
    with safe_open(str(prefixed / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("model.") for k in keys)
    sa = _state(load_drafter(plain, target_cfg, "float32"))
    sb = _state(load_drafter(prefixed, target_cfg, "float32"))
    raw = load_file(str(prefixed / "model.safetensors"))
    assert sa.keys() == sb.keys() == {k[len("model."):] for k in raw}
    for k in sa:
        assert torch.equal(sa[k], sb[k]) and torch.equal(sb[k], raw["model." + k]), k


def test_drafter_weights_and_dtype_as_saved(tmp_path, target_cfg):
    folder = write_drafter(tmp_path / "d")
    raw = load_file(str(folder / "model.safetensors"))
    model = load_drafter(folder, target_cfg, "bfloat16")
    state = model.state_dict()
    assert state.keys() == raw.keys()
    for k, v in raw.items():
        assert state[k].dtype == torch.bfloat16
        assert torch.equal(state[k], v.to(torch.bfloat16)), k


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_tied_target_without_lm_head(tmp_path, sharded):
    folder = write_target(tmp_path / "tied", tied=True, shard_size="20KB" if sharded else None)
    assert (folder / INDEX).is_file() == sharded
    raw = {}
    for path in sorted(folder.glob("*.safetensors")):
        raw.update(load_file(str(path)))
    assert "lm_head.weight" not in raw and "model.embed_tokens.weight" in raw
    model = load_target(folder, "float32")
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, raw["model.embed_tokens.weight"])
    for name, p in model.named_parameters():
        assert p.device.type == "cpu" and torch.equal(p, raw[name]), name


def test_tied_target_with_a_stray_lm_head_copy_ignores_it(tmp_path):
    folder = write_target(tmp_path / "tied", tied=True)
    embed = load_file(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    _edit_tensors(folder / "model.safetensors", lambda t: t.__setitem__("lm_head.weight", torch.zeros_like(embed)))
    model = load_target(folder, "float32")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embed)


def test_untied_target_loads_every_weight_as_saved(target):
    raw = load_file(str(target / "model.safetensors"))
    model = load_target(target, "float32")
    state = dict(model.named_parameters())
    assert set(state) == set(raw)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    for k, v in raw.items():
        assert torch.equal(state[k], v), k


# --------------------------------------------------------------------------------------------------
# kernel choice


def _layer_choices(model) -> set:
    """Every KernelChoice held inside `model` (the model's own and each layer's)."""
    return {m.kernels for m in model.modules() if isinstance(getattr(m, "kernels", None), KernelChoice)}


def test_loaded_models_are_built_with_the_choice_passed(target, tmp_path, target_cfg):
    forced = KernelChoice(attention_tile=64)
    model = load_target(target, "float32", kernels=forced)
    assert model.kernels is forced and _layer_choices(model) == {forced}
    drafter = load_drafter(write_drafter(tmp_path / "d"), target_cfg, "float32", kernels=forced)
    assert drafter.kernels is forced and _layer_choices(drafter) == {forced}


def test_loader_resolves_the_choice_once_for_device_and_dtype(target, tmp_path, target_cfg, monkeypatch):
    """Without `kernels=`, the loader resolves one for its device and dtype: the references on CPU, or what
    the DSCALE_* variables say (read at load time, never afterwards); a bad variable fails the load."""
    for variable in ("DSCALE_ATTENTION", "DSCALE_ATTENTION_TILE", "DSCALE_FUSED", "DSCALE_FEATURES"):
        monkeypatch.delenv(variable, raising=False)
    assert load_target(target, "float32").kernels == KernelChoice.resolve("cpu", torch.float32) == KernelChoice()
    monkeypatch.setenv("DSCALE_ATTENTION_TILE", "32")
    model = load_target(target, "bfloat16")
    drafter = load_drafter(write_drafter(tmp_path / "d"), target_cfg, "float32")
    assert _layer_choices(model) == _layer_choices(drafter) == {KernelChoice(attention_tile=32)}
    monkeypatch.setenv("DSCALE_ATTENTION", "flash")
    with pytest.raises(ValueError, match="DSCALE_ATTENTION='flash'"):
        load_target(target, "float32")
