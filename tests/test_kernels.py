"""Triton paged attention against the portable oracle `paged_attention_ref`, the router, graphs, the engine.

The same cases run twice: through Triton's interpreter on CPU machines with triton installed (conftest sets
TRITON_INTERPRET=1 when there is no CUDA device), and compiled on CUDA (marker `gpu`, bf16/fp16/fp32).
Every call writes into a NaN-poisoned buffer with guard rows around it: rows left unwritten, NaN outputs
and writes outside the rows all fail. The oracle always runs in fp32 on the same inputs.
"""

from __future__ import annotations

import dataclasses
import random
import warnings

import pytest
import torch

from markers import needs_cuda, needs_triton
from dscale_runtime.attention import build_metadata, paged_attention_ref
from dscale_runtime.dvl.pack import flat_pack, packed_metadata
from dscale_runtime.kernels import (
    attention_backend,
    heads_per_program,
    paged_attention,
    tile_rows_for,
)

W = 16  # verification block


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    query_lens: tuple[int, ...]  # rows per request (the verify lengths k when `packed_rows` is set)
    ctx_lens: tuple[int, ...]  # keys before the rows
    heads: tuple[int, int, int] = (4, 2, 64)  # q heads, kv heads, head_dim
    causal: bool = True
    page_size: int = 16
    tile_rows: int | None = None  # forced query tile (None: the router's choice)
    packed_rows: int | None = None  # DScale flat-pack into this many rows (placeholders after the live ones)
    no_keys: tuple[int, ...] = ()  # requests whose kv_len is forced to 0: their rows see nothing


def _lens(seed: int, n: int, lo: int, hi: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randint(lo, hi) for _ in range(n))


def _budget_lens(seed: int, n: int, total: int, inactive: int = 0) -> tuple[int, ...]:
    """Verify lengths k in 1..W summing to `total` (Algorithm 1's budget), the first `inactive` set to 0."""
    rng = random.Random(seed)
    k = [0] * inactive + [1] * (n - inactive)
    while sum(k) < total:
        i = rng.randrange(inactive, n)
        k[i] += k[i] < W
    return tuple(k)


RAGGED_Q, RAGGED_CTX = _lens(1, 6, 1, 16), _lens(2, 6, 0, 90)
PACK_K = (5, 0, 16, 1, 9)  # one inactive request (k = 0)
PACK_CTX = (37, 12, 0, 64, 18)
CASES = [
    Case("verify16-mha", (16, 16, 16), (5, 40, 77), heads=(4, 4, 64)),
    Case("verify16-gqa2", (16, 16, 16), (5, 40, 77)),
    Case("verify16-gqa2-block", (16, 16, 16), (5, 40, 77), causal=False),  # the DFlash drafter block
    Case("verify16-gqa4-d128", (16, 16, 16, 16), (0, 17, 33, 64), heads=(8, 2, 128)),
    Case("ragged", RAGGED_Q, RAGGED_CTX),
    Case("ragged-gqa4", RAGGED_Q, RAGGED_CTX, heads=(8, 2, 64)),
    Case("ragged-tile32", RAGGED_Q, RAGGED_CTX, tile_rows=32),
    Case("ragged-tile128", RAGGED_Q, RAGGED_CTX, heads=(8, 2, 64), tile_rows=128),
    Case("decode", (1, 1, 1, 1), (1, 15, 16, 50)),
    Case("packed", PACK_K, PACK_CTX, heads=(8, 2, 64), packed_rows=sum(PACK_K) + 3),
    Case("packed-tile128", PACK_K, PACK_CTX, heads=(8, 2, 64), packed_rows=sum(PACK_K) + 3, tile_rows=128),
    Case("packed-full", (8, 3, 13), (20, 0, 45), heads=(4, 1, 64), packed_rows=24),
    Case("prefill", (200, 37, 0, 90), (0, 0, 0, 21)),  # request 2 inactive, kv_len 0
    Case("prefill-tile64", (200, 37, 0, 90), (0, 0, 0, 21), tile_rows=64),
    Case("prefill-tile16", (130, 37), (0, 21), tile_rows=16),
    Case("prefill-block", (70, 33), (5, 0), causal=False),
    Case("no-keys", (3, 16, 2), (0, 10, 5), no_keys=(0, 2)),
    Case("no-keys-block", (3, 16, 2), (0, 10, 5), causal=False, no_keys=(0, 2)),
    Case("page8", RAGGED_Q, RAGGED_CTX, page_size=8),
    Case("page12", RAGGED_Q, RAGGED_CTX, page_size=12),
    Case("page1", (4, 16), (9, 3), page_size=1),
    Case("d80", RAGGED_Q[:3], RAGGED_CTX[:3], heads=(4, 2, 80)),
    Case("d8", RAGGED_Q[:3], RAGGED_CTX[:3], heads=(4, 2, 8)),  # the tiny test checkpoints' head size
]
CASE = {c.name: c for c in CASES}
# Qwen3-8B attention shape (32 q heads, 8 kv heads, head_dim 128): on the device only.
GPU_CASES = [
    Case("8b-verify16", (16,) * 8, _lens(3, 8, 300, 1100), heads=(32, 8, 128)),
    Case("8b-verify16-tile128", (16,) * 8, _lens(3, 8, 300, 1100), heads=(32, 8, 128), tile_rows=128),
    Case("8b-packed", _budget_lens(4, 8, 64), _lens(5, 8, 300, 1100), heads=(32, 8, 128), packed_rows=64),
    Case("8b-packed-tail", _budget_lens(7, 8, 53, 2), _lens(8, 8, 300, 1100), heads=(32, 8, 128), packed_rows=64),
    Case("8b-block", (16,) * 8, _lens(6, 8, 300, 1100), heads=(32, 8, 128), causal=False),
    Case("8b-prefill", (500, 129, 1), (0, 0, 700), heads=(32, 8, 128)),
]


