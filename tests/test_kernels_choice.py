"""`KernelChoice` (kernels/choice.py): the auto rule applied once, the environment as the default source,
explicit options over the environment, and errors that name the option or variable to fix."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from markers import needs_triton
import dscale_runtime.kernels.choice as choice
from dscale_runtime.kernels import KernelChoice

VARIABLES = ("DSCALE_ATTENTION", "DSCALE_ATTENTION_TILE", "DSCALE_FUSED", "DSCALE_FEATURES", "DSCALE_DECISION")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for variable in VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def _all(backend: str, tile: int | None = None) -> KernelChoice:
    return KernelChoice(attention=backend, attention_tile=tile, fused=backend, features=backend, decision=backend)


def test_defaults_are_the_portable_references():
    assert KernelChoice() == _all("ref")


def test_auto_rule(monkeypatch):
    """Triton on CUDA for a dtype the kernels take when triton is importable; the references otherwise. Only
    the device's type matters: no CUDA device is needed to resolve a choice for one."""
    monkeypatch.setattr(choice, "triton_available", lambda: True)
    assert KernelChoice.resolve("cpu", torch.float32) == _all("ref")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert KernelChoice.resolve("cuda", dtype) == _all("triton")
        assert KernelChoice.resolve(torch.device("cuda", 0), dtype) == _all("triton")
    assert KernelChoice.resolve("cuda", torch.float64) == _all("ref")
    monkeypatch.setattr(choice, "triton_available", lambda: False)
    assert KernelChoice.resolve("cuda", torch.bfloat16) == _all("ref")


def test_environment_is_the_default_source(monkeypatch):
    monkeypatch.setattr(choice, "triton_available", lambda: True)
    monkeypatch.setenv("DSCALE_ATTENTION", "ref")
    monkeypatch.setenv("DSCALE_ATTENTION_TILE", "128")
    monkeypatch.setenv("DSCALE_FEATURES", "auto")
    monkeypatch.setenv("DSCALE_DECISION", "ref")
    got = KernelChoice.resolve("cuda", torch.bfloat16)
    assert got == KernelChoice(attention="ref", attention_tile=128, fused="triton", features="triton", decision="ref")
    # Explicit options win over the environment; an empty variable counts as unset.
    got = KernelChoice.resolve("cuda", torch.bfloat16, attention="triton", attention_tile=16, fused="ref",
                               decision="triton")
    assert got == KernelChoice(attention="triton", attention_tile=16, fused="ref", features="triton",
                               decision="triton")
    monkeypatch.setenv("DSCALE_DECISION", "")
    monkeypatch.setenv("DSCALE_ATTENTION", "")
    monkeypatch.setenv("DSCALE_ATTENTION_TILE", "")
    assert KernelChoice.resolve("cuda", torch.bfloat16) == _all("triton")


@needs_triton
def test_triton_forced_on_cpu(monkeypatch):
    """'triton' on CPU (the interpreter, for tests) is honoured, from the argument or the environment."""
    monkeypatch.setenv("DSCALE_FUSED", "triton")
    got = KernelChoice.resolve("cpu", torch.float32, attention="triton")
    assert got == KernelChoice(attention="triton", fused="triton", features="ref")


@pytest.mark.parametrize("variable, value, message", [
    ("DSCALE_ATTENTION", "flash", r"DSCALE_ATTENTION='flash': expected one of auto, ref, triton"),
    ("DSCALE_FUSED", "fast", r"DSCALE_FUSED='fast': expected one of auto, ref, triton"),
    ("DSCALE_FEATURES", "cuda", r"DSCALE_FEATURES='cuda': expected one of auto, ref, triton"),
    ("DSCALE_ATTENTION_TILE", "48", r"DSCALE_ATTENTION_TILE='48': expected one of \(16, 32, 64, 128\)"),
])
def test_bad_environment_values_name_the_variable(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=message):
        KernelChoice.resolve("cpu", torch.float32)


@pytest.mark.parametrize("option, value, message", [
    ("attention", "flash", r"attention='flash': expected one of auto, ref, triton"),
    ("fused", "Triton", r"fused='Triton': expected one of auto, ref, triton"),
    ("features", None, r"features=None: expected one of auto, ref, triton"),
    ("attention_tile", 48, r"attention_tile=48: expected one of \(16, 32, 64, 128\)"),
])
def test_bad_options_name_the_option(monkeypatch, option, value, message):
    monkeypatch.setenv("DSCALE_ATTENTION", "ref")  # a valid environment does not hide a bad argument
    with pytest.raises(ValueError, match=message):
        KernelChoice.resolve("cpu", torch.float32, **{option: value})


def test_a_choice_holds_only_resolved_values():
    with pytest.raises(ValueError, match=r"KernelChoice.attention='auto'.*KernelChoice.resolve"):
        KernelChoice(attention="auto")
    with pytest.raises(ValueError, match=r"KernelChoice.features='fast'"):
        KernelChoice(features="fast")
    with pytest.raises(ValueError, match=r"KernelChoice.attention_tile=48"):
        KernelChoice(attention_tile=48)
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelChoice().attention = "triton"


def test_triton_without_triton_names_the_way_out(monkeypatch):
    monkeypatch.setattr(choice, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"attention='triton' but triton is not installed.*DSCALE_ATTENTION=ref"):
        KernelChoice.resolve("cpu", torch.float32, attention="triton")
    monkeypatch.setenv("DSCALE_FEATURES", "triton")
    with pytest.raises(RuntimeError, match=r"DSCALE_FEATURES='triton' but triton is not installed: pip install "
                                           r"triton, or use DSCALE_FEATURES=ref$"):
        KernelChoice.resolve("cpu", torch.float32)
    with pytest.raises(RuntimeError, match=r"KernelChoice.fused='triton'.*DSCALE_FUSED=ref"):
        KernelChoice(fused="triton")
