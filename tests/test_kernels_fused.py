"""Fused elementwise kernels (`kernels/triton_fused.py`) against their references (`kernels/fused.py`), and the router.

The kernels run through Triton's interpreter on CPU machines with triton installed (conftest sets
TRITON_INTERPRET=1 when there is no CUDA device), and compiled on CUDA (marker `gpu`, Qwen3-8B sizes).
Bit-exactness is asserted where the kernels claim it:
- the residual sum of add_rms_norm and every rounding point of the norms: on inputs whose fp32 sum of
  squares is exact in any order (a coarse grid), every norm output equals the reference bit for bit;
- silu_mul in bf16 for every bf16 gate value, and in fp32 / fp16 against the same sequence with the
  interpreter's `exp` (numpy's, whose last fp32 bit differs from torch's CPU `exp`).
On general inputs the norms' statistic is reduced in another order than torch's: 16-bit outputs stay within
2 ulps (1 on the normalised value, 1 more through the weight's product), fp32 within 2e-6 relative, and RoPE,
whose sum may cancel, within a few ulps of its two terms.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from markers import needs_cuda, needs_triton
from dscale_runtime.kernels import KernelChoice, fused
from dscale_runtime.kernels.fused import (
    add_rms_norm,
    add_rms_norm_ref,
    fused_backend,
    qk_norm_rope,
    qk_norm_rope_ref,
    rms_norm,
    rms_norm_ref,
    silu_mul,
    silu_mul_ref,
)
from dscale_runtime.models.layers import rope_cos_sin

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
NORM_SHAPES = [(0, 64), (1, 4096), (17, 384), (2, 8192), (5, 128)]  # (T, d)
HEAD_SHAPES = [(0, 4, 2, 128), (1, 4, 2, 128), (17, 4, 2, 64), (9, 6, 2, 128)]  # (T, H, KVH, D)


# ------------------------------------------------------------------------------------------------ inputs
def _gen(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, dtype, gen, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).to(dtype)


def on_grid(shape, dtype, gen, reach: int = 32) -> torch.Tensor:
    """Multiples of 1/16 in [-reach/16, reach/16]: squares and their fp32 sums over up to 8192 features are
    exact in any order, so any correct kernel gets torch's statistic exactly."""
    return (torch.randint(-reach, reach + 1, shape, generator=gen, device=gen.device) / 16).to(dtype)


def rope_tables(num_rows: int, head_dim: int, dtype, gen) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 40000, (num_rows,), generator=gen, device=gen.device)
    return rope_cos_sin(positions, head_dim, 1e6, dtype)


def qkv_views(num_rows, heads, kv_heads, head_dim, dtype, gen, values=randn):
    """The fused projection output [T, (H + 2 KVH) D] and its q and k views [T, H, D], [T, KVH, D] (row stride
    (H + 2 KVH) D, not H D)."""
    qkv = values((num_rows, (heads + 2 * kv_heads) * head_dim), dtype, gen)
    q = qkv[:, : heads * head_dim].view(num_rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_rows, kv_heads, head_dim)
    return qkv, q, k


# --------------------------------------------------------------------------------------------- checks
def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance between a and b in representable steps of their dtype (0 when bit-equal up to -0)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.numel() == 0:
        return 0
    bits = a.element_size() * 8
    ints = {16: torch.int16, 32: torch.int32}[bits]

    def ordered(t):  # sign-magnitude bit patterns -> integers in value order
        i = t.contiguous().view(ints).long()
        return torch.where(i < 0, -(i + (1 << (bits - 1))), i)

    return int((ordered(a) - ordered(b)).abs().max())


def assert_norm_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A norm on general inputs: see the module docstring for the bounds."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=0)
    else:
        assert ulp_distance(actual, expected) <= 2


def assert_rope_close(actual, x, weight, cos, sin):
    """|kernel - reference| within k ulps of the larger of the two RoPE terms (the sum may cancel)."""
    expected = qk_norm_rope_ref(x, weight, cos, sin, EPS)
    y = rms_norm_ref(x, weight, EPS).float()
    half = y.shape[-1] // 2
    rotated = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    scale = (y * cos.float()[:, None]).abs() + (rotated * sin.float()[:, None]).abs()
    k = 16 if x.dtype == torch.float32 else 4
    excess = (actual.float() - expected.float()).abs() - k * torch.finfo(x.dtype).eps * scale
    assert excess.numel() == 0 or excess.max() <= 0, float(excess.max())