def build(case: Case, dtype: torch.dtype, device: str, seed: int = 0, num_pages: int | None = None,
          table_width: int | None = None):
    """Random q and paged caches (pages scattered in random order, page 0 scratch) and the case's metadata.
    `num_pages` / `table_width` fix the cache and block-table sizes (graph replays need fixed shapes)."""
    gen = torch.Generator().manual_seed(seed)
    h, kvh, d, ps = *case.heads, case.page_size
    packed = case.packed_rows is not None
    tokens = [c + (W if packed else q) for q, c in zip(case.query_lens, case.ctx_lens)]
    counts = [-(-t // ps) for t in tokens]
    num_pages = num_pages or 1 + sum(counts) + 2
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    tables = [order[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]
    width = table_width or max(counts)
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    k_cache = torch.randn(num_pages * ps, kvh, d, generator=gen)
    v_cache = torch.randn(num_pages * ps, kvh, d, generator=gen)
    if packed:
        ctx = torch.tensor(case.ctx_lens, device=device)
        k = torch.tensor(case.query_lens, device=device)
        drafts = torch.zeros(len(tables), W, dtype=torch.long, device=device)
        pack = flat_pack(k, drafts, ctx, table_t, case.packed_rows, ps)
        max_kv = max(c + q for q, c in zip(case.query_lens, case.ctx_lens))
        meta = packed_metadata(pack, ctx, table_t, max_kv, W)
        num_rows = case.packed_rows
    else:
        meta = build_metadata(list(case.query_lens), list(case.ctx_lens), tables, ps, device, causal=case.causal)
        meta.block_tables = table_t
        num_rows = sum(case.query_lens)
    for i in case.no_keys:
        meta.kv_lens[i] = 0
    q = torch.randn(num_rows, h, d, generator=gen)
    return q.to(device, dtype), k_cache.to(device, dtype), v_cache.to(device, dtype), meta


def check_against_ref(case: Case, dtype: torch.dtype, device: str, atol: float, seed: int = 0) -> None:
    q, k_cache, v_cache, meta = build(case, dtype, device, seed)
    scale = case.heads[2] ** -0.5
    want = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, case.page_size, scale)
    guard = 5
    buf = torch.full((q.shape[0] + 2 * guard, *q.shape[1:]), float("nan"), dtype=dtype, device=device)
    out = buf[guard : guard + q.shape[0]]
    k_before, v_before = k_cache.clone(), v_cache.clone()
    got = paged_attention(q, k_cache, v_cache, meta, case.page_size, scale, backend="triton",
                          tile_rows=case.tile_rows, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert buf[:guard].isnan().all() and buf[guard + q.shape[0] :].isnan().all(), "wrote outside its rows"
    assert out.isfinite().all(), f"rows left unwritten or NaN: {out.isnan().any(-1).any(-1).nonzero().flatten()}"
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=atol)
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)


# ------------------------------------------------------------------------------------------------ router
def test_tile_routing_rule():
    assert [tile_rows_for(m) for m in (1, 8, 16, 17, 64, 65, 200)] == [16, 16, 16, 64, 64, 128, 128]
    # Qwen3-8B (group 4): 4 heads x 16 rows per verify program, one head per 128-row prefill program.
    assert heads_per_program(4, 16) == 4 and heads_per_program(4, 128) == 1 and heads_per_program(4, 64) == 2
    assert heads_per_program(3, 16) == 1 and heads_per_program(8, 16) == 8 and heads_per_program(16, 16) == 8


def test_router_on_cpu_is_exactly_the_portable_path(monkeypatch):
    q, k_cache, v_cache, meta = build(CASE["ragged"], torch.float32, "cpu")
    assert attention_backend(q) == "ref" and attention_backend(q, "ref") == "ref"
    # The router takes its path from the caller only: settings in the environment are not read per call.
    monkeypatch.setenv("DSCALE_ATTENTION", "flash")
    monkeypatch.setenv("DSCALE_ATTENTION_TILE", "48")
    want = paged_attention_ref(q, k_cache, v_cache, meta, 16, 0.125)
    assert torch.equal(paged_attention(q, k_cache, v_cache, meta, 16, 0.125), want)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, k_cache, v_cache, meta, 16, 0.125, backend="ref", out=out)
    assert got is out and torch.equal(out, want)


