"""Triton paged attention over ragged packed rows: the prefill tile (64 / 128 rows) and the verify tile (16).

One program handles one (request, group of q heads sharing a kv head, query tile). The group's heads are
stacked with the tile's rows into the M dimension of the matrix products, so each K/V block is read
once for all of them: at Qwen3-8B's 4 q heads per kv head a 16-row verify tile is a 64-row product,
where a 128-row prefill tile over a 16-row query would be 7/8 empty and read K/V once per q head.
Keys are read through the block table; softmax is online, in fp32. Grid (N, H / heads_per_program,
ceil(max_q / tile_rows)) uses only static sizes; every program reads its query bounds and kv_len on the
device, so a launch never needs a host read and is safe to capture in a CUDA graph.

Split-KV (flash-decoding), for few long requests: with `meta.kv_splits` = S > 1 the grid's last axis holds S
programs per query tile. Each request splits on the device into n = clamp(cdiv(kv_len, MIN_KEYS_PER_SPLIT), 1, S)
chunks of whole key blocks; programs past n exit. A request of one split is written directly; one of several
writes fp32 partials (unnormalised acc, running max m, sum l) to a per-call workspace [S, T, H, D] + [S, T, H] x 2,
and `_combine_splits_kernel` (grid (N, H, row tiles), static) merges them into the output. kv_splits=1 compiles
to the kernel without splits.

This module imports triton at import time: import it only through `dscale_runtime.kernels`, which does so
lazily. CUDA tensors run the compiled kernel; with TRITON_INTERPRET=1 set before triton is imported, the
kernel runs in Triton's interpreter, on CPU tensors too (the CPU tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.kernels import TILE_ROWS, heads_per_program, tile_rows_for
from dscale_runtime.kernels.triton_fused import interpreted, require_interpreter_on_cpu

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Split-KV (meta.kv_splits > 1): a request splits its keys over at most kv_splits programs, one per this many
# keys at least (16 key blocks of 64 in 16-bit). A split writes an fp32 partial of its stacked rows (64 x 128 x
# 4 = 32 KiB at Qwen3-8B's verify tile) that the combine reads back: ~6% over the 512 KiB of K/V its 1024
# keys read (12% at the 128-row prefill tile), where 2048 would halve that but leave a 16-row chunk over 8K
# keys at 8 x 8 = 64 busy programs on 132 SMs (16K keys: 16 splits, 128 programs). Contexts under 2 x this
# never split (verify / decode over short contexts: one program, output written directly, no combine).
MIN_KEYS_PER_SPLIT = 1024
COMBINE_ROWS = 16  # query rows per program of the combine kernel


@triton.jit
def _attend_block(q, m_i, l_i, acc, start, kv_hi, pos, table, max_pages, K, V, stride_ks, stride_vs, offs_d, d_ok,
                  qk_scale, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N); K/V already offset to the kv head.
    MASKED=False: every key of the block is below kv_hi and visible to every row (no masks)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_ok = offs_n < kv_hi
        page = tl.load(table + tl.minimum(offs_n // PAGE_SIZE, max_pages - 1), mask=n_ok, other=0)
        kv_mask = n_ok[:, None] & d_ok[None, :]
    else:
        page = tl.load(table + offs_n // PAGE_SIZE)
        kv_mask = d_ok[None, :]
    slot = page.to(tl.int64) * PAGE_SIZE + offs_n % PAGE_SIZE  # [BLOCK_N]
    k_ptrs = K + slot[:, None] * stride_ks + offs_d[None, :]  # [BLOCK_N, BLOCK_D]
    v_ptrs = V + slot[:, None] * stride_vs + offs_d[None, :]
    if MASKED or not EVEN_D:
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptrs)
    if INTERPRET:  # NOTE: the interpreter's tl.dot mishandles 16-bit floats; it computes in fp32
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, BLOCK_N], log2 domain
    if MASKED:
        visible = n_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED or not EVEN_D:
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_ptrs)
    if INTERPRET:
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    Q, K, V, Out,  # q [T, H, D]; k/v cache [num_slots, KVH, D]; out [T, H, D]
    query_starts, query_lens, positions, kv_lens, block_tables,  # [N], [N], [T], [N], [N, max_pages]
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt,
    max_pages, qk_scale,  # qk_scale = softmax scale x log2(e)
    PartAcc, PartM, PartL,  # split partials (SPLITS > 1 only): acc [S, T, H, D], m / l [S, T, H], fp32
    stride_as, stride_at, stride_ah, stride_ms, stride_mt, stride_mh,  # (m and l share one layout)
    min_keys,  # keys per split at least (MIN_KEYS_PER_SPLIT); SPLITS > 1 only
    GROUP: tl.constexpr,  # q heads per kv head
    HEADS: tl.constexpr,  # q heads stacked in one program (divides GROUP)
    TILE: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per iteration
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two >= 16
    EVEN_D: tl.constexpr,  # BLOCK_D == HEAD_DIM
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision ("ieee" keeps fp32 inputs exact)
    INTERPRET: tl.constexpr,  # Triton's interpreter (see the NOTE at the key loops)
    SPLITS: tl.constexpr = 1,  # most programs sharing one request's keys (1: no split, no partials)
):
    req = tl.program_id(0)
    head0 = tl.program_id(1) * HEADS
    if SPLITS == 1:
        tile = tl.program_id(2)
    else:
        tile = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
    kv_head = head0 // GROUP

    q_start = tl.load(query_starts + req)
    q_len = tl.load(query_lens + req)
    # NOTE: a request with rows but no keys attends to its key 0, as the portable path does (no NaN).
    kv_len = tl.maximum(tl.load(kv_lens + req), 1)

    offs_m = tl.arange(0, TILE * HEADS)  # stacked (head, row) index
    local = tile * TILE + offs_m % TILE  # [M] row inside the request's query
    head = head0 + offs_m // TILE  # [M]
    if SPLITS > 1:
        # The request's split count and key chunk, from its kv_len (the same for all its tiles and for the
        # combine kernel): n_splits = clamp(cdiv(kv_len, min_keys), 1, SPLITS), chunks of whole key blocks.
        n_splits = tl.minimum(tl.cdiv(kv_len, min_keys), SPLITS)
        chunk = tl.cdiv(tl.cdiv(kv_len, n_splits), BLOCK_N) * BLOCK_N
        # NOTE: programs past the request's splits do no work. Masks combined with a scalar condition are
        # built as integer bounds: the interpreter turns `bool[M] & bool` into an int mask it cannot load with.
        q_len = tl.where(split < n_splits, q_len, 0)
    row_ok = local < q_len
    rows = q_start + local
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(Q + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, BLOCK_D]
    if INTERPRET:
        q = q.to(tl.float32)
    # Keys [0, kv_full) are visible to every row of the tile; [kv_full, kv_hi) need masks.
    if CAUSAL:
        pos = tl.load(positions + rows, mask=row_ok, other=-1)  # [M]
        kv_hi = tl.minimum(kv_len, tl.max(pos, 0) + 1)
        kv_full = tl.minimum(kv_len, tl.min(tl.where(row_ok, pos, kv_len), 0) + 1)
    else:
        pos = tl.zeros([TILE * HEADS], dtype=tl.int64)
        kv_hi = kv_len
        kv_full = kv_len
    kv_hi = tl.where(tile * TILE < q_len, kv_hi, 0).to(tl.int32)  # tiles past the query do no work
    kv_full = (tl.minimum(kv_full, kv_hi) // BLOCK_N * BLOCK_N).to(tl.int32)
    # This program's keys: unmasked blocks [lo, kv_full), masked ones [kv_full, kv_hi). With splits, the keys
    # [split x chunk, (split + 1) x chunk) of the tile's [0, kv_hi); chunk edges are whole blocks, so a
    # masked block still ends at a chunk edge or at kv_hi, and the masks against kv_hi stay right. A split
    # past the tile's keys (a causal tile early in the chunk) walks nothing: l = 0, weight 0 in the combine.
    if SPLITS == 1:
        lo = 0
    else:
        lo = (split * chunk).to(tl.int32)
        kv_hi = tl.minimum(kv_hi, lo + chunk).to(tl.int32)
        kv_full = tl.maximum(tl.minimum(kv_full, kv_hi), lo).to(tl.int32)

    # NOTE: m starts finite, so fully masked scores (-inf) give p = 0 and alpha = 1, never inf - inf.
    m_i = tl.full([TILE * HEADS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([TILE * HEADS], dtype=tl.float32)
    acc = tl.zeros([TILE * HEADS, BLOCK_D], dtype=tl.float32)
    table = block_tables + req * stride_bt
    K = K + kv_head * stride_kh
    V = V + kv_head * stride_vh
    # NOTE: the interpreter cannot take a loaded value as a `range` bound under numpy >= 2 (it converts the
    # 1-element array with int()), so it walks the same blocks with while loops; compiled code keeps `for`
    # loops, which Triton software-pipelines (num_stages).
    if INTERPRET:
        start = lo
        while start < kv_full:
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, start, kv_hi, pos, table, max_pages, K, V, stride_ks,
                                          stride_vs, offs_d, d_ok, qk_scale, BLOCK_N, PAGE_SIZE, False, CAUSAL,
                                          EVEN_D, PRECISION, INTERPRET)
            start += BLOCK_N
        while start < kv_hi:
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, start, kv_hi, pos, table, max_pages, K, V, stride_ks,
                                          stride_vs, offs_d, d_ok, qk_scale, BLOCK_N, PAGE_SIZE, True, CAUSAL,
                                          EVEN_D, PRECISION, INTERPRET)
            start += BLOCK_N
    else:
        for start in range(lo, kv_full, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, start, kv_hi, pos, table, max_pages, K, V, stride_ks,
                                          stride_vs, offs_d, d_ok, qk_scale, BLOCK_N, PAGE_SIZE, False, CAUSAL,
                                          EVEN_D, PRECISION, INTERPRET)
        for start in range(kv_full, kv_hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, start, kv_hi, pos, table, max_pages, K, V, stride_ks,
                                          stride_vs, offs_d, d_ok, qk_scale, BLOCK_N, PAGE_SIZE, True, CAUSAL,
                                          EVEN_D, PRECISION, INTERPRET)
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # One split: the output itself. Several: the unnormalised partial (acc, m, l) for the combine kernel.
        out_ok = local < tl.where(n_splits == 1, q_len, 0)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=out_ok[:, None] & d_ok[None, :])
        part_ok = local < tl.where(n_splits > 1, q_len, 0)
        tl.store(PartAcc + split * stride_as + rows[:, None] * stride_at + head[:, None] * stride_ah
                 + offs_d[None, :], acc, mask=part_ok[:, None] & d_ok[None, :])
        ml = split * stride_ms + rows * stride_mt + head * stride_mh
        tl.store(PartM + ml, m_i, mask=part_ok)
        tl.store(PartL + ml, l_i, mask=part_ok)


@triton.jit
def _combine_splits_kernel(
    Out, PartAcc, PartM, PartL,  # out [T, H, D]; acc [S, T, H, D], m / l [S, T, H] (fp32)
    query_starts, query_lens, kv_lens,  # [N]
    stride_ot, stride_oh, stride_as, stride_at, stride_ah, stride_ms, stride_mt, stride_mh,
    min_keys,
    SPLITS: tl.constexpr,
    ROWS: tl.constexpr,  # query rows per program
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = sum_s 2^(m_s - m*) acc_s / sum_s 2^(m_s - m*) l_s (m* = max_s m_s) over a request's splits, for one
    (request, q head, row tile); requests of one split were written by the attention kernel and are skipped. A
    split that saw no key of a row has m = -1e30 and l = acc = 0: weight 0."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_starts + req)
    q_len = tl.load(query_lens + req)
    kv_len = tl.maximum(tl.load(kv_lens + req), 1)
    n_splits = tl.minimum(tl.cdiv(kv_len, min_keys), SPLITS)
    local = tl.program_id(2) * ROWS + tl.arange(0, ROWS)
    q_len = tl.where(n_splits > 1, q_len, 0)  # (integer bounds for the masks: see the attention kernel)
    row_ok = local < q_len
    rows = q_start + local
    offs_d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    ml = rows * stride_mt + head * stride_mh
    # One pass, rescaled as the max grows (a rolled loop: unrolled, the splits' loads all stay live and spill).
    m_max = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    num = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([ROWS], dtype=tl.float32)
    for s in range(SPLITS):
        ok = local < tl.where(s < n_splits, q_len, 0)
        m_s = tl.load(PartM + s * stride_ms + ml, mask=ok, other=-1.0e30)
        l_s = tl.load(PartL + s * stride_ms + ml, mask=ok, other=0.0)
        acc = tl.load(PartAcc + s * stride_as + rows[:, None] * stride_at + head * stride_ah + offs_d[None, :],
                      mask=ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
        m_new = tl.maximum(m_max, m_s)
        alpha = tl.exp2(m_max - m_new)
        w = tl.exp2(m_s - m_new)
        num = num * alpha[:, None] + w[:, None] * acc
        den = den * alpha + w * l_s
        m_max = m_new
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=mask)



def launch_config(dtype: torch.dtype, stacked_rows: int, head_dim: int) -> dict:
    """Key block and warps for one program of `stacked_rows` query rows. 16-bit inputs at head_dim <= 128
    compile without spills for sm_90; fp32 (exact `ieee` products on FMA units) needs small key blocks."""
    if dtype == torch.float32:
        return {"BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_N": 64 if head_dim <= 128 else 32, "num_warps": 8 if stacked_rows >= 128 else 4, "num_stages": 2}


@functools.cache
def _static_constants(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, tile: int,
                      page_size: int, causal: bool) -> dict:
    group = num_heads // num_kv_heads
    heads = heads_per_program(group, tile)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16; extra lanes are masked
    return dict(GROUP=group, HEADS=heads, TILE=tile, HEAD_DIM=head_dim, BLOCK_D=block_d, EVEN_D=block_d == head_dim,
                PAGE_SIZE=page_size, CAUSAL=causal, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                INTERPRET=interpreted(), **launch_config(dtype, tile * heads, head_dim))


def kernel_constants(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, tile: int,
                     page_size: int, causal: bool, config: dict | None = None) -> dict:
    """The kernel's compile-time arguments and launch options: they depend on static sizes only (built once
    per shape: this runs for every layer of every forward). `config` overrides BLOCK_N / num_warps / num_stages
    (tuning). Returns a fresh dict the caller may modify."""
    return {**_static_constants(dtype, num_heads, num_kv_heads, head_dim, tile, page_size, causal), **(config or {})}


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D] (this layer)
    v_cache: torch.Tensor,  # [num_slots, KVH, D]
    meta: AttentionMetadata,
    page_size: int,
    scale: float,
    tile_rows: int | None = None,
    out: torch.Tensor | None = None,  # [T, H, D], written in place when given
    config: dict | None = None,  # BLOCK_N / num_warps / num_stages overrides (tuning)
) -> torch.Tensor:  # [T, H, D]
    """Ragged paged attention, same contract as `paged_attention_ref`. `tile_rows` forces the query tile
    (16, 32, 64, 128; default by `tile_rows_for(meta.max_q)`): the launch depends only on static sizes."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    assert q.dtype in _DTYPES and k_cache.dtype == v_cache.dtype == q.dtype, (q.dtype, k_cache.dtype)
    assert num_heads % num_kv_heads == 0 and k_cache.shape[2] == head_dim
    assert q.device == k_cache.device == v_cache.device
    tile = tile_rows or tile_rows_for(meta.max_q)
    assert tile in TILE_ROWS, f"tile_rows must be one of {TILE_ROWS}, got {tile}"
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
    if num_rows == 0:
        return out
    require_interpreter_on_cpu(q, "Triton attention", "attention")
    consts = kernel_constants(q.dtype, num_heads, num_kv_heads, head_dim, tile, page_size, meta.causal, config)
    splits = int(getattr(meta, "kv_splits", 1))
    assert splits >= 1, f"kv_splits must be >= 1, got {splits}"
    starts, lens = meta.query_bounds()
    tables = meta.block_tables
    grid = (meta.num_requests, num_heads // consts["HEADS"], triton.cdiv(meta.max_q, tile) * splits)
    if splits == 1:  # no partials: the kernel never touches these arguments
        part_acc = part_m = part_l = out
        part_strides = (0,) * 6
    else:  # NOTE: torch.empty on the current stream (the graph's pool inside a capture); no host read
        part_acc = torch.empty(splits, num_rows, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(splits, num_rows, num_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        assert part_acc.numel() < 2**31, "split workspace too large for int32 offsets: lower kv_splits"
        part_strides = (*part_acc.stride()[:3], *part_m.stride())
    min_keys = max(1, int(MIN_KEYS_PER_SPLIT))
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        starts, lens, meta.positions, meta.kv_lens, tables,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), tables.stride(0),
        tables.shape[1], scale * 1.4426950408889634,
        part_acc, part_m, part_l, *part_strides, min_keys, SPLITS=splits, **consts,
    )
    if splits > 1:
        rows = min(COMBINE_ROWS, triton.next_power_of_2(meta.max_q))
        _combine_splits_kernel[(meta.num_requests, num_heads, triton.cdiv(meta.max_q, rows))](
            out, part_acc, part_m, part_l, starts, lens, meta.kv_lens,
            out.stride(0), out.stride(1), *part_strides, min_keys,
            SPLITS=splits, ROWS=rows, HEAD_DIM=head_dim, BLOCK_D=consts["BLOCK_D"], num_warps=4,
        )
    return out


def compile_offline(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, tile: int, causal: bool,
                    page_size: int = 16, arch: int = 90, config: dict | None = None, kv_splits: int = 1):
    """Compile the kernel for an NVIDIA target without a GPU (Triton's bundled ptxas), as a launch on aligned
    tensors would: a CI check of the compiled path. Needs triton imported without TRITON_INTERPRET.
    `kv_splits` > 1 builds the split-KV variant (`compile_combine_offline` builds its combine kernel)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert not interpreted(), "compile_offline needs triton imported without TRITON_INTERPRET"
    consts = kernel_constants(dtype, num_heads, num_kv_heads, head_dim, tile, page_size, causal, config)
    consts["SPLITS"] = kv_splits
    options = {"num_warps": consts.pop("num_warps"), "num_stages": consts.pop("num_stages")}
    elem = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    names = _paged_attention_kernel.arg_names
    signature = {n: "constexpr" if n in consts else elem if n in ("Q", "K", "V", "Out") else
                 "*fp32" if n.startswith("Part") else "fp32" if n == "qk_scale" else
                 "i32" if n.startswith("stride") or n in ("max_pages", "min_keys") else "*i64"
                 for n in names}
    # NOTE: as the JIT launcher does for 16-aligned pointers and 16-divisible integers (contiguous tensors with
    # head_dim % 16 == 0), tell the compiler so: it decides the vector width of the K/V loads. The strides of the
    # split m / l ([S, T, H]) and of the block tables have no such guarantee.
    aligned = [n for n in names if signature[n].startswith("*") or
               (n.startswith("stride") and n != "stride_bt" and not n.startswith("stride_m"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if head_dim % 16 == 0 or "stride" not in n}
    source = ASTSource(_paged_attention_kernel, signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_combine_offline(dtype: torch.dtype, head_dim: int, kv_splits: int, arch: int = 90):
    """The split-KV combine kernel compiled for an NVIDIA target without a GPU, as `compile_offline`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    assert not interpreted(), "compile_combine_offline needs triton imported without TRITON_INTERPRET"
    consts = dict(SPLITS=kv_splits, ROWS=COMBINE_ROWS, HEAD_DIM=head_dim,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    elem = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}[dtype]
    names = _combine_splits_kernel.arg_names
    signature = {n: "constexpr" if n in consts else elem if n == "Out" else "*fp32" if n.startswith("Part") else
                 "i32" if n.startswith("stride") or n == "min_keys" else "*i64" for n in names}
    source = ASTSource(_combine_splits_kernel, signature, constexprs=consts)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
