"""DFlash 2 drafters (issue 26): loading z-lab's layout, the drafter step against z-lab's `DFlash2DraftModel`
(PyPI `dflash` 0.1.0, the oracle), and lossless decoding over it (DFlash and DScale, greedy and sampled).

Checkpoints are written by the tests (`checkpoints.write_drafter2`) and loaded by z-lab's own `from_pretrained`
as well as ours, so the layout itself is checked against the reference.
"""

from __future__ import annotations

import collections
import json
import time

import pytest
import torch

from checkpoints import write_drafter, write_drafter2, write_target
from markers import needs_cuda
from dscale_runtime.attention import build_metadata
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.engine import Engine
from dscale_runtime.kv_cache import PagedKVCache
from dscale_runtime.dvl.features import FEATURE_VERSION_DFLASH2, drafter_feature_spec, hidden_projection
from dscale_runtime.dvl.predictor import AcceptancePredictor, pair_identity, predictor_artifact
from dscale_runtime.models.config import CheckpointError, load_drafter_config, load_target_config
from dscale_runtime.models.dflash2 import DFlash2DraftModel, candidate_chunks, candidate_topk, follow_choices, walk_ref
from dscale_runtime.models.loader import load_drafter, load_target

zlab = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0")

PAGE = 8


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on one thread: on this file's sizes torch's CPU threads only contend with each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SCALED = {"output_multiplier": 0.7, "final_logit_softcapping": 4.0, "input_embedding_scale": 1.5}


@pytest.fixture(scope="module", params=[(8, 96, 16, None), (16, 16, 8, None), (8, 16, 8, SCALED)],
                ids=["W8-V96-K16", "W16-V16-K8", "W8-scaled"])
def pair2(request, tmp_path_factory):
    """(block size, vocabulary, selector top-k, extra dflash_config): the small vocabulary makes random drafts
    accepted more often; the scaled drafter sets z-lab's logit multiplier, soft cap and embedding scale."""
    w, vocab, top_k, extra = request.param
    root = tmp_path_factory.mktemp(f"dflash2-w{w}")
    write_target(root / "target", layers=4, vocab=vocab)
    write_drafter2(root / "drafter", block_size=w, seed=3, target_layer_ids=(0, 2, 3), vocab=vocab,
                   mask_token_id=vocab - 1, selector_top_k=top_k, dflash_extra=extra)
    return root / "target", root / "drafter"


def _reference(folder):
    model, info = zlab.DFlash2DraftModel.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _hf_target(folder):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@torch.no_grad()