def test_router_names_bad_settings():
    q = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="backend='cuda'"):
        attention_backend(q, "cuda")
    with pytest.raises(ValueError, match="backend=None"):
        attention_backend(q, None)


def test_query_bounds_derived_on_device():
    case = CASE["packed"]  # an inactive request and 3 placeholders
    _, _, _, meta = build(case, torch.float32, "cpu")
    starts, lens = meta.query_bounds()
    k = list(case.query_lens)
    assert lens.tolist() == k + [3]
    assert starts.tolist() == [sum(k[:i]) for i in range(len(k) + 1)]
    _, _, _, meta = build(CASE["prefill"], torch.float32, "cpu")  # build_metadata fills them; derivation agrees
    given = [t.clone() for t in meta.query_bounds()]
    meta.query_starts = meta.query_lens = None
    assert all(torch.equal(a, b) for a, b in zip(given, meta.query_bounds()))


# ----------------------------------------------------------------------------------- Triton interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpreter_matches_ref(interpreter, case):
    check_against_ref(case, torch.float32, "cpu", atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_interpreter_half_precision(interpreter, dtype):
    check_against_ref(CASE["packed"], dtype, "cpu", atol=2e-2 if dtype == torch.bfloat16 else 3e-3)


# Split-KV: contexts of a few hundred keys, MIN_KEYS_PER_SPLIT patched down to 64 so that they really split
# (fp32 key blocks of 16: 300 keys in 4 chunks of 80; bf16 blocks of 64: chunks of 128, the 4th split empty),
# beside requests under 64 keys (one split: written directly, no combine) and empty request slots.
SPLIT_MIN_KEYS = 64
SPLIT_CASES = [
    # GQA 4 with 4 stacked heads per 16-row program; an empty slot (0 rows, 0 keys) and one-row decodes.
    Case("split-verify-gqa4", (3, 16, 1, 0, 9), (300, 50, 17, 0, 230), heads=(8, 2, 16)),
    # Causal prefill chunks: 40 rows after 260 keys, and 70 rows from position 0 (128-row tile: rows 0..63
    # see no key of the later splits; the tile's early rows get l = 0 partials of weight 0).
    Case("split-prefill-chunk", (40, 70, 0), (260, 0, 0), heads=(4, 2, 16)),
    Case("split-block", (16, 5), (290, 3), heads=(4, 2, 16), causal=False),  # the DFlash drafter block
    # DScale flat pack: an inactive request and placeholder rows in the last (pseudo) request.
    Case("split-packed", (5, 0, 16, 9), (300, 12, 280, 40), heads=(8, 2, 16), packed_rows=33),
    Case("split-no-keys-page8", (3, 16), (0, 200), heads=(4, 1, 16), no_keys=(0,), page_size=8),
]
CASE_SPLIT = {c.name: c for c in SPLIT_CASES}


def _with_splits(monkeypatch, kv_splits: int, min_keys: int = SPLIT_MIN_KEYS):
    """paged_attention with meta.kv_splits set (MIN_KEYS_PER_SPLIT patched) for check_against_ref."""
    from dscale_runtime.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "MIN_KEYS_PER_SPLIT", min_keys)
    original = triton_attention.paged_attention_triton

    def split_call(q, k_cache, v_cache, meta, *args, **kwargs):
        return original(q, k_cache, v_cache, dataclasses.replace(meta, kv_splits=kv_splits), *args, **kwargs)

    monkeypatch.setattr(triton_attention, "paged_attention_triton", split_call)


