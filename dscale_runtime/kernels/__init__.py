"""Fast GPU paths behind one API, each beside its portable oracle, and the choice between them.

`KernelChoice` (`choice.py`) names the path of every op; the models are built with one and pass its fields
to the routers. `paged_attention` routes one layer's attention over the paged cache: Triton
(`triton_attention.py`, imported lazily) when the caller says 'triton' (on CPU tensors that is Triton's
interpreter, for tests), the portable `paged_attention_ref` for 'ref', and for 'auto' (direct calls) the
auto rule on the query tensor. `tile_rows` forces the query tile; None routes by the longest query. The
routers read no environment: DSCALE_ATTENTION / DSCALE_ATTENTION_TILE are read once, by
`KernelChoice.resolve`. Split-KV is asked for through the metadata: `meta.kv_splits` (static, default 1) lets
the Triton path spread each request's keys over up to that many programs, the count per request decided on
the device from its kv_len (`kv_splits_for` sizes it for a launch; the portable path ignores it).
"""

from __future__ import annotations

import os

import torch

from dscale_runtime.attention import AttentionMetadata, paged_attention_ref
from dscale_runtime.kernels.choice import (
    BACKENDS,
    REQUESTS,
    TILE_ROWS,
    TRITON_DTYPES,
    KernelChoice,
    auto_backend,
    check_backend,
    triton_available,
)

__all__ = ["BACKENDS", "REQUESTS", "TILE_ROWS", "TRITON_DTYPES", "KernelChoice", "attention_backend",
           "auto_backend", "check_backend", "heads_per_program", "kv_splits_for", "paged_attention", "stack_usage",
           "tile_rows_for", "triton_available"]

VERIFY_TILE = 16  # query rows per tile when every request's query is at most this long (DESIGN 3.6)
PREFILL_TILES = (64, 128)  # hardware tiles for longer queries
MAX_STACKED_ROWS = 128  # query rows x stacked q heads of one Triton program


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


def kv_splits_for(busy_requests: int, max_q: int, num_heads: int, num_kv_heads: int, sm_count: int,
                  tile_rows: int | None = None, max_splits: int = 16) -> int:
    """A static `AttentionMetadata.kv_splits` for a launch whose `busy_requests` requests (live ones, not
    padding slots) have queries of up to `max_q` rows: the power of two (<= max_splits) that brings their
    Triton programs (requests x head groups x query tiles) to about two per SM. Requests with short contexts
    split less (on the device: one split per MIN_KEYS_PER_SPLIT keys), so a large value costs them nothing
    but idle programs; each split costs a [rows, heads, head_dim] fp32 partial, so many-row launches keep few."""
    tile = tile_rows or tile_rows_for(max_q)
    groups = num_heads // heads_per_program(num_heads // num_kv_heads, tile)
    programs = max(1, busy_requests) * groups * -(-max(1, max_q) // tile)
    splits = 1
    while splits < max_splits and programs * splits < 2 * sm_count:
        splits *= 2
    return splits


def attention_backend(q: torch.Tensor, backend: str = "auto") -> str:
    """'ref' or 'triton' for this call: `backend` as given, or for 'auto' the auto rule on q's device and dtype."""
    check_backend(backend, "DSCALE_ATTENTION")
    return auto_backend(q.device, q.dtype) if backend == "auto" else backend


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D] (this layer)
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    page_size: int,
    scale: float,
    *,
    backend: str = "auto",
    tile_rows: int | None = None,  # forced query tile (KernelChoice.attention_tile); None: by meta.max_q
    out: torch.Tensor | None = None,  # [T, H, D] output buffer (Triton path writes it in place)
) -> torch.Tensor:  # [T, H, D]
    """Ragged attention over the paged cache through the path `backend` names (a KernelChoice's `attention`
    from the models; same contract as the portable one)."""
    if attention_backend(q, backend) == "ref":
        result = paged_attention_ref(q, k_cache, v_cache, meta, page_size, scale)
        return result if out is None else out.copy_(result)
    from dscale_runtime.kernels.triton_attention import paged_attention_triton

    return paged_attention_triton(q, k_cache, v_cache, meta, page_size, scale,
                                  tile_rows=tile_rows, out=out)


def compile_for_gpu(kernel, constexprs: dict, pointers: dict[str, str], num_warps: int, arch: int = 90,
                    **options):
    """`kernel` (a triton.jit function) compiled for an NVIDIA target without a GPU (Triton's bundled ptxas), as
    the kernels' `compile_offline` checks do: the arguments in `constexprs` as constants, those ending in `_ptr` of
    the pointer type `pointers` names (its '*' entry for the others), the rest i32. Needs triton imported without
    TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constexprs else
                 pointers.get(name, pointers.get("*")) if name.endswith("_ptr") else "i32"
                 for name in kernel.arg_names}
    return triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, **options})


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