def test_drafter_step_equals_zlab_in_a_packed_batch(pair2):
    """Hidden states, candidates and the greedy path of every request of one packed forward (ragged contexts,
    pages out of order) equal z-lab's drafter run on that request alone."""
    target_dir, drafter_dir = pair2
    ref, hf = _reference(drafter_dir), _hf_target(target_dir)
    target = load_target(target_dir, "float32")
    ours = load_drafter(drafter_dir, target.config, "float32")
    assert isinstance(ours, DFlash2DraftModel)
    w, mask, k = ref.block_size, ref.mask_token_id, ref.candidate_selector.top_k
    assert ours.config.block_size == w and ours.config.dflash2.selector_top_k == k
    gen = torch.Generator().manual_seed(0)
    ctx_lens = [5, 13, 1, 9]
    prompts = [torch.randint(0, mask, (c,), generator=gen) for c in ctx_lens]
    anchors = torch.randint(0, mask, (len(ctx_lens),), generator=gen)
    lc = ours.config.layers
    pages_per = [-(-(c + w) // PAGE) for c in ctx_lens]
    cache = PagedKVCache(lc.num_hidden_layers, 1 + sum(pages_per), PAGE, lc.num_key_value_heads, lc.head_dim,
                         torch.float32, "cpu")
    free = list(range(sum(pages_per), 0, -1))  # NOTE: descending page ids: every table out of order
    tables = [[free.pop(0) for _ in range(k)] for k in pages_per]
    want = []
    for prompt, anchor, table in zip(prompts, anchors, tables):
        out = hf(prompt[None], output_hidden_states=True)
        feats = zlab.extract_context_feature(out.hidden_states, ref.target_layer_ids)  # [1, c, L * d]
        block = torch.tensor([[int(anchor)] + [mask] * (w - 1)])
        c = prompt.shape[0]
        scale = float(zlab._draft_value(ref.config, "input_embedding_scale", 1.0))
        hidden = ref(target_hidden=feats, noise_embedding=zlab._raw_input_embeddings(hf, block, scale),
                     position_ids=torch.arange(c + w)[None])[:, 1:]
        path, candidates, _ = ref.propose(hidden, block[:, 0], hf.lm_head, 0.0)
        logits = ref.compute_logits(hidden, hf.lm_head)
        want.append((hidden[0], candidates[0], path[0], logits[0].argmax(-1)))
        positions = torch.arange(c)
        slots = torch.tensor(table)[positions // PAGE] * PAGE + positions % PAGE
        ours.inject_context(feats[0], positions, slots, cache.layers)
    block = torch.full((len(ctx_lens), w), mask)
    block[:, 0] = anchors
    meta = build_metadata([w] * len(ctx_lens), ctx_lens, tables, PAGE, "cpu", causal=False)
    scores, hidden, q = ours.propose_walk(block, target, meta, cache.layers)
    assert q is None and scores.shape == (len(ctx_lens), w - 1, k)
    overturned = 0
    for i, (ref_hidden, ref_candidates, ref_path, top1) in enumerate(want):
        torch.testing.assert_close(hidden[i], ref_hidden, atol=2e-5, rtol=1e-5, msg=f"request {i}")
        ours_candidates = ours.head_logits(hidden[i : i + 1], target)[0].topk(k, dim=-1).indices
        assert torch.equal(ours_candidates.sort(-1).values, ref_candidates.sort(-1).values), f"request {i}"
        assert torch.equal(block[i, 1:], ref_path), f"request {i}"
        overturned += int((ref_path != top1).sum())
    assert overturned > 0, "the selector must overturn some top-1 logit for the test to mean anything"


@torch.no_grad()
def test_greedy_generation_equals_zlab_step_for_step(pair2, monkeypatch):
    """Our engine's greedy DFlash 2 decoding (fp32) equals z-lab's `dflash_generate`: tokens and the accepted
    length of every step; and target-only decoding token for token."""
    target_dir, drafter_dir = pair2
    ref, hf = _reference(drafter_dir), _hf_target(target_dir)
    monkeypatch.setattr(zlab, "_cuda_time", time.perf_counter)  # NOTE: its stats time with CUDA syncs
    w = ref.block_size
    prompts = [[3, 7, 12, 5, 9], [6, 2], [11] * 12]
    new = 24
    cfg = EngineConfig(mode="dflash", dtype="float32", max_model_len=128, max_running_requests=4)
    engine = Engine.from_pretrained(target_dir, drafter_dir, config=cfg)
    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    target_only = Engine.from_pretrained(target_dir, None, config=EngineConfig(
        mode="target", dtype="float32", max_model_len=128)).generate(
        prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    accepted_total = 0
    for prompt, got, plain in zip(prompts, outputs, target_only):
        assert got.token_ids == plain.token_ids
        # NOTE: z-lab shortens its last blocks near max_length; running it 2W further keeps every block we
        # compare full width, as ours always are.
        stats = zlab.dflash_generate(ref, hf, torch.tensor([prompt]), new + 2 * w, None, temperature=0.0,
                                     return_stats=True)
        assert stats.output_ids[0, len(prompt) : len(prompt) + new].tolist() == got.token_ids
        steps = got.stats.accepted_lens
        assert [a + 1 for a in steps] == stats.acceptance_lengths[: len(steps)]
        accepted_total += sum(steps)
    assert accepted_total > 0, "drafts must be accepted for the comparison to mean anything"


# ---------------------------------------------------------------------------------------------- loading
def _edit(folder, edit):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_loader_dispatches_on_the_architecture_and_refuses_unread_or_missing_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    write_target(tmp_path / "t")
    tcfg = load_target_config(tmp_path / "t")
    one = load_drafter(write_drafter(tmp_path / "d1", block_size=8), tcfg, "float32")
    assert type(one).__name__ == "DFlashDraftModel" and one.config.dflash2 is None
    folder = write_drafter2(tmp_path / "d2", block_size=8)
    two = load_drafter(folder, tcfg, "float32")
    assert isinstance(two, DFlash2DraftModel) and two.config.block_size == 8

    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    # an nn.Embedding-style export of the codebooks (`.weight`) is the same tensor ...
    renamed = {(k + ".weight" if k.endswith("codebook") else k): v for k, v in tensors.items()}
    save_file(renamed, str(weights))
    again = load_drafter(folder, tcfg, "float32")
    assert torch.equal(again.candidate_selector.successor_codebook, two.candidate_selector.successor_codebook)
    # ... but never both at once
    save_file({**tensors, **{k: v.clone() for k, v in renamed.items()}}, str(weights))
    with pytest.raises(CheckpointError, match="predecessor_codebook.weight"):
        load_drafter(folder, tcfg, "float32")
    # a missing convolution tensor is named
    save_file({k: v for k, v in tensors.items() if k != "layers.1.mlp_conv.base_kernel"}, str(weights))
    with pytest.raises(CheckpointError, match="layers.1.mlp_conv.base_kernel"):
        load_drafter(folder, tcfg, "float32")
    # DFlash 2 tensors under a DFlash 1 config would be left unread: refused with the reason
    save_file(tensors, str(weights))
    _edit(folder, lambda c: c.__setitem__("architectures", ["DFlashDraftModel"]))
    with pytest.raises(CheckpointError, match="DFlash2DraftModel"):
        load_drafter(folder, tcfg, "float32")
    # a DFlash 2 config without its selector fields names the field
    _edit(folder, lambda c: (c.__setitem__("architectures", ["DFlash2DraftModel"]),
                             c["dflash_config"].pop("selector_rank")))
    with pytest.raises(CheckpointError, match="selector_rank"):
        load_drafter(folder, tcfg, "float32")
    _edit(folder, lambda c: c["dflash_config"].update(selector_rank=8, conv_group_size=5))
    with pytest.raises(CheckpointError, match="conv_group_size"):
        load_drafter(folder, tcfg, "float32")


def save_predictor(folder, pair_paths, seed=0):
    """An untrained (seeded random) predictor artifact over the pair's W - 1 draft slots."""
    tcfg, dcfg = load_target_config(pair_paths[0]), load_drafter_config(pair_paths[1])
    torch.manual_seed(seed)
    model = AcceptancePredictor(drafter_feature_spec(dcfg))
    path = folder / f"predictor-{seed}.pt"
    torch.save(predictor_artifact(model, pair_identity(tcfg, dcfg), hidden_projection(model.spec, tcfg.hidden_size)),
               path)
    return path


def test_a_dflash1_predictor_is_refused_beside_a_dflash2_drafter(pair2, tmp_path):
    target_dir, drafter_dir = pair2
    vocab = load_target_config(target_dir).vocab_size
    stale = save_predictor(tmp_path, (target_dir, write_drafter(
        tmp_path / "d1", block_size=load_drafter_config(drafter_dir).block_size, vocab=vocab,
        mask_token_id=vocab - 1, target_layer_ids=(0, 2, 3))))
    with pytest.raises(ValueError, match="DFlash 1 and DFlash 2"):
        Engine.from_pretrained(target_dir, drafter_dir, predictor=stale,
                               config=EngineConfig(mode="dscale", max_model_len=64))


# ---------------------------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_dscale_over_dflash2_greedy_equals_target_only(pair2, tmp_path, ratio):
    target_dir, drafter_dir = pair2
    predictor = save_predictor(tmp_path, pair2)
    prompts = [[1 + (i * 7 + j) % 12 for j in range(1 + i % 9)] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = Engine.from_pretrained(target_dir, None, config=EngineConfig(mode="target", max_model_len=64)).generate(
        prompts, params)
    engine = Engine.from_pretrained(target_dir, drafter_dir, predictor=predictor, config=EngineConfig(
        mode="dscale", max_model_len=64, budget_ratio=ratio, max_running_requests=12, full_width_max_batch=0))
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    w = engine.block_size
    c = engine.counters
    assert c.verify_rows < (ratio + 0.1) * w * c.request_steps, "the budget must cut verification rows"
    lens = collections.Counter(k for o in got for k in o.stats.verify_lens)
    assert len(lens) > 2, f"the predictor must spread verify lengths, got {dict(lens)}"


# ---------------------------------------------------------------------------------------------- sampled, exact
@pytest.fixture(scope="module")
def small_pair2(tmp_path_factory):
    """Vocabulary 8, the selector's top 4: the residual max(p - q, 0) keeps mass outside the candidates."""
    root = tmp_path_factory.mktemp("small2")
    write_target(root / "target", vocab=8, hidden=32, seed=5)
    write_drafter2(root / "drafter", vocab=8, mask_token_id=7, seed=6, selector_top_k=4)
    return root / "target", root / "drafter"


SAMPLED = [  # (mode, sampling_rule, budget_ratio, params)
    ("dflash", "sampled", 0.5, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)),
    ("dflash", "top1", 0.5, SamplingParams(temperature=0.8, top_k=5, max_tokens=3, ignore_eos=True)),
    ("dscale", "sampled", 0.5, SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)),
    ("dscale", "sampled", 0.25, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, ignore_eos=True)),
]


@pytest.mark.parametrize("mode,rule,ratio,params", SAMPLED,
                         ids=[f"{m}-{r}-{b}-T{p.temperature}-p{p.top_p}-k{p.top_k}" for m, r, b, p in SAMPLED])
def test_sampled_dflash2_output_has_the_target_distribution(small_pair2, tmp_path, mode, rule, ratio, params):
    """Drafts drawn from the selector's q over its candidates (or its greedy path under the top-1 rule), the
    sparse q in verification: the output follows the target's exact sequence probabilities (chi-square), in
    DFlash and in DScale over DFlash 2 at budgets 0.5 and 0.25."""
    from test_sampling import PROMPT, exact_sequence_probs, goodness_of_fit

    target, drafter = small_pair2
    exact = exact_sequence_probs(target, params)
    predictor = save_predictor(tmp_path, small_pair2, 3) if mode == "dscale" else None
    cfg = EngineConfig(mode=mode, max_model_len=32, max_running_requests=256, seed=11, budget_ratio=ratio,
                       sampling_rule=rule)
    engine = Engine.from_pretrained(target, drafter, predictor=predictor, config=cfg)
    outputs = engine.generate([PROMPT] * 2000, params)
    kinds = {kind for _, kind in engine.runner.steps}
    assert any(k.draft_sampling for k in kinds) == (rule == "sampled")
    assert engine.counters.accepted_drafts > 300, "drafts must be accepted for the test to mean anything"
    if mode == "dscale":
        assert engine.counters.verify_rows <= ratio * 16 * engine.counters.request_steps + engine.counters.steps
    p_value = goodness_of_fit(collections.Counter(tuple(o.token_ids) for o in outputs), exact)
    assert p_value > 1e-3, f"{mode}/{rule} over DFlash 2 differs from the target's distribution (p={p_value:.3g})"


@torch.no_grad()
def test_sampled_walk_draws_from_the_selector_q_with_keyed_uniforms(pair2):
    """A sampled walk at uniforms u picks, at every slot, the inverse-CDF choice of softmax(scores / T) over the
    candidates; its q rows are those distributions; the same uniforms give the same path; greedy rows in the
    same walk keep the greedy path."""
    _, drafter_dir = pair2
    target = load_target(pair2[0], "float32")
    ours = load_drafter(drafter_dir, target.config, "float32")
    sel, w = ours.candidate_selector, ours.config.block_size
    gen = torch.Generator().manual_seed(1)
    n, d, k = 6, ours.config.layers.hidden_size, sel.top_k
    hidden = torch.randn(n, w - 1, d, generator=gen)
    unary = torch.randn(n, w - 1, k, generator=gen) * 2
    candidates = torch.stack([torch.randperm(target.config.vocab_size, generator=gen)[:k]
                              for _ in range(n * (w - 1))]).view(n, w - 1, k)
    anchors = torch.randint(0, target.config.vocab_size, (n,), generator=gen)
    temperature = torch.tensor([1.0, 0.5, 2.0, 1.0, 0.7, 1.0])
    draw = torch.tensor([True, True, True, False, True, False])
    u = torch.rand(n, w - 1, generator=gen, dtype=torch.float64)
    path, scores, q = sel.walk(hidden, unary, candidates, anchors, temperature, draw, u)
    greedy_path, greedy_scores, none = sel.walk(hidden, unary, candidates, anchors)
    assert none is None
    assert torch.equal(path[~draw], greedy_path[~draw]) and torch.equal(scores[~draw], greedy_scores[~draw])
    torch.testing.assert_close(q, torch.softmax(scores.double() / temperature.double()[:, None, None], -1))
    cdf = q.cumsum(-1)
    index = (cdf < u[..., None] * cdf[..., -1:]).sum(-1).clamp(max=k - 1)
    assert torch.equal(path[draw], candidates.gather(-1, index[..., None])[..., 0][draw])
    again, _, _ = sel.walk(hidden, unary, candidates, anchors, temperature, draw, u)
    assert torch.equal(again, path)
    ref_path, ref_scores, ref_q = walk_ref(sel, hidden, unary, candidates, anchors, temperature, draw, u)
    assert torch.equal(path, ref_path)
    torch.testing.assert_close(scores, ref_scores, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(q, ref_q, atol=1e-6, rtol=1e-5)
    assert not torch.equal(path[draw], greedy_path[draw]), "some sampled slot must leave the greedy path"


@pytest.mark.parametrize("slots", [1, 2, 7, 8, 15, 16])
def test_follow_choices_equals_the_walk_slot_by_slot(slots):
    """The doubling scan of `follow_choices` reads the same path as P gathers one slot after the other."""
    gen = torch.Generator().manual_seed(slots)
    choice = torch.randint(0, 5, (4, slots, 5), generator=gen)
    at, chain = torch.zeros(4, dtype=torch.long), []
    for j in range(slots):
        at = choice[:, j].gather(1, at[:, None])[:, 0]
        chain.append(at)
    assert torch.equal(follow_choices(choice), torch.stack(chain, 1))


def test_candidate_topk_over_slices_keeps_the_top_k():
    """The top-k over slices (Qwen3's vocabulary: 1,187 slices of 128): the same values, largest first, at token ids
    holding them (distinct ids), on rows with and without tied values and with the whole top k in one slice;
    without ties the same ids as torch.topk."""
    assert candidate_chunks(151936, 16) == 1187 and candidate_chunks(4096, 16) == 1
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4096, generator=gen)
    logits[0, 256:272] += 10.0  # the row's top 16 all in one slice
    tied = (logits * 4).round() / 4  # many equal values around the k-th
    for rows, exact in ((logits, True), (tied, False)):
        want, want_ids = rows.topk(16, dim=-1)
        got, ids = candidate_topk(rows, 16, chunks=32)
        assert torch.equal(got, want) and torch.equal(rows.gather(1, ids), got)
        assert all(len(set(r.tolist())) == 16 for r in ids)
        if exact:
            assert torch.equal(ids, want_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_slice_maxima_equal_amax(interpreter, dtype):
    """The one-launch slice maxima (Triton's interpreter) equal `amax` over each slice exactly, at a power-of-two
    slice width and at one that is not (masked columns), on a strided row view; the top-k over slices through
    them equals the one through torch's maxima."""
    from dscale_runtime.kernels.triton_conv import slice_max_triton

    gen = torch.Generator().manual_seed(1)
    for vocab, chunks in ((4096, 32), (1200, 50)):  # slices of 128 and of 24
        wide = torch.randn(5, vocab + 8, generator=gen).to(dtype)
        logits = wide[:, 4:4 + vocab]  # rows strided by vocab + 8
        logits[1, :vocab // chunks] = 50.0  # a slice of equal maxima
        got = slice_max_triton(logits, chunks)
        assert torch.equal(got, logits.reshape(5, chunks, -1).amax(-1))
        want = candidate_topk(logits, 16, chunks)
        tri = candidate_topk(logits, 16, chunks, backend="triton")
        assert torch.equal(tri[0], want[0]) and torch.equal(tri[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_slices_topk_equals_torch_topk(interpreter, dtype, monkeypatch):
    """The one-launch top-k after the slice maxima (Triton's interpreter): torch.topk's values, largest first, at
    distinct token ids holding them; ties go to the first slice picked, then the lowest column (two maximal
    tokens: the lower id first); rows with fewer finite logits than k, a slice width that is not a power of two
    and a slice count that is not (Qwen3's 1,187 over a vocabulary of 1,187 x 16). `candidate_topk` takes it on the
    Triton path when `TOPK_KERNEL` says so, and torch's two top-k calls otherwise."""
    from dscale_runtime.kernels import triton_conv

    gen = torch.Generator().manual_seed(2)
    for vocab, chunks, k in ((4096, 32, 16), (1200, 50, 8), (1187 * 16, 1187, 16)):
        logits = (torch.randn(4, vocab, generator=gen) * 3).to(dtype)
        logits[0, 700] = logits[0, 70] = logits[0].max() + 1  # a tie at the top, in two slices
        logits[1, :] = float("-inf")
        logits[1, [5, vocab - 1, vocab // 2]] = torch.tensor([1.0, 3.0, 2.0], dtype=dtype)  # 3 finite logits < k
        logits[2] = (logits[2] * 2).round() / 2  # many equal values around the k-th
        maxima = triton_conv.slice_max_triton(logits, chunks)
        values, ids = triton_conv.slices_topk_triton(logits, maxima, k)
        assert torch.equal(values, logits.topk(k, dim=-1).values), (vocab, k)
        assert torch.equal(logits.gather(1, ids), values) and all(len(set(r.tolist())) == k for r in ids)
        assert ids[0, :2].tolist() == [70, 700] and ids[1, :3].tolist() == [vocab - 1, vocab // 2, 5]
        monkeypatch.setattr(triton_conv, "TOPK_KERNEL", "triton")
        routed = candidate_topk(logits, k, chunks, backend="triton")
        assert torch.equal(routed[0], values) and torch.equal(routed[1], ids)
        monkeypatch.setattr(triton_conv, "TOPK_KERNEL", "torch")
        assert torch.equal(candidate_topk(logits, k, chunks, backend="triton")[0], values)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["ref", "triton", "triton-topk"])
@pytest.mark.parametrize("rows", [120, 480])
def test_candidate_topk_over_slices_captured_at_qwen3_vocabulary(rows, backend, monkeypatch):
    """At Qwen3's vocabulary (1,187 slices) and the draft rows of N = 8 / 32, bf16, with torch's slice maxima, the
    Triton ones, and the Triton ones with the one-launch top-k after them: replayed from a CUDA graph over new
    logits, the sliced top-k equals its eager call and torch.topk's values."""
    if backend == "triton-topk":
        from dscale_runtime.kernels import triton_conv

        monkeypatch.setattr(triton_conv, "TOPK_KERNEL", "triton")
        backend = "triton"
    vocab = 151936
    chunks = candidate_chunks(vocab, 16)
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, vocab, generator=gen, device="cuda").to(torch.bfloat16)
    candidate_topk(logits, 16, chunks, backend)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, ids = candidate_topk(logits, 16, chunks, backend)
    for _ in range(2):
        logits.copy_(torch.randn(rows, vocab, generator=gen, device="cuda").to(torch.bfloat16))
        graph.replay()
        eager = candidate_topk(logits, 16, chunks, backend)
        assert torch.equal(values, eager[0]) and torch.equal(ids, eager[1])
        assert torch.equal(values, logits.topk(16, dim=-1).values) and torch.equal(logits.gather(1, ids), values)


# ---------------------------------------------------------------------------------------------- serving
def test_dscale_serve_with_a_dflash2_drafter_answers_like_target_only(tmp_path):
    """`dscale-serve --mode dscale --drafter <DFlash 2 folder> --predictor ...` (flags parsed as the command
    does): greedy completions through the openai client equal target-only decoding."""
    import openai

    from dscale_runtime.server.config import ServeConfig
    from dscale_runtime.server.flags import parse_config
    from dscale_runtime.server.main import BackgroundServer, load_engine

    write_target(tmp_path / "target", tokenizer=True)
    write_drafter2(tmp_path / "drafter", block_size=8, seed=4)
    predictor = save_predictor(tmp_path, (tmp_path / "target", tmp_path / "drafter"))
    flags = ["--mode", "dscale", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
             "--predictor", str(predictor), "--max-model-len", "96", "--max-running-requests", "4", "--port", "0"]
    config = parse_config(ServeConfig, "dscale-serve", flags)
    engine = load_engine(config)
    assert isinstance(engine.drafter, DFlash2DraftModel) and engine.block_size == 8
    prompts = ["def f(x):", "class A:", "import os"]
    want = Engine.from_pretrained(tmp_path / "target", config=EngineConfig(mode="target", max_model_len=96)).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    with BackgroundServer(engine, config) as server:
        api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for prompt, expected in zip(prompts, want):
            answer = api.completions.create(model=config.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert answer.choices[0].text == expected.text
    assert engine.counters.request_steps > 0


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["dflash", "dscale"])
def test_captured_dflash2_steps_equal_eager_steps(tmp_path, mode):
    """Greedy, seeded T = 1 (sampled drafts: the selector's keyed draws and sparse q) and seeded T = 0.7 /
    top_p 0.8 (top-1 rule) requests in one batch on CUDA (fp32): graphs on and off decode the same tokens, and
    the greedy ones equal target-only decoding."""
    write_target(tmp_path / "target", vocab=16)
    write_drafter2(tmp_path / "drafter", vocab=16, mask_token_id=15, selector_top_k=8, seed=3)
    predictor = save_predictor(tmp_path, (tmp_path / "target", tmp_path / "drafter")) if mode == "dscale" else None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 15, (int(n),), generator=gen).tolist() for n in torch.randint(1, 30, (12,))]
    points = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8)]
    params = [SamplingParams(temperature=points[i % 3][0], top_p=points[i % 3][1], max_tokens=28, ignore_eos=True,
                             seed=i) for i in range(len(prompts))]
    tokens = {}
    for graphs in (False, True):
        cfg = EngineConfig(mode=mode, device="cuda", dtype="float32", max_model_len=128, step_graphs=graphs,
                           max_running_requests=12, dscale_policy="always", target_fallback=False,
                           overlap_schedule=False)
        engine = Engine.from_pretrained(tmp_path / "target", tmp_path / "drafter", predictor, config=cfg)
        tokens[graphs] = [o.token_ids for o in engine.generate(prompts, params)]
        if graphs:
            assert engine.runner.steps and all(s.call.graph is not None for s in engine.runner.steps.values())
            assert any(kind.draft_sampling for _, kind in engine.runner.steps)
        assert engine.counters.accepted_drafts > 0
    assert tokens[True] == tokens[False]
    plain = Engine.from_pretrained(tmp_path / "target", config=EngineConfig(
        mode="target", device="cuda", dtype="float32", max_model_len=128)).generate(prompts[::3], params[::3])
    assert tokens[True][::3] == [o.token_ids for o in plain]


def test_dscale_over_dflash2_reads_the_selector_scores(pair2, tmp_path, monkeypatch):
    """The predictor's confidence columns come from the selector's scores along the walked path ([N, W-1, K]:
    top score, its gaps, log q(best) at T = 1, entropy over the candidates), not from the drafter's V logits."""
    import dscale_runtime.runner as runner_module
    from dscale_runtime.dvl.features import confidence_features_ref

    target_dir, drafter_dir = pair2
    engine = Engine.from_pretrained(target_dir, drafter_dir, predictor=save_predictor(tmp_path, pair2),
                                    config=EngineConfig(mode="dscale", max_model_len=64, max_running_requests=4))
    walked, read = [], []
    propose_walk = engine.drafter.propose_walk
    monkeypatch.setattr(engine.drafter, "propose_walk", lambda *a, **kw: walked.append(propose_walk(*a, **kw))
                        or walked[-1])
    features = runner_module.acceptance_features
    monkeypatch.setattr(runner_module, "acceptance_features",
                        lambda spec, logits, *rest: read.append((logits, features(spec, logits, *rest))) or read[-1][1])
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert walked and len(read) == len(walked)
    k = engine.drafter.config.dflash2.selector_top_k
    for (scores, _, _), (logits, row) in zip(walked, read):
        assert logits is scores and scores.shape[-1] == k
        spec = engine.feature_spec
        assert torch.equal(row[:, : spec.num_confidence], confidence_features_ref(scores, spec.num_ranks))
        chosen = scores.argmax(-1, keepdim=True)  # greedy: the walked token is the best-scored candidate
        logq = torch.log_softmax(scores, -1).gather(-1, chosen)[..., 0]
        per = row[:, : spec.num_confidence].view(row.shape[0], spec.num_positions, spec.per_position)
        torch.testing.assert_close(per[..., spec.num_ranks], logq)


def test_tensor_parallel_shards_keep_the_dflash2_parts_whole(tmp_path):
    """Under tensor parallelism a rank's DFlash 2 drafter holds its heads' slices of the Qwen3 layers and the
    whole of every DFlash 2 part (convolutions, selector): they act on the whole residual stream and the whole
    vocabulary's logits, which every rank has (`parallel.py`)."""
    from dscale_runtime.models.parallel import TensorParallel, shard_dim

    write_target(tmp_path / "t")
    folder = write_drafter2(tmp_path / "d", block_size=8)
    tcfg = load_target_config(tmp_path / "t")
    whole = dict(load_drafter(folder, tcfg, "float32").named_parameters())
    parts = {}
    for rank in range(2):
        drafter = load_drafter(folder, tcfg.shard(2), "float32", tp=TensorParallel(None, rank, 2))
        assert isinstance(drafter, DFlash2DraftModel) and drafter.config.layers.num_key_value_heads == 1
        for name, p in drafter.named_parameters():
            parts.setdefault(name, []).append(p)
    dflash2 = [n for n in parts if "conv" in n or "candidate_selector" in n]
    assert len(dflash2) == 2 * 2 * 2 + 3  # 2 layers x 2 convolutions x 2 tensors, 3 selector tensors
    for name, pieces in parts.items():
        dim = shard_dim(name)
        if name in dflash2:
            assert dim is None
        joined = pieces[0] if dim is None else torch.cat(pieces, dim=dim)
        assert all(torch.equal(p, whole[name]) for p in pieces) if dim is None else torch.equal(joined, whole[name])


# ---------------------------------------------------------------------------------------------- Triton kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("taps,group,d,w", [(3, 8, 96, 8), (4, 16, 96, 8), (1, 32, 96, 8), (4, 128, 384, 6)])
def test_triton_block_convolution_equals_the_reference(interpreter, dtype, taps, group, d, w):
    """Both one-launch convolutions (per row, per block tile; Triton's interpreter on CPU) against
    `block_convolve_ref` on packed blocks, the dynamic taps a strided view of a projection's output as the layers
    pass them: fp32 to rounding, bf16 within one ulp of the output (the few-term fp32 sum may be added in another
    order), and the two kernels bit for bit alike. Shapes: groups narrower than a tile (the gathered taps), groups
    of a whole tile (one tap per row), a partial channel tile (d = 96) and a block narrower than a power of two."""
    from dscale_runtime.kernels.triton_conv import block_convolve_triton
    from dscale_runtime.models.dflash2 import block_convolve_ref

    gen = torch.Generator().manual_seed(taps * group)
    n = 3
    x = torch.randn(n * w, d, generator=gen).to(dtype)
    dynamic = torch.randn(n, w, 2, taps, d // group, generator=gen).to(dtype)[:, :, 1]  # [N, W, taps, G] strided
    base = torch.randn(taps, d, generator=gen).to(dtype)
    got = block_convolve_triton(x, dynamic, base, group, kernel="row")
    want = block_convolve_ref(x.view(n, w, d), dynamic, base, group).view(n * w, d)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
    assert torch.equal(block_convolve_triton(x, dynamic, base, group, kernel="tile"), got)
    # a block's first slots read zeros before it: changing another block's rows changes nothing here
    other = x.clone()
    other[w:] += 1.0
    for kernel in ("row", "tile"):
        assert torch.equal(block_convolve_triton(other, dynamic, base, group, kernel=kernel)[:w], got[:w])


@torch.no_grad()
def test_drafter_with_triton_convolutions_matches_the_reference_path(pair2, interpreter):
    """The whole DFlash 2 block forward with `fused='triton'` (its norms and convolutions through the
    interpreted kernels) drafts what the portable path drafts."""
    from dscale_runtime.kernels import KernelChoice

    target_dir, drafter_dir = pair2
    target = load_target(target_dir, "float32")
    ours = load_drafter(drafter_dir, target.config, "float32", kernels=KernelChoice())
    w, lc = ours.config.block_size, ours.config.layers
    cache = PagedKVCache(lc.num_hidden_layers, 9, PAGE, lc.num_key_value_heads, lc.head_dim, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(2)
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    tables, ctx = [[1, 2, 3, 4], [8, 7, 6, 5]], [7, 12]
    block = torch.full((2, w), ours.config.mask_token_id)
    block[:, 0] = torch.tensor([3, 5])
    meta = lambda: build_metadata([w, w], ctx, tables, PAGE, "cpu", causal=False)  # noqa: E731
    ref_block = block.clone()
    ref_scores, ref_hidden, _ = ours.propose_walk(ref_block, target, meta(), cache.layers)
    ours.use_kernels(KernelChoice(fused="triton"))
    assert ours.layers[0].attention_conv.kernels.fused == "triton"
    tri_block = block.clone()
    tri_scores, tri_hidden, _ = ours.propose_walk(tri_block, target, meta(), cache.layers)
    torch.testing.assert_close(tri_hidden, ref_hidden, atol=5e-5, rtol=1e-4)
    assert torch.equal(tri_block, ref_block)


def test_dflash2_kernels_build_for_sm90_without_spills():
    """The convolution, slice-maxima and slice top-k kernels compiled for sm_90 without a GPU (Triton's bundled ptxas), at
    Qwen3-8B's width and vocabulary slices and the demo's: what the interpreter tests cannot check (it runs code
    the compiler refuses, e.g. a constexpr reassigned in a static_range)."""
    from dscale_runtime.kernels.choice import triton_available

    if not triton_available():
        pytest.skip("triton is not installed")
    from offline import run_without_interpreter

    lines = run_without_interpreter("""
import torch
from dscale_runtime.kernels import stack_usage
from dscale_runtime.kernels.triton_conv import compile_offline
for dtype, d, group, width in [(torch.bfloat16, 4096, 128, 128), (torch.float32, 384, 32, 128), (torch.bfloat16, 96, 8, 24)]:
    for kernel in compile_offline(dtype, d, 4, group, width):
        print(str(dtype).split(".")[1], d, stack_usage(kernel))
""")
    assert len(lines) == 12 and all(line.endswith(("STACK:0", "?")) for line in lines), lines


@pytest.mark.gpu
@needs_cuda
def test_compiled_block_convolution_equals_the_reference_at_qwen3_8b_width():
    from dscale_runtime.kernels.triton_conv import block_convolve_triton
    from dscale_runtime.models.dflash2 import block_convolve_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, w, d, taps, group = 32, 16, 4096, 4, 128
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n * w, d, device="cuda", generator=gen).to(dtype)
        dynamic = torch.randn(n, w, 2, taps, d // group, device="cuda", generator=gen).to(dtype)[:, :, 0]
        base = torch.randn(taps, d, device="cuda", generator=gen).to(dtype)
        got = block_convolve_triton(x, dynamic, base, group, kernel="row")
        want = block_convolve_ref(x.view(n, w, d), dynamic, base, group).view(n * w, d)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
        else:
            torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
        assert torch.equal(block_convolve_triton(x, dynamic, base, group, kernel="tile"), got)


# ---------------------------------------------------------------------------------------------- collect, train
def test_collect_train_and_serve_over_a_dflash2_drafter(tmp_path):
    """dscale-collect over a DFlash 2 drafter writes the DFlash 2 feature version; dscale-train on those traces
    exports a predictor for that drafter; DScale with it decodes what target-only decodes."""
    from dscale_predictor.train import TrainConfig, train
    from trace_collection.collect import CollectConfig, collect
    from trace_collection.sources import DatasetSpec

    write_target(tmp_path / "target", tokenizer=True, vocab=24)
    write_drafter2(tmp_path / "drafter", vocab=24, mask_token_id=23, selector_top_k=8, block_size=8)
    rows = [{"id": f"p{i}", "prompt": "".join(chr(33 + (i * 5 + j) % 20) for j in range(3 + i % 7))}
            for i in range(16)]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = collect(CollectConfig(
        target=str(tmp_path / "target"), drafter=str(tmp_path / "drafter"), output=str(tmp_path / "traces"),
        datasets=[DatasetSpec("jsonl", path=str(prompts), label="tiny")], concurrency=[4, 8], max_new_tokens=24,
        chunk_prompts=8, max_model_len=96, progress=False))
    assert manifest["feature_spec"]["version"] == FEATURE_VERSION_DFLASH2
    assert manifest["feature_spec"]["num_positions"] == 7
    train(TrainConfig(traces=str(tmp_path / "traces"), run_dir=str(tmp_path / "run"),
                      artifacts_dir=str(tmp_path / "artifacts"), export_name="d2", max_epochs=2, batch_size=64,
                      accelerator="cpu"))
    artifact = tmp_path / "artifacts" / "d2.pt"
    assert torch.load(artifact, weights_only=True)["identity"]["drafter"]["architecture"] == "DFlash2DraftModel"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    heads = [r["prompt"] for r in rows[:6]]
    want = Engine.from_pretrained(tmp_path / "target", config=EngineConfig(mode="target", max_model_len=96)).generate(
        heads, params)
    engine = Engine.from_pretrained(tmp_path / "target", tmp_path / "drafter", predictor=artifact,
                                    config=EngineConfig(mode="dscale", max_model_len=96, max_running_requests=6))
    assert engine.feature_spec.version == FEATURE_VERSION_DFLASH2
    assert [o.token_ids for o in engine.generate(heads, params)] == [o.token_ids for o in want]