@pytest.mark.parametrize("kv_splits", [2, 4])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.name)
def test_interpreter_split_kv_matches_ref(interpreter, monkeypatch, case, kv_splits):
    assert max(map(sum, zip(case.query_lens, case.ctx_lens))) > 3 * SPLIT_MIN_KEYS  # some request splits 4 ways
    _with_splits(monkeypatch, kv_splits)
    check_against_ref(case, torch.float32, "cpu", atol=1e-5)


def test_interpreter_split_kv_half_precision(interpreter, monkeypatch):
    _with_splits(monkeypatch, 4)
    check_against_ref(SPLIT_CASES[0], torch.bfloat16, "cpu", atol=2e-2)


def test_interpreter_split_kv_launches(interpreter, monkeypatch):
    """kv_splits=1 is the kernel as before: one launch over the same grid, no partials, no combine (the 46 outputs
    of CASES were checked bit for bit against the kernel before split-KV). With splits, requests that get one
    split are written by the attention kernel itself: bit-identical to kv_splits=1."""
    from dscale_runtime.kernels import triton_attention

    case = CASE_SPLIT["split-block"]
    q, k_cache, v_cache, meta = build(case, torch.float32, "cpu")
    launches = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **k: launches.append((self.kernel, grid, k.get("SPLITS"))) or self.kernel[grid](*a, **k)

    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Spy(triton_attention._paged_attention_kernel))
    monkeypatch.setattr(triton_attention, "_combine_splits_kernel", Spy(triton_attention._combine_splits_kernel))
    monkeypatch.setattr(triton_attention, "interpreted", lambda: True)
    scale = case.heads[2] ** -0.5
    base = paged_attention(q, k_cache, v_cache, meta, case.page_size, scale, backend="triton")
    assert [(g, s) for _, g, s in launches] == [((2, 2, 1), 1)]  # (requests, head groups, query tiles)
    monkeypatch.setattr(triton_attention, "MIN_KEYS_PER_SPLIT", 10**6)  # every request gets one split
    launches.clear()
    one = paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, kv_splits=4), case.page_size, scale,
                          backend="triton")
    assert [(g, s) for _, g, s in launches] == [((2, 2, 4), 4), ((2, 4, 1), 4)]  # attention, combine
    assert torch.equal(one, base)
    monkeypatch.setattr(triton_attention, "MIN_KEYS_PER_SPLIT", SPLIT_MIN_KEYS)
    split = paged_attention(q, k_cache, v_cache, dataclasses.replace(meta, kv_splits=4), case.page_size, scale,
                            backend="triton")
    short = (meta.kv_lens <= SPLIT_MIN_KEYS)[meta.row_req]  # requests of one split: written directly
    assert torch.equal(split[short], base[short]) and not torch.equal(split[~short], base[~short])


def test_kv_splits_for():
    from dscale_runtime.kernels import kv_splits_for

    # Qwen3-8B on 132 SMs: one request of 16 rows has 8 programs (4 stacked heads), of 512 rows 128 (1 head).
    assert kv_splits_for(1, 16, 32, 8, 132) == 16 and kv_splits_for(1, 512, 32, 8, 132) == 4
    assert kv_splits_for(8, 16, 32, 8, 132) == 8 and kv_splits_for(64, 16, 32, 8, 132) == 1
    assert kv_splits_for(1, 16, 32, 8, 132, max_splits=4) == 4