def silu_mul_numpy_exp(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_mul_ref's sequence with numpy's exp (the interpreter's) in place of torch's."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[:, :inter].float()
    with np.errstate(over="ignore"):
        e = torch.from_numpy(np.exp(-gate.numpy()))
    silu = (gate / (1 + e)).to(gate_up.dtype)
    return silu * gate_up[:, inter:]


# ----------------------------------------------------------------------------------- Triton interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=str)
def test_interpreter_rms_norm(interpreter, shape, dtype):
    from dscale_runtime.kernels.triton_fused import rms_norm_triton

    gen = _gen(shape[0] * 7 + shape[1])
    weight = randn(shape[1], dtype, gen)
    x = on_grid(shape, dtype, gen)
    assert torch.equal(rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    x = randn(shape, dtype, gen, scale=3.0)
    out = torch.full_like(x, float("nan"))
    assert rms_norm_triton(x, weight, EPS, out=out) is out
    assert_norm_close(out, rms_norm_ref(x, weight, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_interpreter_rms_norm_views(interpreter, dtype):
    """[T, H, D] inputs (q_norm alone), a column slice with a row stride, and in place."""
    from dscale_runtime.kernels.triton_fused import rms_norm_triton

    gen = _gen(3)
    _, q, _ = qkv_views(7, 4, 2, 64, dtype, gen, on_grid)
    weight = randn(64, dtype, gen)
    assert torch.equal(rms_norm_triton(q, weight, EPS), rms_norm_ref(q, weight, EPS))
    wide = on_grid((9, 3 * 384), dtype, gen)
    rows = wide[:, 384 : 2 * 384]  # row stride 3 * 384
    weight = randn(384, dtype, gen)
    want = rms_norm_ref(rows, weight, EPS)
    assert torch.equal(rms_norm_triton(rows, weight, EPS), want)
    x = rows.contiguous()
    assert rms_norm_triton(x, weight, EPS, out=x) is x and torch.equal(x, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(0, 64), (1, 4096), (17, 384)], ids=str)
def test_interpreter_add_rms_norm(interpreter, shape, dtype):
    from dscale_runtime.kernels.triton_fused import add_rms_norm_triton

    gen = _gen(11 + shape[0])
    weight = randn(shape[1], dtype, gen)
    x, delta = on_grid(shape, dtype, gen, 16), on_grid(shape, dtype, gen, 16)
    got, want = add_rms_norm_triton(x, delta, weight, EPS), add_rms_norm_ref(x, delta, weight, EPS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    x, delta = randn(shape, dtype, gen, 4.0), randn(shape, dtype, gen)
    want = add_rms_norm_ref(x, delta, weight, EPS)
    normed = torch.full_like(x, float("nan"))
    total, out = add_rms_norm_triton(x, delta, weight, EPS, out=(x, normed))  # the residual updated in place
    assert total is x and out is normed
    assert torch.equal(x, want[0])  # the sum is elementwise: always exact
    assert_norm_close(normed, want[1])
    # the sum into strided rows (a captured layer's columns of the features), the norm into a new tensor; the
    # router's reference path honours the same buffers
    features = torch.full((shape[0], 3 * shape[1]), float("nan"), dtype=dtype)
    into = features[:, shape[1]:2 * shape[1]]
    x = randn(shape, dtype, gen, 4.0)
    total, out = add_rms_norm_triton(x, delta, weight, EPS, out=(into, None))
    assert total is into and torch.equal(into, x + delta)  # the sum is elementwise: always exact
    assert torch.isnan(features[:, :shape[1]]).all() and torch.isnan(features[:, 2 * shape[1]:]).all()
    into_ref = torch.full_like(features, float("nan"))[:, shape[1]:2 * shape[1]]
    total_ref, out_ref = add_rms_norm(x, delta, weight, EPS, backend="ref", out=(into_ref, None))
    assert total_ref is into_ref and torch.equal(into_ref, into)
    assert_norm_close(out, out_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interpreter_add_rms_norm_of_draft_rows(interpreter, dtype):
    """`skip` (the drafter's final norm over a block's drafts): rows first in each group of W are left out, the
    others come out contiguous and equal (bit for bit) the full norm's same rows, on both paths; the skipped rows'
    sums are not written."""
    from dscale_runtime.kernels.triton_fused import add_rms_norm_triton

    gen = _gen(29)
    for blocks, width in ((3, 16), (1, 2), (5, 4)):
        weight = randn(384, dtype, gen)
        x, delta = randn((blocks * width, 384), dtype, gen, 4.0), randn((blocks * width, 384), dtype, gen)
        drafts = torch.arange(blocks * width) % width != 0
        full = add_rms_norm_triton(x, delta, weight, EPS)
        total = torch.full_like(x, float("nan"))
        got = add_rms_norm_triton(x, delta, weight, EPS, out=(total, None), skip=width)
        assert got[0] is total and got[1].shape == (blocks * (width - 1), 384) and got[1].is_contiguous()
        assert torch.equal(got[1], full[1][drafts]) and torch.equal(total[drafts], full[0][drafts])
        assert torch.isnan(total[~drafts]).all()
        ref = add_rms_norm(x, delta, weight, EPS, backend="ref", skip=width)
        assert torch.equal(ref[1], add_rms_norm_ref(x, delta, weight, EPS)[1][drafts])
        assert_norm_close(got[1], ref[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=str)
def test_interpreter_qk_norm_rope(interpreter, shape, dtype):
    """q and k read as strided views of the fused projection; exact on grid inputs, close on general ones."""
    from dscale_runtime.kernels.triton_fused import qk_norm_rope_triton

    num_rows, heads, kv_heads, head_dim = shape
    gen = _gen(sum(shape))
    cos, sin = rope_tables(num_rows, head_dim, dtype, gen)
    q_weight, k_weight = randn(head_dim, dtype, gen), randn(head_dim, dtype, gen)
    _, q, k = qkv_views(num_rows, heads, kv_heads, head_dim, dtype, gen, on_grid)
    assert num_rows < 2 or q.stride(0) == (heads + 2 * kv_heads) * head_dim
    for x, weight in ((q, q_weight), (k, k_weight)):
        assert torch.equal(qk_norm_rope_triton(x, weight, cos, sin, EPS), qk_norm_rope_ref(x, weight, cos, sin, EPS))
    qkv, q, k = qkv_views(num_rows, heads, kv_heads, head_dim, dtype, gen, lambda *a: randn(*a, scale=3.0))
    for x, weight in ((q, q_weight), (k, k_weight)):
        assert_rope_close(qk_norm_rope_triton(x, weight, cos, sin, EPS), x, weight, cos, sin)
    # In place into the projection buffer: q's columns change, k's and v's do not.
    before, want = qkv.clone(), qk_norm_rope_triton(q, q_weight, cos, sin, EPS)
    assert qk_norm_rope_triton(q, q_weight, cos, sin, EPS, out=q) is q
    assert torch.equal(q, want) and torch.equal(qkv[:, heads * head_dim :], before[:, heads * head_dim :])


def qkv_store_case(num_rows, heads, kv_heads, head_dim, dtype, gen, values, num_slots=64):
    """Inputs of qkv_norm_rope_store: the projection, weights, RoPE tables, distinct slots, caches full of a
    sentinel."""
    qkv, _, _ = qkv_views(num_rows, heads, kv_heads, head_dim, dtype, gen, values)
    q_weight, k_weight = randn(head_dim, dtype, gen), randn(head_dim, dtype, gen)
    cos, sin = rope_tables(num_rows, head_dim, dtype, gen)
    slots = torch.randperm(num_slots, generator=gen, device=gen.device)[:num_rows]
    caches = [torch.full((num_slots, kv_heads, head_dim), 7.0, dtype=dtype, device=gen.device) for _ in range(2)]
    return qkv, q_weight, k_weight, cos, sin, slots, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", HEAD_SHAPES, ids=str)
@pytest.mark.parametrize("with_q", [True, False], ids=["qkv", "kv"])
def test_interpreter_qkv_norm_rope_store(interpreter, shape, dtype, with_q):
    """One launch for q's norm + RoPE, k's norm + RoPE stored at the slots and v copied there: on grid inputs equal
    to the reference (the layer's op sequence); on general inputs equal bit for bit to qk_norm_rope_triton and an
    index_put (what the layer launched before); slots not named keep their contents. Without q heads (the
    drafter's context rows) only the caches change."""
    from dscale_runtime.kernels.fused import qkv_norm_rope_store_ref
    from dscale_runtime.kernels.triton_fused import qk_norm_rope_triton, qkv_norm_rope_store_triton

    num_rows, heads, kv_heads, head_dim = shape
    heads = heads if with_q else 0
    for values in (on_grid, lambda *a: randn(*a, scale=3.0)):
        gen = _gen(sum(shape) + heads)
        qkv, q_weight, k_weight, cos, sin, slots, (k_cache, v_cache) = qkv_store_case(
            num_rows, heads, kv_heads, head_dim, dtype, gen, values)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        if values is on_grid:
            want_q = qkv_norm_rope_store_ref(qkv, heads, kv_heads, q_weight, k_weight, cos, sin, EPS, slots, k_ref,
                                             v_ref)
        else:  # the kernels the layer launched before, one per op
            q = qkv[:, : heads * head_dim].view(num_rows, heads, head_dim)
            k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_rows, kv_heads, head_dim)
            want_q = qk_norm_rope_triton(q, q_weight, cos, sin, EPS) if heads else None
            k_ref[slots] = qk_norm_rope_triton(k, k_weight, cos, sin, EPS)
            v_ref[slots] = qkv[:, (heads + kv_heads) * head_dim :].reshape(num_rows, kv_heads, head_dim)
        before = qkv.clone()
        got_q = qkv_norm_rope_store_triton(qkv, heads, kv_heads, q_weight if heads else None, k_weight, cos, sin,
                                           EPS, slots, k_cache, v_cache)
        assert torch.equal(qkv, before)
        assert (got_q is None) == (want_q is None) and (got_q is None or torch.equal(got_q, want_q))
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interpreter_kv_store_of_every_layer_in_one_launch(interpreter, dtype):
    """The drafter's context K/V of L layers (one projection's columns, layer after layer) in one launch over the
    layers of one cache allocation: each layer's cache equal bit for bit to the one-layer kernel on its columns,
    slots not named untouched; caches that are not equally spaced take one launch per layer, with the same values;
    the reference path equals the layer-by-layer reference."""
    from dscale_runtime.kernels import triton_fused as tf
    from dscale_runtime.kernels.fused import kv_norm_rope_store_layers, qkv_norm_rope_store_ref
    from dscale_runtime.kv_cache import PagedKVCache

    layers, num_rows, kv_heads, head_dim, num_slots = 3, 9, 2, 64, 64
    gen = _gen(21)
    kv = randn((num_rows, layers * 2 * kv_heads * head_dim), dtype, gen, 3.0)
    k_weights = randn((layers, head_dim), dtype, gen)
    cos, sin = rope_tables(num_rows, head_dim, dtype, gen)
    slots = torch.randperm(num_slots, generator=gen)[:num_rows]
    width = 2 * kv_heads * head_dim
    want = PagedKVCache(layers, num_slots // 16, 16, kv_heads, head_dim, dtype, "cpu")
    want.k.fill_(7.0), want.v.fill_(7.0)
    for i in range(layers):
        tf.qkv_norm_rope_store_triton(kv[:, i * width:(i + 1) * width], 0, kv_heads, None, k_weights[i], cos, sin, EPS,
                                      slots, want.layers[i].k, want.layers[i].v)
    launches = []
    real = tf._qkv_norm_rope_store_kernel

    class Counted:  # NOTE: counts the kernel's launches, whatever wrapper makes them
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    got = PagedKVCache(layers, num_slots // 16, 16, kv_heads, head_dim, dtype, "cpu")
    got.k.fill_(7.0), got.v.fill_(7.0)
    try:
        tf._qkv_norm_rope_store_kernel = Counted()
        kv_norm_rope_store_layers(kv, kv_heads, k_weights, cos, sin, EPS, slots, [c.k for c in got.layers],
                                  [c.v for c in got.layers], backend="triton")
        assert len(launches) == 1 and launches[0][2] == layers
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
        spread = [torch.full((5, num_slots, kv_heads, head_dim), 7.0, dtype=dtype) for _ in range(2)]
        apart = [[c[0], c[1], c[3]] for c in spread]  # NOTE: unequal distances
        assert tf.layer_stride(apart[0]) is None and tf.layer_stride([spread[0][1]] * 3) is None  # overlapping
        assert tf.layer_stride([c.k for c in got.layers]) == got.k[0].numel()
        kv_norm_rope_store_layers(kv, kv_heads, k_weights, cos, sin, EPS, slots, *apart, backend="triton")
        assert len(launches) == 1 + layers
        assert all(torch.equal(apart[0][i], want.k[i]) and torch.equal(apart[1][i], want.v[i]) for i in range(layers))
    finally:
        tf._qkv_norm_rope_store_kernel = real
    ref = PagedKVCache(layers, num_slots // 16, 16, kv_heads, head_dim, dtype, "cpu")
    kv_norm_rope_store_layers(kv, kv_heads, k_weights, cos, sin, EPS, slots, [c.k for c in ref.layers],
                              [c.v for c in ref.layers], backend="ref")
    for i in range(layers):
        k_ref, v_ref = torch.zeros_like(ref.k[i]), torch.zeros_like(ref.v[i])
        qkv_norm_rope_store_ref(kv[:, i * width:(i + 1) * width], 0, kv_heads, None, k_weights[i], cos, sin, EPS, slots,
                                k_ref, v_ref)
        assert torch.equal(ref.k[i], k_ref) and torch.equal(ref.v[i], v_ref)
        assert torch.equal(got.v[i][slots], ref.v[i][slots])  # (k: the one-layer kernel's values, tested above)


def test_qkv_norm_rope_store_router_takes_the_reference_for_other_cache_dtypes(monkeypatch):
    """A cache of another dtype than the projection (never built today) takes the reference path, which casts."""
    from dscale_runtime.kernels import fused as fused_module

    gen = _gen(3)
    qkv, q_weight, k_weight, cos, sin, slots, _ = qkv_store_case(5, 4, 2, 64, torch.float32, gen, randn)
    caches = [torch.zeros(64, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
    monkeypatch.setattr(fused_module, "qkv_norm_rope_store_ref", lambda *a: "ref")
    assert fused.qkv_norm_rope_store(qkv, 4, 2, q_weight, k_weight, cos, sin, EPS, slots, *caches,
                                     backend="triton") == "ref"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(0, 64), (1, 4096), (17, 384), (3, 1000)], ids=str)
def test_interpreter_silu_mul(interpreter, shape, dtype):
    from dscale_runtime.kernels.triton_fused import silu_mul_triton

    num_rows, inter = shape
    gen = _gen(num_rows + inter)
    wide = randn((num_rows, 2 * inter + 16), dtype, gen, 3.0)
    gate_up = wide[:, 8 : 8 + 2 * inter]  # a strided view
    out = torch.full((num_rows, inter), float("nan"), dtype=dtype)
    assert silu_mul_triton(gate_up, out=out) is out
    if dtype == torch.bfloat16:
        assert torch.equal(out, silu_mul_ref(gate_up))
    else:  # every rounding point is torch's: exact up to the interpreter's exp
        assert torch.equal(out, silu_mul_numpy_exp(gate_up))
        assert ulp_distance(out, silu_mul_ref(gate_up)) <= (1 if dtype == torch.float16 else 4)


def test_interpreter_silu_mul_every_bf16_gate(interpreter):
    """Every finite bf16 gate value, with up values of magnitude 0.5..4: bit-identical to torch's silu and
    product. Subnormal gates and results are left out: the interpreter's bf16 <-> fp32 conversions mishandle
    them (the GPU test takes them too)."""
    from dscale_runtime.kernels.triton_fused import silu_mul_triton

    tiny = torch.finfo(torch.bfloat16).tiny
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates[torch.isfinite(gates) & ((gates == 0) | (gates.abs() >= tiny))]
    gates = torch.cat((gates, torch.zeros(16 * 4096 - gates.numel(), dtype=torch.bfloat16))).view(16, 4096)
    gen = _gen(5)
    up = (torch.rand(16, 4096, generator=gen) * 3.5 + 0.5) * (torch.randint(0, 2, (16, 4096), generator=gen) * 2 - 1)
    gate_up = torch.cat((gates, up.to(torch.bfloat16)), dim=1)
    with np.errstate(over="ignore"):
        got = silu_mul_triton(gate_up)
    want = silu_mul_ref(gate_up)
    normal = (want == 0) | (want.abs() >= tiny)
    assert normal.float().mean() > 0.99 and torch.equal(got[normal], want[normal])


def test_round_to_nearest_even_in_kernels(interpreter):
    """The kernels' own fp32 -> bf16 rounding (the interpreter's conversion truncates): ties go to even."""
    from dscale_runtime.kernels.triton_fused import add_rms_norm_triton

    base = torch.tensor([1.0, 1.0078125, 3.0, -1.0, -1.0078125, 256.0, 1e-3, 3e38], dtype=torch.bfloat16)
    delta = torch.tensor([2**-8, 2**-8, 2**-7 + 2**-9, -(2**-8), -(2**-8), 0.999, 1e-7, 3e38], dtype=torch.bfloat16)
    with np.errstate(all="ignore"):  # the last column's square overflows the statistic; only the sum is checked
        total, _ = add_rms_norm_triton(base[None], delta[None], torch.ones(8, dtype=torch.bfloat16), EPS)
    assert torch.equal(total[0], base + delta)  # includes exact ties (1 + 2^-8) and an overflow to inf


# ---------------------------------------------------------------------------------------------- router
def _all_ops(dtype, device="cpu", gen=None):
    gen = gen or _gen(0, device)
    x, delta, weight = randn((5, 384), dtype, gen), randn((5, 384), dtype, gen), randn(384, dtype, gen)
    _, q, _ = qkv_views(5, 4, 2, 64, dtype, gen)
    cos, sin = rope_tables(5, 64, dtype, gen)
    head_weight, gate_up = randn(64, dtype, gen), randn((5, 2 * 96), dtype, gen)
    return {
        "rms_norm": (lambda **kw: rms_norm(x, weight, EPS, **kw), lambda: rms_norm_ref(x, weight, EPS)),
        "add_rms_norm": (lambda **kw: add_rms_norm(x, delta, weight, EPS, **kw),
                         lambda: add_rms_norm_ref(x, delta, weight, EPS)),
        "qk_norm_rope": (lambda **kw: qk_norm_rope(q, head_weight, cos, sin, EPS, **kw),
                         lambda: qk_norm_rope_ref(q, head_weight, cos, sin, EPS)),
        "silu_mul": (lambda **kw: silu_mul(gate_up, **kw), lambda: silu_mul_ref(gate_up)),
    }


def _same(a, b) -> bool:
    return all(map(torch.equal, a, b)) if isinstance(a, tuple) else torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_on_cpu_is_exactly_the_reference(monkeypatch, dtype):
    monkeypatch.setenv("DSCALE_FUSED", "triton")  # read by KernelChoice.resolve only, never by a router
    assert fused_backend(torch.zeros(1)) == "ref"
    for name, (op, ref) in _all_ops(dtype).items():
        want = ref()
        assert _same(op(), want), name
        out = tuple(torch.full_like(w, float("nan")) for w in want) if isinstance(want, tuple) else \
            torch.full_like(want, float("nan"))
        got = op(out=out)
        assert _same(got, want) and (all(g is o for g, o in zip(got, out)) if isinstance(out, tuple) else got is out)


def test_references_are_the_layers_op_sequence():
    """The references against the torch sequence the layers ran before fusing (written out here, so that an
    edit of a reference that changes a rounding fails): RMSNorm, apply_rope after q_norm, the activation."""
    gen = _gen(1)
    weight, x = randn(64, torch.bfloat16, gen), randn((6, 3, 64), torch.bfloat16, gen)
    cos, sin = rope_tables(6, 64, torch.bfloat16, gen)
    normed = weight * F.rms_norm(x.float(), (64,), eps=EPS).to(x.dtype)
    assert torch.equal(rms_norm_ref(x, weight, EPS), normed)
    rotated = torch.cat((-normed[..., 32:], normed[..., :32]), dim=-1)
    assert torch.equal(qk_norm_rope_ref(x, weight, cos, sin, EPS), normed * cos[:, None] + rotated * sin[:, None])
    gate, up = randn((6, 32), torch.bfloat16, gen), randn((6, 32), torch.bfloat16, gen)
    assert torch.equal(silu_mul_ref(torch.cat((gate, up), 1)), F.silu(gate) * up)
    total = x[:, 0] + x[:, 1]
    assert all(map(torch.equal, add_rms_norm_ref(x[:, 0], x[:, 1], weight, EPS),
                   (total, weight * F.rms_norm(total.float(), (64,), eps=EPS).to(x.dtype))))


def test_router_runs_the_backend_it_is_given(interpreter, monkeypatch):
    from dscale_runtime.kernels import triton_fused

    calls = []
    for name in ("rms_norm_triton", "add_rms_norm_triton", "qk_norm_rope_triton", "silu_mul_triton"):
        original = getattr(triton_fused, name)
        monkeypatch.setattr(triton_fused, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    monkeypatch.setenv("DSCALE_FUSED", "ref")  # not read per call: the argument alone decides
    assert fused_backend(torch.zeros(1), "triton") == "triton" and fused_backend(torch.zeros(1)) == "ref"
    for name, (op, ref) in _all_ops(torch.bfloat16).items():
        before = len(calls)
        got, want = op(backend="triton"), ref()
        assert len(calls) == before + 1, name
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)  # general inputs: within a few ulps
        op(backend="ref")
        op()  # 'auto' on CPU tensors: the reference
        assert len(calls) == before + 1, name


def test_router_names_bad_settings(monkeypatch):
    with pytest.raises(ValueError, match=r"backend='fast': expected one of auto, ref, triton"):
        rms_norm(torch.zeros(2, 4), torch.ones(4), EPS, backend="fast")
    with pytest.raises(ValueError, match=r"backend='cuda'"):
        silu_mul(torch.zeros(2, 4), backend="cuda")
    monkeypatch.setenv("DSCALE_FUSED", "fast")
    with pytest.raises(ValueError, match=r"DSCALE_FUSED='fast': expected one of auto, ref, triton"):
        KernelChoice.resolve("cpu", torch.float32)
    import dscale_runtime.kernels.choice as choice

    monkeypatch.setattr(choice, "triton_available", lambda: False)  # the shared check of every router
    with pytest.raises(RuntimeError, match="DSCALE_FUSED=ref"):
        fused_backend(torch.zeros(1), "triton")


# -------------------------------------------------------------------------------------- compiled, no GPU
@needs_triton
def test_compiled_kernels_build_for_sm90():
    """The compiled path without a GPU (Triton's bundled ptxas) at Qwen3-8B sizes: no register spills, IEEE
    division everywhere (no approximate `div.full`), and no fused multiply-adds in the norm and RoPE kernels
    (SiLU's only FMAs are inside CUDA's expf)."""
    from offline import run_without_interpreter

    skipping = []
    lines = [line.split() for line in run_without_interpreter("""
import re, torch
from dscale_runtime.kernels import stack_usage
from dscale_runtime.kernels.triton_fused import compile_offline
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for kernel, sizes in [("rms_norm", dict(dim=4096)), ("rms_norm", dict(dim=4096, add=True)),
                          ("rms_norm", dict(dim=4096, add=True, skip=True)),
                          ("rms_norm", dict(dim=8192, add=True)), ("qk_norm_rope", dict(num_heads=32, head_dim=128)),
                          ("qk_norm_rope", dict(num_heads=8, head_dim=64)), ("silu_mul", dict(inter=12288)),
                          ("qkv_norm_rope_store", dict(num_heads=40, head_dim=128))]:
        compiled = compile_offline(kernel, dtype, **sizes)
        ops = sorted(set(re.findall(r"\\b(fma\\.[\\w.]+|div\\.[\\w.]+)", compiled.asm["ptx"])))
        print(kernel, str(dtype).split(".")[1], stack_usage(compiled), *ops)
""")]
    assert len(lines) == 24
    for kernel, dtype, usage, *ops in lines:
        assert usage in ("STACK:0", "STACK:?"), (kernel, dtype, usage)
        # NOTE: integer division only where the skipping norm maps its rows (one in three rms_norm builds)
        floats = [op for op in ops if not op.startswith(("div.s", "div.u"))]
        assert "div.rn.f32" in ops and not any(op.startswith("div.") and op != "div.rn.f32" for op in floats), ops
        if kernel == "rms_norm" and len(floats) < len(ops):
            skipping.append(dtype)
        if kernel != "silu_mul":
            assert not any(op.startswith("fma") for op in ops), (kernel, dtype, ops)
    assert skipping == ["bfloat16", "float16", "float32"], skipping


# ----------------------------------------------------------------------------------------------- CUDA
QWEN3_8B = {"hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "inter": 12288}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [16, 512])
@pytest.mark.parametrize("inputs", ["grid", "general"])
def test_cuda_matches_ref_at_qwen3_8b_sizes(num_rows, inputs):
    """Compiled kernels, bf16: bit-exact on grid inputs (norms, RoPE) and for SiLU, close on general inputs."""
    from dscale_runtime.kernels import triton_fused as tf

    s, dtype, gen = QWEN3_8B, torch.bfloat16, _gen(num_rows, "cuda")
    exact = inputs == "grid"

    def values(shape, dtype, gen):
        return on_grid(shape, dtype, gen, 16) if exact else randn(shape, dtype, gen, 3.0)

    def check_norm(got, want):
        if exact:
            assert torch.equal(got, want)
        else:
            assert_norm_close(got, want)

    weight, head_weight = randn(s["hidden"], dtype, gen), randn(s["head_dim"], dtype, gen)
    cos, sin = rope_tables(num_rows, s["head_dim"], dtype, gen)
    x, delta = values((num_rows, s["hidden"]), dtype, gen), values((num_rows, s["hidden"]), dtype, gen)
    check_norm(tf.rms_norm_triton(x, weight, EPS), rms_norm_ref(x, weight, EPS))
    got, want = tf.add_rms_norm_triton(x, delta, weight, EPS), add_rms_norm_ref(x, delta, weight, EPS)
    assert torch.equal(got[0], want[0])
    check_norm(got[1], want[1])
    _, q, k = qkv_views(num_rows, s["heads"], s["kv_heads"], s["head_dim"], dtype, gen, values)
    for view in (q, k):
        got = tf.qk_norm_rope_triton(view, head_weight, cos, sin, EPS)
        if exact:
            assert torch.equal(got, qk_norm_rope_ref(view, head_weight, cos, sin, EPS))
        else:
            assert_rope_close(got, view, head_weight, cos, sin)
    gate_up = randn((num_rows, 2 * s["inter"]), dtype, gen, 3.0)
    assert torch.equal(tf.silu_mul_triton(gate_up), silu_mul_ref(gate_up))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_silu_mul_every_16bit_gate(dtype):
    """CUDA's expf through libdevice equals torch's silu kernel: every bf16 gate value (as bf16 and as fp32)."""
    from dscale_runtime.kernels.triton_fused import silu_mul_triton

    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    gates = gates[torch.isfinite(gates)].to(dtype)
    gate_up = torch.cat((gates, randn(gates.shape, dtype, _gen(7, "cuda")))).view(1, -1)
    assert torch.equal(silu_mul_triton(gate_up), silu_mul_ref(gate_up))


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture_and_replay():
    """All four kernels captured into one graph with static buffers, replayed over new inputs copied in: outputs
    equal eager launches on the same inputs (no host reads, grids from shapes)."""
    from dscale_runtime.kernels import triton_fused as tf

    s, dtype, num_rows = QWEN3_8B, torch.bfloat16, 64
    gen = _gen(0, "cuda")
    weight, head_weight = randn(s["hidden"], dtype, gen), randn(s["head_dim"], dtype, gen)
    x, delta = randn((num_rows, s["hidden"]), dtype, gen), randn((num_rows, s["hidden"]), dtype, gen)
    qkv, q, k = qkv_views(num_rows, s["heads"], s["kv_heads"], s["head_dim"], dtype, gen)
    cos, sin = rope_tables(num_rows, s["head_dim"], dtype, gen)
    gate_up = randn((num_rows, 2 * s["inter"]), dtype, gen)
    outs = {"norm": torch.empty_like(x), "sum": torch.empty_like(x), "normed": torch.empty_like(x),
            "q": torch.empty_like(q), "k": torch.empty_like(k), "act": torch.empty(num_rows, s["inter"], dtype=dtype,
                                                                                   device="cuda")}

    def run(o):
        tf.rms_norm_triton(x, weight, EPS, out=o["norm"])
        tf.add_rms_norm_triton(x, delta, weight, EPS, out=(o["sum"], o["normed"]))
        tf.qk_norm_rope_triton(q, head_weight, cos, sin, EPS, out=o["q"])
        tf.qk_norm_rope_triton(k, head_weight, cos, sin, EPS, out=o["k"])
        tf.silu_mul_triton(gate_up, out=o["act"])

    run(outs)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(outs)
    for seed in range(3):
        gen = _gen(100 + seed, "cuda")
        for buffer in (x, delta, qkv, gate_up):
            buffer.copy_(randn(buffer.shape, dtype, gen, 2.0))
        new_cos, new_sin = rope_tables(num_rows, s["head_dim"], dtype, gen)
        cos.copy_(new_cos), sin.copy_(new_sin)
        for out in outs.values():
            out.fill_(float("nan"))
        graph.replay()
        eager = {name: torch.empty_like(out) for name, out in outs.items()}
        run(eager)
        for name in outs:
            assert torch.equal(outs[name], eager[name]), name
        assert torch.equal(outs["act"], silu_mul_ref(gate_up))


def captured(call) -> "torch.cuda.CUDAGraph":
    """`call` run once (it compiles outside the capture), then captured in a CUDA graph."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def refresh_rows(x: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seed: int) -> None:
    """New projection rows, distinct slots among 4,096 and RoPE tables, in place (where a replay reads them)."""
    gen = _gen(seed, "cuda")
    x.copy_(randn(x.shape, x.dtype, gen, 3.0))
    slots.copy_(torch.randperm(4096, generator=gen, device="cuda")[: slots.shape[0]])
    new_cos, new_sin = rope_tables(x.shape[0], cos.shape[1], x.dtype, gen)
    cos.copy_(new_cos), sin.copy_(new_sin)


@pytest.mark.gpu
@needs_cuda
def test_cuda_kv_store_of_every_layer_captured_at_qwen3_8b_drafter_sizes():
    """The drafter's context K/V of its five layers in one launch (Qwen3-8B heads, bf16, 512 rows, one cache
    allocation of 4,096 slots per layer): equal bit for bit to the one-layer kernel per layer, eagerly and replayed
    from a CUDA graph over new inputs and slots."""
    from dscale_runtime.kernels import triton_fused as tf
    from dscale_runtime.kv_cache import PagedKVCache

    s, dtype, num_rows, layers = QWEN3_8B, torch.bfloat16, 512, 5
    kv_heads, head_dim = s["kv_heads"], s["head_dim"]
    width = 2 * kv_heads * head_dim
    gen = _gen(6, "cuda")
    kv = randn((num_rows, layers * width), dtype, gen, 3.0)
    k_weights = randn((layers, head_dim), dtype, gen)
    cos, sin = rope_tables(num_rows, head_dim, dtype, gen)
    slots = torch.randperm(4096, generator=gen, device="cuda")[:num_rows]
    cache = PagedKVCache(layers, 256, 16, kv_heads, head_dim, dtype, "cuda")

    def one_call():
        tf.kv_norm_rope_store_layers_triton(kv, kv_heads, k_weights, cos, sin, EPS, slots, [c.k for c in cache.layers],
                                            [c.v for c in cache.layers])

    graph = captured(one_call)
    for seed in range(3):
        refresh_rows(kv, slots, cos, sin, 60 + seed)
        want_k, want_v = cache.k.clone(), cache.v.clone()
        for i in range(layers):
            tf.qkv_norm_rope_store_triton(kv[:, i * width:(i + 1) * width], 0, kv_heads, None, k_weights[i], cos, sin,
                                          EPS, slots, want_k[i], want_v[i])
        if seed % 2:
            graph.replay()
        else:
            one_call()
        assert torch.equal(cache.k, want_k) and torch.equal(cache.v, want_v)


@pytest.mark.gpu
@needs_cuda
def test_cuda_qkv_norm_rope_store_captured_at_qwen3_8b_sizes():
    """The fused q/k norm + RoPE + K/V store at Qwen3-8B heads, bf16, 512 rows: equal bit for bit to the per-op
    kernels (qk_norm_rope_triton, index_put), eagerly and replayed from a CUDA graph over new inputs and slots."""
    from dscale_runtime.kernels import triton_fused as tf

    s, dtype, num_rows = QWEN3_8B, torch.bfloat16, 512
    heads, kv_heads, head_dim = s["heads"], s["kv_heads"], s["head_dim"]
    gen = _gen(5, "cuda")
    qkv, q_weight, k_weight, cos, sin, slots, caches = qkv_store_case(num_rows, heads, kv_heads, head_dim, dtype,
                                                                      gen, randn, num_slots=4096)
    q_out = torch.empty(num_rows, heads, head_dim, dtype=dtype, device="cuda")

    def fused_call():
        tf.qkv_norm_rope_store_triton(qkv, heads, kv_heads, q_weight, k_weight, cos, sin, EPS, slots, *caches,
                                      q_out=q_out)

    def per_op(k_cache, v_cache):
        q = qkv[:, : heads * head_dim].view(num_rows, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(num_rows, kv_heads, head_dim)
        k_cache[slots] = tf.qk_norm_rope_triton(k, k_weight, cos, sin, EPS)
        v_cache[slots] = qkv[:, (heads + kv_heads) * head_dim :].reshape(num_rows, kv_heads, head_dim)
        return tf.qk_norm_rope_triton(q, q_weight, cos, sin, EPS)

    graph = captured(fused_call)
    for seed in range(3):
        refresh_rows(qkv, slots, cos, sin, 50 + seed)
        want = [c.clone() for c in caches]
        want_q = per_op(*want)
        if seed % 2:
            graph.replay()
        else:
            fused_call()
        assert torch.equal(q_out, want_q)
        assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


@needs_triton
def test_router_keeps_training_and_autocast_on_the_reference():
    """The kernels have no backward and take one dtype: a call autograd records, or one with operands of
    another dtype (autocast: bf16 activations, fp32 weights), runs the reference even when triton is chosen."""
    x = torch.randn(4, 8)
    weight = torch.randn(8, requires_grad=True)
    assert fused.fused_backend(x, "triton", weight) == "ref"
    with torch.no_grad():
        assert fused.fused_backend(x, "triton", weight) == "triton"
        assert fused.fused_backend(x.bfloat16(), "triton", weight) == "ref"
    out = fused.rms_norm(x, weight, 1e-6, backend="triton")
    out.sum().backward()
    ref_weight = weight.detach().clone().requires_grad_(True)
    fused.rms_norm_ref(x, ref_weight, 1e-6).sum().backward()
    assert torch.equal(weight.grad, ref_weight.grad)
    mixed = fused.add_rms_norm(x.bfloat16(), x.bfloat16(), torch.ones(8), 1e-6, backend="triton")[1]
    assert mixed.dtype == torch.float32  # the reference's promotion (weight fp32), not a Triton assert


# ------------------------------------------------------------------------------------------------ RoPE's frequencies
def uncached_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """`rope_cos_sin`'s formula with the inverse frequencies computed anew (transformers' order)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float()
                                / head_dim))
    emb = torch.cat([positions.float()[:, None] * inv_freq[None, :]] * 2, dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def test_rope_frequencies_are_computed_once_per_device_and_give_the_same_tables():
    """The inverse frequencies are kept per (head_dim, theta, device): one tensor for every later table, and the
    tables equal the formula computed anew, bit for bit."""
    from dscale_runtime.models.layers import rope_inv_freq

    positions = torch.randint(0, 40000, (37,), generator=_gen(3))
    for head_dim, theta in ((64, 10000.0), (128, 1e6)):
        first = rope_inv_freq(head_dim, theta, positions.device)
        assert rope_inv_freq(head_dim, theta, positions.device) is first
        for got, want in zip(rope_cos_sin(positions, head_dim, theta, torch.bfloat16),
                             uncached_tables(positions, head_dim, theta, torch.bfloat16)):
            assert torch.equal(got, want)
    assert rope_inv_freq(64, 10000.0, positions.device) is not rope_inv_freq(64, 500000.0, positions.device)


@pytest.mark.gpu
@needs_cuda
def test_cuda_rope_frequencies_first_met_in_a_capture_are_not_kept():
    """A capture records kernels without running them: frequencies first asked for while a graph is captured are
    used by that graph (its replays give the formula's tables) but not kept for eager calls; eager ones are kept."""
    from dscale_runtime.models import layers

    head_dim, theta = 96, 123457.0  # NOTE: a key no other test uses
    layers._INV_FREQ.pop((head_dim, theta, torch.device("cuda", torch.cuda.current_device())), None)
    positions = torch.randint(0, 40000, (64,), device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        tables = rope_cos_sin(positions, head_dim, theta, torch.float32)
    assert (head_dim, theta, positions.device) not in layers._INV_FREQ
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(tables, uncached_tables(positions, head_dim, theta, torch.float32)):
        assert torch.equal(got, want)
    rope_cos_sin(positions, head_dim, theta, torch.float32)
    assert (head_dim, theta, positions.device) in layers._INV_FREQ
