"""Target and drafter numerics (DESIGN 2) against oracles: transformers' Qwen3 for the target, a
test-local reference written from the design text for the DFlash drafter. fp32 CPU, tiny random models.
The kernel paths the models are built with (`KernelChoice`) hold from then on, whatever the environment says,
and `use_kernels` sends every layer through another path (the interpreted Triton kernels here)."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import write_drafter, write_target
from markers import needs_cuda
from dscale_runtime.attention import build_metadata
from dscale_runtime.kernels import KernelChoice, triton_available
from dscale_runtime.kv_cache import SCRATCH_PAGE, PageAllocator, PagedKVCache
from dscale_runtime.models.config import Qwen3Config
from dscale_runtime.models.loader import load_drafter, load_target

TOL = 1e-4
PAGE = 4


# --------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: OpenMP threads only add wake-up latency (badly so when other test processes share the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _hf(folder):
    from transformers import Qwen3ForCausalLM as HFQwen3

    return HFQwen3.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_run(hf, tokens: torch.Tensor):
    """Full-sequence logits [T, V] and hidden states tuple (each [T, d]) of one request."""
    out = hf(tokens[None], output_hidden_states=True, use_cache=False)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


def _cache_for(model, num_pages: int, dtype=torch.float32) -> PagedKVCache:
    cfg = model.config
    return PagedKVCache(cfg.num_hidden_layers, num_pages, PAGE, cfg.num_key_value_heads, cfg.head_dim, dtype, "cpu")


def _grow_interleaved(alloc: PageAllocator, tables: list[list[int]], needed_tokens: list[int]) -> None:
    """Give every request enough pages for `needed_tokens`, one page per request per round (interleaved ids)."""
    while True:
        short = [i for i, t in enumerate(tables) if len(t) * PAGE < needed_tokens[i]]
        if not short:
            return
        for i in short:
            page = alloc.allocate(1)
            assert page is not None, "test sized the cache too small"
            tables[i].extend(page)


def _slots(table: list[int], positions) -> torch.Tensor:
    return torch.tensor([table[p // PAGE] * PAGE + p % PAGE for p in positions], dtype=torch.long)


def _non_contiguous(tables: list[list[int]]) -> bool:
    return any(any(b != a + 1 for a, b in zip(t, t[1:])) for t in tables if len(t) > 1)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# --------------------------------------------------------------------------------------------------
# target vs transformers


TARGET_SHAPES = {
    "gqa": dict(),  # 4 q heads, 2 kv heads, head_dim 8, 4 layers
    "mqa_wide_head": dict(layers=3, heads=2, kv_heads=1, head_dim=16, hidden=24),
}


TARGET_CASES = [(shape, tied, sharded) for tied in (False, True) for sharded in (False, True) for shape in ("gqa",)]
TARGET_CASES += [("mqa_wide_head", tied, False) for tied in (False, True)]
TARGET_CASES += [("gqa", False, False, True)]  # fused q/k/v and gate/up projections (the CUDA layout)
TARGET_CASES = [c if len(c) == 4 else (*c, False) for c in TARGET_CASES]


@pytest.mark.parametrize(
    "shape,tied,sharded,fused", TARGET_CASES,
    ids=[f"{s}-{'tied' if t else 'untied'}-{'sharded' if sh else 'single'}{'-fused' if f else ''}"
         for s, t, sh, f in TARGET_CASES],
)
@torch.no_grad()
def test_target_matches_transformers(tmp_path, shape, tied, sharded, fused):
    kw = TARGET_SHAPES[shape]
    folder = write_target(tmp_path / "t", tied=tied, shard_size="20KB" if sharded else None, seed=3, **kw)
    assert (folder / "model.safetensors.index.json").is_file() == sharded
    assert (folder / "model.safetensors").is_file() == (not sharded)

    model = load_target(folder, "float32")
    if fused:
        names = {k: v.clone() for k, v in model.state_dict().items()}
        model.fuse_projections()
        fused_state = model.state_dict()
        assert names.keys() == fused_state.keys() and all(torch.equal(names[k], fused_state[k]) for k in names)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert attn.k_proj.weight.data_ptr() == attn.qkv[0][attn.q_proj.weight.shape[0]:].data_ptr()
        assert mlp.up_proj.weight.data_ptr() == mlp.gate_up[mlp.gate_proj.weight.shape[0]:].data_ptr()
    hf = _hf(folder)
    cfg = model.config
    assert cfg.tie_word_embeddings == tied
    L = cfg.num_hidden_layers

    torch.manual_seed(0)
    T = 13
    tokens = torch.randint(0, cfg.vocab_size, (T,))
    alloc = PageAllocator(16, PAGE)
    table = alloc.allocate(alloc.pages_for(T))
    cache = _cache_for(model, 16)
    meta = build_metadata([T], [0], [table], PAGE, "cpu", causal=True)
    capture = tuple(range(L))  # the last layer's feature is final-normed, as transformers' hidden_states
    logits, feats = model(tokens, meta, cache.layers, capture_layers=capture)

    ref_logits, ref_hidden = _hf_run(hf, tokens)
    assert logits.dtype == torch.float32 and logits.shape == ref_logits.shape
    assert _maxdiff(logits, ref_logits) <= TOL
    assert feats.shape == (T, len(capture) * cfg.hidden_size)
    for j, layer in enumerate(capture):
        got = feats[:, j * cfg.hidden_size:(j + 1) * cfg.hidden_size]
        assert _maxdiff(got, ref_hidden[layer + 1]) <= TOL, f"layer {layer}"
    # a capture order other than ascending is honoured as given
    _, feats_rev = model(tokens, meta, cache.layers, capture_layers=(1, 0))
    d = cfg.hidden_size
    assert _maxdiff(feats_rev[:, :d], ref_hidden[2]) <= TOL
    assert _maxdiff(feats_rev[:, d:], ref_hidden[1]) <= TOL
    # a layer named twice fills both its column blocks; the last layer captured beside logits_rows
    rows = torch.tensor([0, 5, T - 1])
    sel_c, feats_twice = model(tokens, meta, cache.layers, logits_rows=rows, capture_layers=(1, L - 1, 1))
    assert torch.equal(feats_twice[:, :d], feats_twice[:, 2 * d:])
    assert _maxdiff(feats_twice[:, :d], ref_hidden[2]) <= TOL
    assert _maxdiff(feats_twice[:, d:2 * d], ref_hidden[L]) <= TOL
    with pytest.raises(ValueError, match="capture_layers"):
        model(tokens, meta, cache.layers, capture_layers=(L,))
    # logits_rows selects rows of the same computation
    sel, _ = model(tokens, meta, cache.layers, logits_rows=rows)
    assert _maxdiff(sel, ref_logits[rows]) <= TOL and torch.equal(sel, sel_c)


@pytest.fixture(scope="module")
def target_pair(tmp_path_factory):
    folder = write_target(tmp_path_factory.mktemp("target"), seed=5)
    return folder, load_target(folder, "float32"), _hf(folder)


@torch.no_grad()
def test_incremental_ragged_decoding_matches_full_recompute(target_pair):
    """Ragged prefill of 3 prompts, then packed steps adding 1/3/16/... rows per request, on non-contiguous
    pages: every step's logits equal transformers' recomputation over the whole sequence."""
    _, model, hf = target_pair
    cfg = model.config
    torch.manual_seed(1)
    prompt_lens = [5, 9, 2]
    steps = [[1, 3, 16], [3, 16, 1], [16, 1, 3], [2, 1, 5]]
    n = len(prompt_lens)
    seqs = [torch.randint(0, cfg.vocab_size, (p,)) for p in prompt_lens]
    num_pages = 1 + sum(-(-(p + sum(s[i] for s in steps)) // PAGE) for i, p in enumerate(prompt_lens))
    alloc = PageAllocator(num_pages, PAGE)
    cache = _cache_for(model, num_pages)
    # stale garbage everywhere: nothing that was not written by this test may influence the result
    cache.k.normal_()
    cache.v.normal_()
    tables: list[list[int]] = [[] for _ in range(n)]
    capture = (0, 2)

    ctx = [0] * n
    new = list(prompt_lens)
    for step in [None] + steps:
        if step is not None:
            new = list(step)
            for i in range(n):
                seqs[i] = torch.cat([seqs[i], torch.randint(0, cfg.vocab_size, (new[i],))])
        _grow_interleaved(alloc, tables, [c + q for c, q in zip(ctx, new)])
        assert all(SCRATCH_PAGE not in t for t in tables)
        tokens = torch.cat([seqs[i][ctx[i]:ctx[i] + new[i]] for i in range(n)])
        meta = build_metadata(new, ctx, tables, PAGE, "cpu", causal=True)
        logits, feats = model(tokens, meta, cache.layers, capture_layers=capture)
        off = 0
        for i in range(n):
            ref_logits, ref_hidden = _hf_run(hf, seqs[i])
            rows = slice(ctx[i], ctx[i] + new[i])
            got = logits[off:off + new[i]]
            assert _maxdiff(got, ref_logits[rows]) <= TOL, f"step {step} request {i}"
            ref_feats = torch.cat([ref_hidden[layer + 1][rows] for layer in capture], dim=-1)
            assert _maxdiff(feats[off:off + new[i]], ref_feats) <= TOL
            off += new[i]
        ctx = [c + q for c, q in zip(ctx, new)]
    assert _non_contiguous(tables), tables
    assert max(len(t) for t in tables) >= 6  # requests span several pages


@torch.no_grad()
def test_bf16_target_runs_close_to_fp32(target_pair):
    folder, model32, _ = target_pair
    model16 = load_target(folder, "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model16.parameters())
    torch.manual_seed(2)
    T = 11
    tokens = torch.randint(0, model32.config.vocab_size, (T,))
    table = list(range(1, 1 + -(-T // PAGE)))
    meta = build_metadata([T], [0], [table], PAGE, "cpu", causal=True)
    l32, f32 = model32(tokens, meta, _cache_for(model32, 8).layers, capture_layers=(1,))
    cache16 = _cache_for(model16, 8, torch.bfloat16)
    l16, f16 = model16(tokens, meta, cache16.layers, capture_layers=(1,))
    assert l16.dtype == torch.float32  # logits are handed out in fp32
    assert f16.dtype == torch.bfloat16
    assert torch.isfinite(l16).all()
    assert cache16.k.abs().sum() > 0  # K/V were written in bf16
    scale = l32.abs().mean().item()
    assert (l16 - l32).abs().mean().item() <= 0.03 * scale
    assert (l16 - l32).abs().max().item() <= 0.15 * l32.abs().max().item()
    assert (f16.float() - f32).abs().mean().item() <= 0.03 * f32.abs().mean().item()
    assert (l16.argmax(-1) == l32.argmax(-1)).float().mean().item() >= 0.8


# --------------------------------------------------------------------------------------------------
# drafter vs a reference written from DESIGN 2


TARGET_CFG = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=96, rope_theta=10000.0)


def _rms(x, w, eps):
    x = x.double()
    return w.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x [T, heads, D] rotated (rotate-half convention) at absolute positions pos [T]."""
    D = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos.double()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * cos + rot * sin


