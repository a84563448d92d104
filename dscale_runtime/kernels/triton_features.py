"""Triton confidence features (DESIGN 3.1): top-k gaps, top-1 log-probability and entropy in one read of the logits.

Two launches, both with grids from static sizes only (no host reads: safe inside CUDA graph capture).
Stage 1, grid (R, C): each program reads one chunk of a row once, in tiles of ROWS x GROUPS logits, and writes
to a small fp32 workspace the chunk's top-K values (with multiplicity: torch.topk semantics), its max m_c, and
the shifted sums s_c = sum exp(l - m_c) and t_c = sum exp(l - m_c) * (l - m_c). Stage 2, grid (R,): merges the
C candidate lists (one top-K over C x K values) and the partial sums into S and T relative to the row max m,
and writes [top1, top1 - top_r for r = 2..num_ranks, -log S, log S - T / S]: the top token's log-probability
and the softmax entropy, without the cancellation of `logZ - E[l]` at large logits.

Top-K of a chunk without sorting it (a bitonic top-k costs ~150 instructions per element sorted, ten times
the cost of reading it): element i of a chunk belongs to group i % GROUPS, so every tile row adds one element
to each group and the group maxima are an elementwise running max. At the end of the chunk one small sort
picks the K groups with the largest maxima (ties broken by group index) and a second one takes the top-K of
those K groups' elements, read again from cache.
NOTE: that is exact, ties included: if some element among the chunk's i largest (i <= K) lies outside the
chosen groups, each of the K chosen groups has a maximum at least that large, so the chosen groups hold at
least K >= i elements as large as the chunk's i-th largest value; the i-th largest of the chosen elements
therefore equals it. The softmax sums are kept per group as well (online, each relative to its group's
running max), so the tile loop needs no cross-thread reduction.

This module imports triton at import time: import it only through `dscale_runtime.kernels.features`, which
does so lazily. CUDA tensors run the compiled kernels; with TRITON_INTERPRET=1 set before triton is imported,
they run in Triton's interpreter, on CPU tensors too (the CPU tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.kernels.triton_fused import interpreted, require_interpreter_on_cpu

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_RANKS = 64
GROUPS = 512  # groups of a chunk (one tile row: 512 contiguous logits)
TILE_ROWS = 8  # tile rows per loop step: a 4096-logit tile
MAX_TILES = 4  # tiles per chunk: chunks of up to 16,384 logits (10 a row at Qwen3's 151,936; on an H200 at
# N = 32 x 15 rows 4 tiles took 0.103 ms, 8 tiles 0.140, 16 tiles 0.170: `python -m ...triton_features --sweep`)
MIN_PROGRAMS = 512  # stage-1 programs wanted before chunks grow (a few per SM of an H200)
STATS = 4  # workspace values per chunk: m_c, s_c, t_c, unused
_FLOOR = tl.constexpr(-1.0e30)  # reference point of a group with no finite logit yet (keeps shifts finite)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _accumulate_tile(base, start, vocab, tile, gmax, ref, s, t,
                     GROUPS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr):
    """One tile [ROWS, GROUPS] of a chunk into the per-group running max, softmax reference point `ref`,
    s = sum 2^d and t = sum 2^d * d with d = (l - ref) * log2(e)."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    offs = start + rows[:, None] * GROUPS + tl.arange(0, GROUPS)[None, :]  # [ROWS, GROUPS]
    if MASKED:
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
    else:
        x = tl.load(base + offs).to(tl.float32)
    gmax = tl.maximum(gmax, tl.max(x, 0))
    new_ref = tl.maximum(gmax, _FLOOR)
    shift = (ref - new_ref) * _LOG2E  # [GROUPS] <= 0, finite
    alpha = tl.exp2(shift)
    # NOTE: -inf (or float-min) logits give d = _FLOOR * log2(e), not -inf: 2^d = 0 and 2^d * d = 0, never NaN.
    d = tl.maximum(x - new_ref[None, :], _FLOOR) * _LOG2E
    e = tl.exp2(d)
    t = alpha * (t + shift * s) + tl.sum(e * d, 0)
    s = alpha * s + tl.sum(e, 0)
    return gmax, new_ref, s, t


