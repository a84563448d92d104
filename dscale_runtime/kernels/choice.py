"""Which kernel path every op takes: `KernelChoice`, chosen once when the models and the runner are built.

`KernelChoice.resolve(device, dtype, ...)` applies the auto rule once (Triton on CUDA for a dtype the Triton
kernels take, when triton is importable; the portable reference otherwise) and validates what was asked for.
Its options default to the environment variables DSCALE_ATTENTION, DSCALE_ATTENTION_TILE, DSCALE_FUSED,
DSCALE_FEATURES and DSCALE_DECISION, read there and nowhere else: the models keep the resolved choice
(`use_kernels` changes it) and hand it to the routers (`kernels.paged_attention`, `kernels.fused`,
`kernels.features`) on every call, so no call reads the environment. The routers' per-call checks are about
tensors only (autograd, mixed dtypes, toy vocabularies), never about settings.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch

BACKENDS = ("ref", "triton")  # what a KernelChoice holds
REQUESTS = ("auto", *BACKENDS)  # what a caller may ask for
TILE_ROWS = (16, 32, 64, 128)  # query tiles a caller may force
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what every Triton path takes
ENVIRONMENT = {"attention": "DSCALE_ATTENTION", "attention_tile": "DSCALE_ATTENTION_TILE",
               "fused": "DSCALE_FUSED", "features": "DSCALE_FEATURES",
               "decision": "DSCALE_DECISION"}  # option -> its default's variable


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def auto_backend(device: torch.device | str, dtype: torch.dtype) -> str:
    """The auto rule: 'triton' for CUDA tensors of a Triton dtype when triton is importable, else 'ref' (so
    CPU runs are exactly the portable references)."""
    usable = torch.device(device).type == "cuda" and dtype in TRITON_DTYPES and triton_available()
    return "triton" if usable else "ref"


def check_backend(backend: str, variable: str, source: str = "backend") -> str:
    """`backend` ('auto', 'ref' or 'triton') if valid: a bad value names `source` (the argument or the
    environment variable it came from); 'triton' without triton installed names the way out."""
    if backend not in REQUESTS:
        raise ValueError(f"{source}={backend!r}: expected one of {', '.join(REQUESTS)}")
    if backend == "triton" and not triton_available():
        way_out = f"{variable}=ref" if source == variable else f"{source}='ref' (or {variable}=ref)"
        raise RuntimeError(f"{source}='triton' but triton is not installed: pip install triton, or use {way_out}")
    return backend


@dataclass(frozen=True)
class KernelChoice:
    """The kernel path of every op of the target, the drafter and the step around them. The defaults are the
    portable references everywhere (what a model built without a choice runs); `resolve` picks for a device."""

    attention: str = "ref"
    """Paged attention: 'ref' (`attention.paged_attention_ref`) or 'triton' (`kernels/triton_attention.py`)."""
    attention_tile: int | None = None
    """Query rows per Triton attention program: None routes by the longest query (16 rows when every query
    fits, else 64 / 128); 16, 32, 64 or 128 forces one tile everywhere (the "+tiles" ablation)."""
    fused: str = "ref"
    """The layer's elementwise ops (RMSNorm, add + RMSNorm, q/k norm + RoPE, SiLU x up): 'ref' or 'triton'."""
    features: str = "ref"
    """The predictor's confidence features over the drafter logits: 'ref' or 'triton'."""
    decision: str = "ref"
    """The step's own index work around the models, in every mode: the block and its attention metadata, the
    acceptance with the drafter's kept slots and the result row, the state's reads and writes (`resolve`,
    `advance`), and DScale's decision around the predictor (the v3 agreement columns, the conditionals and their
    calibration, the allocation with the flat pack). 'ref': the torch definitions, about 60 small launches in a
    captured DFlash step and 230 in a DScale one; 'triton' (`kernels/triton_step.py`, `triton_state.py`,
    `triton_agreement.py`, `triton_pack.py`): four and eight launches, the same values."""

    def __post_init__(self) -> None:
        for option in ("attention", "fused", "features", "decision"):
            value = getattr(self, option)
            if value not in BACKENDS:
                hint = " (KernelChoice.resolve applies 'auto')" if value == "auto" else ""
                raise ValueError(f"KernelChoice.{option}={value!r}: expected 'ref' or 'triton'{hint}")
            check_backend(value, ENVIRONMENT[option], f"KernelChoice.{option}")
        if self.attention_tile is not None and self.attention_tile not in TILE_ROWS:
            raise ValueError(f"KernelChoice.attention_tile={self.attention_tile!r}: expected one of {TILE_ROWS} "
                             "or None (route by the longest query)")

    @classmethod
    def resolve(
        cls,
        device: torch.device | str,
        dtype: torch.dtype,
        attention: str = "auto",
        attention_tile: int | None = None,
        fused: str = "auto",
        features: str = "auto",
        decision: str = "auto",
    ) -> "KernelChoice":
        """The choice for models of `dtype` on `device`. An option left at 'auto' (None for the tile) takes its
        environment variable (DSCALE_ATTENTION, DSCALE_ATTENTION_TILE, DSCALE_FUSED, DSCALE_FEATURES,
        DSCALE_DECISION) when that is set and non-empty; what is still 'auto' then follows the auto rule
        (`auto_backend`). An explicit 'ref' or 'triton' wins over the environment. Bad values name the argument
        or variable to fix. (`decision` follows the auto rule since its kernels were timed on the H200,
        2026-12-05: docs/benchmarks.md.)"""
        asked = {"attention": attention, "fused": fused, "features": features, "decision": decision}
        chosen = {}
        for option, value in asked.items():
            variable = ENVIRONMENT[option]
            source = option
            if value == "auto" and os.environ.get(variable):
                value, source = os.environ[variable], variable
            check_backend(value, variable, source)
            chosen[option] = auto_backend(device, dtype) if value == "auto" else value
        return cls(attention_tile=_tile(attention_tile), **chosen)


def _tile(tile_rows: int | None) -> int | None:
    """The forced query tile: the argument, else DSCALE_ATTENTION_TILE, else None (route by max_q)."""
    if tile_rows is not None:
        if tile_rows not in TILE_ROWS:
            raise ValueError(f"attention_tile={tile_rows!r}: expected one of {TILE_ROWS} or None")
        return tile_rows
    value = os.environ.get(ENVIRONMENT["attention_tile"])
    if not value:
        return None
    if value not in tuple(map(str, TILE_ROWS)):
        raise ValueError(f"DSCALE_ATTENTION_TILE={value!r}: expected one of {TILE_ROWS} (or unset)")
    return int(value)