def _reference_drafter(w: dict, dcfg: dict, features: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """One request: features [c, Lt*d] of its context, block embeddings [W, d] -> final hidden [W, d]."""
    w = {k: v.double() for k, v in w.items()}
    eps, theta = dcfg["rms_norm_eps"], dcfg["rope_theta"]
    H, KVH, D = dcfg["num_attention_heads"], dcfg["num_key_value_heads"], dcfg["head_dim"]
    c, W = features.shape[0], block.shape[0]
    fused = _rms(features.double() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = block.double()
    q_pos = torch.arange(c, c + W)
    k_pos = torch.arange(c + W)
    for i in range(dcfg["num_hidden_layers"]):
        p = lambda name: w[f"layers.{i}.{name}"]  # noqa: E731
        h = _rms(x, p("input_layernorm.weight"), eps)
        q = _rms((h @ p("self_attn.q_proj.weight").T).view(W, H, D), p("self_attn.q_norm.weight"), eps)
        kv_in = torch.cat([fused, h], 0)
        k = _rms((kv_in @ p("self_attn.k_proj.weight").T).view(c + W, KVH, D), p("self_attn.k_norm.weight"), eps)
        v = (kv_in @ p("self_attn.v_proj.weight").T).view(c + W, KVH, D)
        q, k = _rope(q, q_pos, theta), _rope(k, k_pos, theta)
        k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * D**-0.5, -1)  # no mask: bidirectional
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(W, H * D)
        x = x + o @ p("self_attn.o_proj.weight").T
        h = _rms(x, p("post_attention_layernorm.weight"), eps)
        gate, up = h @ p("mlp.gate_proj.weight").T, h @ p("mlp.up_proj.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ p("mlp.down_proj.weight").T
    return _rms(x, w["norm.weight"], eps).float()


@pytest.fixture(scope="module", params=["", "model."], ids=["plain", "model_prefix"])
def drafter_setup(request, tmp_path_factory):
    import json

    folder = write_drafter(tmp_path_factory.mktemp("drafter"), prefix=request.param, seed=7,
                           target_layer_ids=(0, 2, 3), block_size=8)
    drafter = load_drafter(folder, TARGET_CFG, "float32")
    raw = load_file(str(folder / "model.safetensors"))
    weights = {k[len(request.param):]: v for k, v in raw.items()}
    assert all(k.startswith(request.param) for k in raw)
    dcfg = json.loads((folder / "config.json").read_text())
    return drafter, weights, dcfg


def _draft_cache(drafter, num_pages) -> PagedKVCache:
    lc = drafter.config.layers
    return PagedKVCache(lc.num_hidden_layers, num_pages, PAGE, lc.num_key_value_heads, lc.head_dim,
                        torch.float32, "cpu")


def _inject(drafter, cache, tables, feats, starts, counts):
    """Inject rows starts[i]..starts[i]+counts[i]-1 of every request (features packed request after request)."""
    positions = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, counts)])
    slots = torch.cat([_slots(t, range(s, s + k)) for t, s, k in zip(tables, starts, counts)])
    drafter.inject_context(feats, positions, slots, cache.layers)