@triton.jit
def _chunk_kernel(
    Logits, Top, Stats,  # logits [R, V] (rows contiguous); top [R, C, K] fp32; stats [R, C, STATS] fp32
    vocab, stride_row, num_chunks,
    K: tl.constexpr,  # candidates kept per chunk (power of two >= num_ranks)
    GROUPS: tl.constexpr,  # groups per chunk = logits per tile row (power of two >= K)
    ROWS: tl.constexpr,  # tile rows per loop step
    TILES: tl.constexpr,  # loop steps per chunk
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    SIZE: tl.constexpr = ROWS * TILES  # logits per group
    CHUNK: tl.constexpr = GROUPS * SIZE
    base = Logits + row.to(tl.int64) * stride_row
    start = chunk * CHUNK

    gmax = tl.full([GROUPS], float("-inf"), tl.float32)
    ref = tl.full([GROUPS], _FLOOR, tl.float32)
    s = tl.zeros([GROUPS], tl.float32)
    t = tl.zeros([GROUPS], tl.float32)
    if start + CHUNK <= vocab:
        for tile in range(TILES):
            gmax, ref, s, t = _accumulate_tile(base, start, vocab, tile, gmax, ref, s, t, GROUPS, ROWS, False)
    else:
        for tile in range(TILES):
            gmax, ref, s, t = _accumulate_tile(base, start, vocab, tile, gmax, ref, s, t, GROUPS, ROWS, True)
    m = tl.max(ref, 0)
    shift = (ref - m) * _LOG2E
    w = tl.exp2(shift)
    s_c = tl.sum(w * s, 0)
    t_c = tl.sum(w * (t + shift * s), 0) * _LN2

    # The K groups with the largest maxima: one sort of order-preserving integer keys (max bits, group index).
    bits = gmax.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # negative floats: reverse the magnitude
    key = (key << 32) | tl.arange(0, GROUPS).to(tl.int64)
    groups = (tl.topk(key, K) & (GROUPS - 1)).to(tl.int32)  # [K]
    cols = start + groups[:, None] + tl.arange(0, SIZE)[None, :] * GROUPS  # [K, SIZE] their elements
    cand = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    top = tl.topk(tl.reshape(cand, [K * SIZE]), K)  # [K] descending

    at = row * num_chunks + chunk
    tl.store(Top + at * K + tl.arange(0, K), top)
    tl.store(Stats + at * 4, m)
    tl.store(Stats + at * 4 + 1, s_c)
    tl.store(Stats + at * 4 + 2, t_c)


@triton.jit
def _merge_kernel(
    Top, Stats, Out,  # top [R, C, K]; stats [R, C, STATS]; out [R, NUM_RANKS + 2] fp32
    num_chunks, stride_out,
    NUM_RANKS: tl.constexpr,
    K: tl.constexpr,
    CHUNKS: tl.constexpr,  # num_chunks rounded up to a power of two
):
    row = tl.program_id(0)
    offs_c = tl.arange(0, CHUNKS)
    c_ok = offs_c < num_chunks
    offs_k = tl.arange(0, K)
    at = row * num_chunks + offs_c  # [CHUNKS]
    cand = tl.load(Top + at[:, None] * K + offs_k[None, :], mask=c_ok[:, None], other=float("-inf"))  # [CHUNKS, K]
    top = tl.topk(tl.reshape(cand, [CHUNKS * K]), K)  # [K] descending: the row's top-K with multiplicity
    top1 = tl.max(top, 0)

    m_c = tl.load(Stats + at * 4, mask=c_ok, other=_FLOOR)
    s_c = tl.load(Stats + at * 4 + 1, mask=c_ok, other=0.0)
    t_c = tl.load(Stats + at * 4 + 2, mask=c_ok, other=0.0)
    m = tl.max(m_c, 0)
    shift = m_c - m  # <= 0, finite
    w = tl.exp(shift)
    big_s = tl.sum(w * s_c, 0)  # sum exp(l - m)
    big_t = tl.sum(w * (t_c + shift * s_c), 0)  # sum exp(l - m) * (l - m)
    log_s = tl.log(big_s)
    log_prob = (top1 - m) - log_s  # top1 == m: the top token's log-probability is -log S
    entropy = log_s - big_t / big_s

    out = Out + row.to(tl.int64) * stride_out
    tl.store(out + offs_k, tl.where(offs_k == 0, top1, top1 - top), mask=offs_k < NUM_RANKS)
    tl.store(out + NUM_RANKS, log_prob)
    tl.store(out + NUM_RANKS + 1, entropy)



def launch_config(num_rows: int, vocab: int, num_ranks: int, dtype: torch.dtype = torch.bfloat16,
                  config: dict | None = None) -> dict:
    """Static sizes of one call (from shapes only). K: candidates per chunk; GROUPS x ROWS: one tile (smaller
    for small vocabularies); TILES: tiles per chunk, doubled up to MAX_TILES while the grid keeps at least
    MIN_PROGRAMS programs, so small batches split rows finely and large ones amortise each chunk's two sorts.
    Warps: one tile row is one 16-byte load per thread (2 warps for 16-bit logits, 4 for fp32), so the group
    maxima and sums need no cross-thread step. `config` overrides GROUPS / ROWS / TILES / num_warps /
    merge_warps (tuning)."""
    config = config or {}
    k = max(2, triton.next_power_of_2(num_ranks))
    rows = config.get("ROWS", TILE_ROWS)
    groups = config.get("GROUPS", min(GROUPS, max(k, triton.next_power_of_2(triton.cdiv(vocab, rows)))))
    assert groups >= k and groups & (groups - 1) == 0, f"GROUPS={groups} must be a power of two >= K={k}"
    tiles = config.get("TILES")
    if tiles is None:
        tiles = 1
        while (tiles < MAX_TILES and groups * rows * tiles < vocab
               and num_rows * triton.cdiv(vocab, 2 * groups * rows * tiles) >= MIN_PROGRAMS):
            tiles *= 2
    return {"K": k, "GROUPS": groups, "ROWS": rows, "TILES": tiles,
            "num_chunks": triton.cdiv(vocab, groups * rows * tiles),
            "num_warps": config.get("num_warps", 4 if dtype == torch.float32 else 2),
            "merge_warps": config.get("merge_warps", 4)}


def confidence_features_triton(
    logits: torch.Tensor,  # [R, V] fp32 / fp16 / bf16, rows contiguous
    num_ranks: int,
    out: torch.Tensor | None = None,  # [R, num_ranks + 2] fp32, written in place when given
    config: dict | None = None,  # GROUPS / ROWS / TILES / num_warps / merge_warps overrides (tuning)
) -> torch.Tensor:  # [R, num_ranks + 2] fp32: top1, gaps to ranks 2..num_ranks, top1 logprob, entropy
    """Per row, the columns of one position of the reference `confidence_features`, in two launches."""
    if logits.dtype not in _DTYPES:
        raise ValueError(f"Triton confidence features take {_DTYPES} logits, got {logits.dtype}: "
                         "use DSCALE_FEATURES=ref (KernelChoice.features='ref')")
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be [R, V] with contiguous rows"
    num_rows, vocab = logits.shape
    assert 1 <= num_ranks <= MAX_RANKS and vocab >= num_ranks, (num_ranks, vocab)
    if out is None:
        out = torch.empty(num_rows, num_ranks + 2, dtype=torch.float32, device=logits.device)
    assert out.shape == (num_rows, num_ranks + 2) and out.dtype == torch.float32 and out.stride(-1) == 1
    assert out.device == logits.device
    if num_rows == 0:
        return out
    require_interpreter_on_cpu(logits, "Triton confidence features", "features")
    cfg = launch_config(num_rows, vocab, num_ranks, logits.dtype, config)
    k, num_chunks = cfg["K"], cfg["num_chunks"]
    # NOTE: allocated by torch on the logits' device: inside a CUDA graph capture, from the graph's pool.
    top = torch.empty(num_rows, num_chunks, k, dtype=torch.float32, device=logits.device)
    stats = torch.empty(num_rows, num_chunks, STATS, dtype=torch.float32, device=logits.device)
    _chunk_kernel[(num_rows, num_chunks)](
        logits, top, stats, vocab, logits.stride(0), num_chunks,
        K=k, GROUPS=cfg["GROUPS"], ROWS=cfg["ROWS"], TILES=cfg["TILES"], num_warps=cfg["num_warps"],
    )
    _merge_kernel[(num_rows,)](
        top, stats, out, num_chunks, out.stride(0),
        NUM_RANKS=num_ranks, K=k, CHUNKS=triton.next_power_of_2(num_chunks), num_warps=cfg["merge_warps"],
    )
    return out


def compile_offline(dtype: torch.dtype, num_rows: int = 120, vocab: int = 151936, num_ranks: int = 16,
                    arch: int = 90, config: dict | None = None):
    """Compile both kernels for an NVIDIA target without a GPU (Triton's bundled ptxas), as a launch on
    16-aligned tensors would: a CI check of the compiled path. Needs triton imported without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert not interpreted(), "compile_offline needs triton imported without TRITON_INTERPRET"
    cfg = launch_config(num_rows, vocab, num_ranks, dtype, config)
    elem = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    target = GPUTarget("cuda", arch, 32)
    kernels = []
    for kernel, consts, types, warps in (
        (_chunk_kernel, {n: cfg[n] for n in ("K", "GROUPS", "ROWS", "TILES")},
         {"Logits": elem, "Top": "*fp32", "Stats": "*fp32"}, cfg["num_warps"]),
        (_merge_kernel, {"NUM_RANKS": num_ranks, "K": cfg["K"], "CHUNKS": triton.next_power_of_2(cfg["num_chunks"])},
         {"Top": "*fp32", "Stats": "*fp32", "Out": "*fp32"}, cfg["merge_warps"]),
    ):
        names = kernel.arg_names
        signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
        # NOTE: as the JIT launcher does for 16-aligned pointers and a row stride divisible by 16 (Qwen3's
        # vocabulary): it decides the vector width of the logit loads.
        aligned = [n for n in names if n in types or (n == "stride_row" and vocab % 16 == 0)]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        source = ASTSource(kernel, signature, constexprs=consts, attrs=attrs)
        kernels.append(triton.compile(source, target=target, options={"num_warps": warps}))
    return tuple(kernels)