def greedy_tokens_by_backend(pair, predictor, prompts, max_tokens: int, monkeypatch, **config):
    """{mode: {backend: token lists}} for dflash and dscale, greedy, with DSCALE_ATTENTION, DSCALE_FUSED and
    DSCALE_FEATURES all set to the backend before each engine is built (the default source of the kernel
    choice the loader resolves once); asserts that the Triton paths ran exactly when asked for."""
    from dscale_runtime.config import EngineConfig, SamplingParams
    from dscale_runtime.engine import Engine
    from dscale_runtime.kernels import triton_attention, triton_features, triton_fused

    calls, fused_calls, feature_calls = [], [], []
    for module, name, log in ((triton_attention, "paged_attention_triton", calls),
                              (triton_fused, "add_rms_norm_triton", fused_calls),
                              (triton_features, "confidence_features_triton", feature_calls)):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _log=log, **k: _log.append(1) or _f(*a, **k))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens = {}
    for mode in ("dflash", "dscale"):
        for backend in ("ref", "triton"):
            for var in ("DSCALE_ATTENTION", "DSCALE_FUSED", "DSCALE_FEATURES"):
                monkeypatch.setenv(var, backend)
            before = (len(calls), len(fused_calls), len(feature_calls))
            cfg = EngineConfig(mode=mode, **config)
            engine = Engine.from_pretrained(pair[0], pair[1], predictor=predictor if mode == "dscale" else None,
                                            config=cfg)
            assert engine.runner.features_backend == backend  # chosen once, with the drafter's kernels
            tokens.setdefault(mode, {})[backend] = [o.token_ids for o in engine.generate(prompts, params)]
            ran = (len(calls) > before[0], len(fused_calls) > before[1], len(feature_calls) > before[2])
            assert ran == (backend == "triton", backend == "triton", backend == "triton" and mode == "dscale"), ran
    return tokens


def test_interpreter_engine_tokens_equal_portable_path(interpreter, tmp_path, monkeypatch):
    """The router inside the models: a tiny pair (head_dim 8) decodes the same greedy tokens through the
    interpreted kernels as through the portable path, in dflash and dscale mode (packed rows, drafter block)."""
    from checkpoints import write_drafter, write_target
    from test_engine_dscale import save_predictor

    pair = (write_target(tmp_path / "target", layers=2),
            write_drafter(tmp_path / "drafter", layers=1, target_layer_ids=(0, 1), num_target_layers=2))
    predictor = save_predictor(tmp_path, pair, "heuristic")
    prompts = [[5, 9, 2], [7] * 20, list(range(1, 18))]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: torch's CPU threads and the interpreter's numpy work slow each other down
    try:
        # NOTE: 3 tokens (a decode step or two per mode): in the interpreter the features kernel's tl.topk costs tens
        # of seconds per DScale step, most of this test's time (the kernel has its own tests in test_kernels_features)
        tokens = greedy_tokens_by_backend(pair, predictor, prompts, 3, monkeypatch, dtype="float32",
                                          max_running_requests=4, max_model_len=64, kv_cache_tokens=256)
    finally:
        torch.set_num_threads(threads)
    for mode, by_backend in tokens.items():
        assert by_backend["triton"] == by_backend["ref"], mode


@needs_triton
def test_compiled_kernel_builds_for_sm90_without_spills():
    """The compiled (non-interpreter) path, without a GPU: Triton's bundled ptxas builds the kernel for sm_90
    at the shapes the engine launches; the 16-bit Qwen3-8B configurations keep everything in registers."""
    from offline import run_without_interpreter

    lines = run_without_interpreter("""
import torch
from dscale_runtime.kernels import stack_usage
from dscale_runtime.kernels.triton_attention import compile_offline
for dtype, shape, tile, causal in [(torch.bfloat16, (32, 8, 128), 16, True), (torch.bfloat16, (32, 8, 128), 16, False),
                                   (torch.bfloat16, (32, 8, 128), 128, True), (torch.float16, (32, 8, 128), 64, True),
                                   (torch.float32, (6, 2, 64), 16, True), (torch.float32, (6, 2, 64), 128, True)]:
    print(str(dtype).split(".")[1], tile, causal, stack_usage(compile_offline(dtype, *shape, tile, causal)))
""")
    for line in lines:
        if line.startswith(("bfloat16", "float16")):
            assert line.endswith(("STACK:0", "?")), f"register spills: {line}"