def _draft(drafter, cache, tables, ctx_lens, block, drafts_of: int = 0):
    W = drafter.config.block_size
    meta = build_metadata([W] * len(ctx_lens), ctx_lens, tables, PAGE, "cpu", causal=False)
    return drafter(block, meta, cache.layers, drafts_of=drafts_of)


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_drafter_matches_design_reference(drafter_setup, fused):
    drafter, weights, dcfg = drafter_setup
    if fused:
        drafter = copy.deepcopy(drafter).fuse_projections()
    d, W = TARGET_CFG.hidden_size, drafter.config.block_size
    width = len(drafter.config.target_layer_ids) * d
    ctx_lens = [5, 13, 1]
    n = len(ctx_lens)
    torch.manual_seed(3)
    feats = [torch.randn(c, width) for c in ctx_lens]
    block = torch.randn(n * W, d)
    num_pages = 1 + sum(-(-(c + W) // PAGE) for c in ctx_lens)
    alloc = PageAllocator(num_pages, PAGE)
    tables: list[list[int]] = [[] for _ in range(n)]
    _grow_interleaved(alloc, tables, [c + W for c in ctx_lens])
    assert _non_contiguous(tables)
    cache = _draft_cache(drafter, num_pages)
    cache.k.normal_()
    cache.v.normal_()

    _inject(drafter, cache, tables, torch.cat(feats), [0] * n, ctx_lens)
    out = _draft(drafter, cache, tables, ctx_lens, block)
    assert out.shape == (n * W, d)
    for i in range(n):
        ref = _reference_drafter(weights, dcfg, feats[i], block[i * W:(i + 1) * W])
        assert _maxdiff(out[i * W:(i + 1) * W], ref) <= TOL, f"request {i}"
    # the draft slots alone (what `propose` reads: the anchors' rows left out of the final norm), the same values
    drafts = _draft(drafter, cache, tables, ctx_lens, block, drafts_of=W)
    assert drafts.is_contiguous() and torch.equal(drafts, out.view(n, W, d)[:, 1:].reshape(-1, d))
    # the reference is sensitive to the context: a changed feature row changes the output
    feats2 = feats[1].clone()
    feats2[0] += 1.0
    ref2 = _reference_drafter(weights, dcfg, feats2, block[W:2 * W])
    assert _maxdiff(out[W:2 * W], ref2) > 10 * TOL


@torch.no_grad()
def test_incremental_context_injection_matches_one_shot(drafter_setup):
    """Chunks of context injected across steps (each step's block overwriting the slots after the context,
    the next injection overwriting the block) give the output of a one-shot injection into a fresh cache."""
    drafter, weights, dcfg = drafter_setup
    d, W = TARGET_CFG.hidden_size, drafter.config.block_size
    width = len(drafter.config.target_layer_ids) * d
    chunks = [[5, 3, 7], [2, 9, 1]]  # per request
    n = len(chunks)
    total = [sum(c) for c in chunks]
    torch.manual_seed(4)
    feats = [torch.randn(t, width) for t in total]
    num_pages = 1 + sum(-(-(t + W) // PAGE) for t in total)
    alloc = PageAllocator(num_pages, PAGE)
    tables: list[list[int]] = [[] for _ in range(n)]
    _grow_interleaved(alloc, tables, [t + W for t in total])
    cache = _draft_cache(drafter, num_pages)

    ctx = [0] * n
    for step in range(3):
        counts = [chunks[i][step] for i in range(n)]
        packed = torch.cat([feats[i][ctx[i]:ctx[i] + counts[i]] for i in range(n)])
        _inject(drafter, cache, tables, packed, ctx, counts)
        ctx = [c + k for c, k in zip(ctx, counts)]
        block = torch.randn(n * W, d)
        out = _draft(drafter, cache, tables, ctx, block)

        fresh = _draft_cache(drafter, num_pages)
        _inject(drafter, fresh, tables, torch.cat([feats[i][:ctx[i]] for i in range(n)]), [0] * n, ctx)
        one_shot = _draft(drafter, fresh, tables, ctx, block)
        assert _maxdiff(out, one_shot) <= 1e-5, f"step {step}"
        for i in range(n):
            ref = _reference_drafter(weights, dcfg, feats[i][:ctx[i]], block[i * W:(i + 1) * W])
            assert _maxdiff(out[i * W:(i + 1) * W], ref) <= TOL


# --------------------------------------------------------------------------------------------------
# kernel choice


class _WatchedEnviron(dict):
    """A copy of the environment that records every key read through it."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.read: list[str] = []

    def get(self, key, default=None):
        self.read.append(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.append(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.append(key)
        return super().__contains__(key)


@torch.no_grad()
def test_built_models_never_consult_the_environment(target_pair, drafter_setup, monkeypatch):
    """After building, the DSCALE_* variables are not read again: set to invalid values (which any read
    would reject), a target and a drafter forward still run, and give what they gave before."""
    _, model, _ = target_pair
    drafter = drafter_setup[0]
    tokens = torch.arange(1, 10) % model.config.vocab_size
    meta = build_metadata([9], [0], [[1, 2, 3]], PAGE, "cpu", causal=True)
    want, _ = model(tokens, meta, _cache_for(model, 4).layers)
    W, d = drafter.config.block_size, TARGET_CFG.hidden_size
    feats = torch.randn(5, len(drafter.config.target_layer_ids) * d, generator=torch.Generator().manual_seed(6))
    block = torch.randn(W, d, generator=torch.Generator().manual_seed(7))

    def draft():
        cache = _draft_cache(drafter, 5)
        _inject(drafter, cache, [[4, 2, 1, 3]], feats, [0], [5])
        return _draft(drafter, cache, [[4, 2, 1, 3]], [5], block)

    draft_want = draft()
    watched = _WatchedEnviron(os.environ)
    watched.update(DSCALE_ATTENTION="flash", DSCALE_ATTENTION_TILE="48", DSCALE_FUSED="fast", DSCALE_FEATURES="x")
    monkeypatch.setattr(os, "environ", watched)
    got, _ = model(tokens, meta, _cache_for(model, 4).layers)
    assert torch.equal(got, want) and torch.equal(draft(), draft_want)
    assert not [key for key in watched.read if key.startswith("DSCALE_")], watched.read
    with pytest.raises(ValueError, match="DSCALE_ATTENTION='flash'"):  # they are read where a choice is made
        KernelChoice.resolve("cpu", torch.float32)


@pytest.fixture
def kernel_calls(monkeypatch):
    """{kernel name: [call kwargs]} of every Triton launch through the routers (interpreter on CPU)."""
    if not triton_available():
        pytest.skip("triton is not installed")
    from dscale_runtime.kernels import triton_attention, triton_fused

    calls: dict[str, list[dict]] = {}
    for module, name in ((triton_attention, "paged_attention_triton"), (triton_fused, "rms_norm_triton"),
                         (triton_fused, "add_rms_norm_triton"), (triton_fused, "qk_norm_rope_triton"),
                         (triton_fused, "qkv_norm_rope_store_triton"), (triton_fused, "silu_mul_triton"),
                         (triton_fused, "kv_norm_rope_store_layers_triton")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _f=original, _n=name, **k: calls.setdefault(_n, []).append(k) or _f(*a, **k))
    return calls


@torch.no_grad()
def test_use_kernels_sends_every_layer_through_the_choice(target_pair, interpreter, kernel_calls):
    """use_kernels on a built (fused-projection) target: every layer's attention and elementwise ops run the
    interpreted Triton kernels and match transformers; a forced 128-row tile reaches every attention launch;
    back on the references, no kernel runs."""
    folder, _, hf = target_pair
    model = load_target(folder, "float32", kernels=KernelChoice()).fuse_projections()
    num_layers = model.config.num_hidden_layers
    tokens = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(8))
    meta = build_metadata([11], [0], [[1, 2, 3]], PAGE, "cpu", causal=True)
    ref_logits, _ = _hf_run(hf, tokens)

    triton = KernelChoice(attention="triton", fused="triton")
    assert model.use_kernels(triton) is model
    logits, _ = model(tokens, meta, _cache_for(model, 4).layers)
    assert _maxdiff(logits, ref_logits) <= TOL
    assert len(kernel_calls["paged_attention_triton"]) == num_layers
    assert [k["tile_rows"] for k in kernel_calls["paged_attention_triton"]] == [None] * num_layers  # by max_q
    assert len(kernel_calls["silu_mul_triton"]) == num_layers
    assert len(kernel_calls["qkv_norm_rope_store_triton"]) == num_layers  # q, and k and v into the cache
    assert "qk_norm_rope_triton" not in kernel_calls  # the fused projection's q and k go through the one above
    assert len(kernel_calls["add_rms_norm_triton"]) == 2 * num_layers  # every norm after a residual add
    assert len(kernel_calls["rms_norm_triton"]) == 1  # the first layer's input norm

    # Captured layers: their sums come out of the next layer's fused add + norm, written into the features'
    # columns (strided), and the last one is the final norm's output: no extra launch, the same logits bit for bit
    kernel_calls.clear()
    ref_hidden = _hf_run(hf, tokens)[1]
    capture = (1, num_layers - 1, 0)
    logits_c, feats = model(tokens, meta, _cache_for(model, 4).layers, capture_layers=capture)
    assert torch.equal(logits_c, logits)
    assert len(kernel_calls["add_rms_norm_triton"]) == 2 * num_layers and len(kernel_calls["rms_norm_triton"]) == 1
    d = model.config.hidden_size
    for j, layer in enumerate(capture):
        assert _maxdiff(feats[:, j * d:(j + 1) * d], ref_hidden[layer + 1]) <= TOL, layer

    kernel_calls.clear()
    model.use_kernels(dataclasses.replace(triton, attention_tile=128))  # the "+tiles" ablation
    logits, _ = model(tokens, meta, _cache_for(model, 4).layers)
    assert _maxdiff(logits, ref_logits) <= TOL
    assert [k["tile_rows"] for k in kernel_calls["paged_attention_triton"]] == [128] * num_layers

    kernel_calls.clear()
    model.use_kernels(KernelChoice())
    assert _maxdiff(model(tokens, meta, _cache_for(model, 4).layers)[0], ref_logits) <= TOL
    assert kernel_calls == {}
    with pytest.raises(TypeError, match="KernelChoice"):
        model.use_kernels("triton")


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_drafter_built_with_triton_matches_design_reference(drafter_setup, interpreter, kernel_calls, fused):
    """The drafter through the interpreted Triton kernels equals the design reference; with fused projections (the
    CUDA engine's layout) the context K/V of every layer is one projection stored in one launch."""
    drafter, weights, dcfg = drafter_setup
    drafter = copy.deepcopy(drafter).use_kernels(KernelChoice(attention="triton", fused="triton"))
    if fused:
        drafter.fuse_projections()
    layers = drafter.config.layers.num_hidden_layers
    d, W = TARGET_CFG.hidden_size, drafter.config.block_size
    feats = torch.randn(6, len(drafter.config.target_layer_ids) * d, generator=torch.Generator().manual_seed(9))
    block = torch.randn(W, d, generator=torch.Generator().manual_seed(10))
    cache = _draft_cache(drafter, 5)
    _inject(drafter, cache, [[3, 1, 4, 2]], feats, [0], [6])
    injected = {name: len(calls) for name, calls in kernel_calls.items()}
    assert injected.get("kv_norm_rope_store_layers_triton", 0) == (1 if fused else 0)
    # NOTE: unfused layers norm and rope k (one launch each) and store k and v by indexing
    assert injected.get("qk_norm_rope_triton", 0) == (0 if fused else layers)
    assert "qkv_norm_rope_store_triton" not in injected and "paged_attention_triton" not in injected
    out = _draft(drafter, cache, [[3, 1, 4, 2]], [6], block)
    assert _maxdiff(out, _reference_drafter(weights, dcfg, feats, block)) <= TOL
    assert len(kernel_calls["paged_attention_triton"]) == layers
    assert kernel_calls["rms_norm_triton"] and kernel_calls["add_rms_norm_triton"]
    # the draft slots alone through the skipping norm: the same rows, bit for bit, contiguous
    assert torch.equal(_draft(drafter, cache, [[3, 1, 4, 2]], [6], block, drafts_of=W), out[1:])


@pytest.mark.gpu
@needs_cuda
@torch.no_grad()
def test_cuda_target_resolves_the_triton_paths_and_matches_the_references(target_pair, kernel_calls):
    """On CUDA the loader's resolved choice is Triton everywhere, the compiled kernels run, and the logits
    equal those of the same model switched to the references (within fp32 reduction-order noise)."""
    folder, _, hf = target_pair
    model = load_target(folder, "float32", "cuda").fuse_projections()
    assert model.kernels == KernelChoice(attention="triton", fused="triton", features="triton", decision="triton")
    tokens = torch.randint(0, model.config.vocab_size, (11,), generator=torch.Generator().manual_seed(8))
    meta = build_metadata([11], [0], [[1, 2, 3]], PAGE, "cuda", causal=True)

    def run():
        cfg = model.config
        cache = PagedKVCache(cfg.num_hidden_layers, 4, PAGE, cfg.num_key_value_heads, cfg.head_dim, torch.float32,
                             "cuda")
        return model(tokens.cuda(), meta, cache.layers)[0]

    fast = run()
    assert len(kernel_calls["paged_attention_triton"]) == model.config.num_hidden_layers
    model.use_kernels(KernelChoice())
    reference = run()
    assert _maxdiff(fast, reference) <= TOL
    assert _maxdiff(fast.cpu(), _hf_run(hf, tokens)[0]) <= TOL
