"""Fast GPU paths behind one API, each beside its portable oracle.

`paged_attention` routes one layer's attention over the paged cache: Triton (`triton_attention.py`, imported
lazily) on CUDA tensors when triton is importable, the portable `paged_attention_ref` otherwise (so CPU
runs are exactly the portable path). Force a path with `backend=` or the environment variable
`DSCALE_ATTENTION=auto|ref|triton` (`triton` on CPU tensors runs Triton's interpreter, for tests); force
the query tile with `tile_rows=` or `DSCALE_ATTENTION_TILE=16|32|64|128` (the "+tiles" ablation).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from dscale_runtime.attention import AttentionMetadata, paged_attention_ref

BACKENDS = ("auto", "ref", "triton")
VERIFY_TILE = 16  # query rows per tile when every request's query is at most this long (DESIGN 3.6)
PREFILL_TILES = (64, 128)  # hardware tiles for longer queries
TILE_ROWS = (16, 32, 64, 128)  # tiles a caller may force
MAX_STACKED_ROWS = 128  # query rows x stacked q heads of one Triton program
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what every Triton path takes


def tile_rows_for(max_q: int) -> int:
    """The routing rule: the 16-row tile when the longest query fits in it, else a prefill tile."""
    if max_q <= VERIFY_TILE:
        return VERIFY_TILE
    return PREFILL_TILES[0] if max_q <= PREFILL_TILES[0] else PREFILL_TILES[1]


def heads_per_program(group: int, tile_rows: int) -> int:
    """q heads of one GQA group stacked in a program: the largest power-of-two divisor of `group` whose
    stack with the tile stays within MAX_STACKED_ROWS rows (Qwen3-8B, group 4: 4 x 16 rows verify, 1 x 128 prefill)."""
    g = 1
    while group % (2 * g) == 0 and 2 * g * tile_rows <= MAX_STACKED_ROWS:
        g *= 2
    return g


@functools.cache
def triton_available() -> bool:
    """Whether triton can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def requested_backend(variable: str, backend: str | None = None) -> str:
    """'auto', 'ref' or 'triton' as asked: the argument, else the environment `variable`, else auto. A bad
    value names where it came from; 'triton' without triton installed names the way out. Each router then
    applies its own rule to 'auto' (and to calls its Triton path cannot take)."""
    choice = backend or os.environ.get(variable, "auto") or "auto"
    if choice not in BACKENDS:
        source = "backend" if backend else variable
        raise ValueError(f"{source}={choice!r}: expected one of {', '.join(BACKENDS)}")
    if choice == "triton" and not triton_available():
        raise RuntimeError(f"{variable}=triton (or backend='triton') but triton is not installed: "
                           f"pip install triton, or use {variable}=ref")
    return choice


def attention_backend(q: torch.Tensor, backend: str | None = None) -> str:
    """'ref' or 'triton' for this call: the argument, else DSCALE_ATTENTION, else auto."""
    choice = requested_backend("DSCALE_ATTENTION", backend)
    if choice == "auto":
        return "triton" if q.is_cuda and q.dtype in TRITON_DTYPES and triton_available() else "ref"
    return choice


def forced_tile_rows(tile_rows: int | None = None) -> int | None:
    """The argument, else DSCALE_ATTENTION_TILE, else None (the router picks from max_q)."""
    if tile_rows is not None:
        return tile_rows
    value = os.environ.get("DSCALE_ATTENTION_TILE")
    if not value:
        return None
    if value not in tuple(map(str, TILE_ROWS)):
        raise ValueError(f"DSCALE_ATTENTION_TILE={value!r}: expected one of {TILE_ROWS} (or unset)")
    return int(value)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D] (this layer)
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    page_size: int,
    scale: float,
    *,
    backend: str | None = None,
    tile_rows: int | None = None,
    out: torch.Tensor | None = None,  # [T, H, D] output buffer (Triton path writes it in place)
) -> torch.Tensor:  # [T, H, D]
    """Ragged attention over the paged cache through the chosen path (same contract as the portable one)."""
    if attention_backend(q, backend) == "ref":
        result = paged_attention_ref(q, k_cache, v_cache, meta, page_size, scale)
        return result if out is None else out.copy_(result)
    from dscale_runtime.kernels.triton_attention import paged_attention_triton

    return paged_attention_triton(q, k_cache, v_cache, meta, page_size, scale,
                                  tile_rows=forced_tile_rows(tile_rows), out=out)


def stack_usage(compiled) -> str:
    """'STACK:<bytes>' of a kernel compiled offline (`compile_offline` of a Triton module), read with the
    cuobjdump that Triton bundles; 'STACK:?' where that tool is missing. STACK:0 means no register spills."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return "STACK:?"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return next(x for x in usage.split() if x.startswith("STACK:"))