@needs_triton
def test_compiled_split_kv_kernels_build_for_sm90_without_spills():
    """The split-KV attention kernel and its combine kernel, compiled for sm_90 without a GPU (as above)."""
    from offline import run_without_interpreter

    lines = run_without_interpreter("""
import torch
from dscale_runtime.kernels import stack_usage
from dscale_runtime.kernels.triton_attention import compile_combine_offline, compile_offline
for tile, causal, splits in [(16, True, 16), (128, False, 4)]:
    print("attention", tile, causal, splits, stack_usage(compile_offline(torch.bfloat16, 32, 8, 128, tile, causal,
                                                                          kv_splits=splits)))
for dtype, splits in [(torch.bfloat16, 16), (torch.float32, 4)]:
    print("combine", str(dtype).split(".")[1], splits, stack_usage(compile_combine_offline(dtype, 128, splits)))
""")
    assert len(lines) == 4
    for line in lines:
        assert line.endswith(("STACK:0", "?")), f"register spills: {line}"


# ----------------------------------------------------------------------------------------------- CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=lambda c: c.name)
@pytest.mark.gpu
@needs_cuda
def test_cuda_matches_ref(case, dtype):
    atol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}[dtype]
    for seed in range(2):
        check_against_ref(case, dtype, "cuda", atol, seed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tile", [16, 128])
def test_cuda_graph_replay_follows_the_metadata(tile):
    """Captured once, replayed over new verify lengths, contexts, pages and inputs copied into the captured
    buffers: the launch reads everything data-dependent on the device (a host read would break capture)."""
    fixed = {"num_pages": 8 * 58 + 8, "table_width": 60}  # 8 requests of up to 900 + 16 tokens
    # Budgets of 64 rows with 0..15 placeholders after them and up to two inactive requests.
    cases = [Case(f"graph{s}", _budget_lens(10 + s, 8, live, s % 3), _lens(20 + s, 8, 0, 900), heads=(32, 8, 128),
                  packed_rows=64, tile_rows=tile) for s, live in enumerate((64, 49, 57, 62))]
    fields = ("row_req", "row_local", "positions", "slot_mapping", "kv_lens", "block_tables")
    q, k_cache, v_cache, meta = build(cases[0], torch.bfloat16, "cuda", 0, **fixed)
    static = dataclasses.replace(meta, **{f: getattr(meta, f).clone() for f in fields})
    out = torch.empty_like(q)

    def run():
        paged_attention(q, k_cache, v_cache, static, 16, 128**-0.5, backend="triton", tile_rows=tile, out=out)

    run()  # compiles outside the capture
    static.query_starts = static.query_lens = None  # NOTE: derived inside the graph from the static row_req
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed, case in enumerate(cases):
        q_new, k_new, v_new, meta = build(case, torch.bfloat16, "cuda", seed, **fixed)
        for f in fields:
            getattr(static, f).copy_(getattr(meta, f))
        q.copy_(q_new), k_cache.copy_(k_new), v_cache.copy_(v_new), out.fill_(float("nan"))
        graph.replay()
        want = paged_attention_ref(q_new.float(), k_new.float(), v_new.float(), meta, 16, 128**-0.5)
        torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_engine_triton_path_equals_portable_path_on_the_demo_pair(tmp_path, monkeypatch):
    """fp32 demo pair on CUDA, dflash and dscale (artifacts/demo.pt): greedy tokens with the Triton path equal
    those with the portable path, token for token."""
    from test_engine_dscale import save_predictor

    from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
    from dscale_runtime.dvl.predictor import PredictorError, load_predictor, pair_identity
    from dscale_runtime.models.config import load_drafter_config, load_target_config

    pair = DEMO_DIR / "target", DEMO_DIR / "drafter"
    predictor = DEMO_DIR.parent / "demo.pt"
    try:
        load_predictor(predictor, pair_identity(load_target_config(pair[0]), load_drafter_config(pair[1])),
                       drafter_folder=pair[1])
    except PredictorError as exc:  # the artifact is checked by test_demo_pair; here it only picks lengths
        warnings.warn(f"{exc}; this test uses a heuristic predictor instead")
        predictor = save_predictor(tmp_path, pair, "heuristic")
    prompts = [p["prompt"] for p in stdlib_prompts()[:24]]
    tokens = greedy_tokens_by_backend(pair, predictor, prompts, 48, monkeypatch, device="cuda", dtype="float32",
                                      max_running_requests=12, max_model_len=1024)
    for mode, by_backend in tokens.items():
        same = sum(a == b for a, b in zip(by_backend["ref"], by_backend["triton"]))
        print(f"{mode}: {same}/{len(prompts)} prompts identical")
        assert by_backend["triton"] == by_backend["ref"], mode
