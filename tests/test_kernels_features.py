"""Triton confidence features against the reference beside them (`kernels.features.confidence_features_ref`),
the router, and `dvl.features.acceptance_features`' choice of path.

The kernel cases run through Triton's interpreter on CPU machines with triton installed (conftest sets
TRITON_INTERPRET=1 when there is no CUDA device), and compiled on CUDA (marker `gpu`, at Qwen3's vocabulary and
in a CUDA graph). Every kernel call writes into a NaN-poisoned output. The reference runs in fp32 on the same
(upcast) values: top1 and the gaps must equal its values exactly, the log-probability and entropy agree within
rtol 1e-4 / atol 1e-5 with it (rows of finite logits up to 100) and with a float64 oracle (every row).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from markers import needs_cuda, needs_triton
from dscale_runtime.dvl import features as dvl_features
from dscale_runtime.dvl.features import (FeatureSpec, acceptance_features, context_features, hidden_projection,
                                         sampling_features)
from dscale_runtime.kernels import KernelChoice
from dscale_runtime.kernels.features import confidence_features, confidence_features_ref, features_backend

RANKS = 16
QWEN3_VOCAB = 151936


def random_logits(rows: int, vocab: int, seed: int, scale: float = 4.0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=gen) * scale).to(dtype).to(device)


def oracle(logits: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Per row [R, num_ranks + 2]: top1 and the gaps from the reference on the fp32 upcast; the log-probability
    and entropy of the same values in float64, with 0 * log 0 = 0. NOTE: the reference's own fp32 columns are
    NaN (entropy) for rows with -inf logits, and lose ~1e-4 (logprob) at logits ~1000 (one ulp is 6e-5)."""
    x = logits.float()
    want = confidence_features_ref(x.unsqueeze(1), num_ranks)
    log_p = torch.log_softmax(x.double(), dim=-1)
    entropy = -(log_p.exp() * torch.where(log_p.isfinite(), log_p, 0.0)).sum(-1)
    return torch.cat([want[:, :num_ranks], log_p.max(-1).values[:, None].float(), entropy[:, None].float()], -1)


def run_triton(logits: torch.Tensor, num_ranks: int, config: dict | None = None) -> torch.Tensor:
    from dscale_runtime.kernels.triton_features import confidence_features_triton

    out = torch.full((logits.shape[0], num_ranks + 2), float("nan"), device=logits.device)
    result = confidence_features_triton(logits, num_ranks, out=out, config=config)
    assert result.data_ptr() == out.data_ptr()
    return out


def check(got: torch.Tensor, logits: torch.Tensor, num_ranks: int = RANKS, rtol: float = 1e-4, atol: float = 1e-5):
    want = oracle(logits, num_ranks)
    assert not got.isnan().any(), "unwritten or NaN outputs"
    # top1 and the gaps are exact (the same fp32 values, the same subtraction); inf gaps below -inf ranks.
    torch.testing.assert_close(got[:, :num_ranks], want[:, :num_ranks], rtol=0, atol=0)
    torch.testing.assert_close(got[:, num_ranks:], want[:, num_ranks:], rtol=rtol, atol=atol)
    plain = logits.float().isfinite().all(-1) & (logits.float().abs().amax(-1) <= 100)
    reference = confidence_features_ref(logits.float().unsqueeze(1), num_ranks)  # [R, num_ranks + 2]
    torch.testing.assert_close(got[plain], reference[plain], rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------ interpreter (CPU)
@needs_triton
@pytest.mark.parametrize("rows, vocab, config", [
    (3, 17, None),  # just above the rank count
    (2, RANKS, None),  # exactly the rank count
    (2, 4096, None),  # one full chunk
    (2, 5000, None),  # a full chunk and a partial one
    (1, 20000, None),  # five chunks, the last partial
    (2, 20000, {"TILES": 4}),  # the tile loop: a full 16,384 chunk and a partial one
    (2, 3000, {"GROUPS": 64, "ROWS": 4, "TILES": 2}),  # small groups: 6 chunks of 512
], ids=str)
def test_triton_matches_reference_fp32(rows, vocab, config):
    logits = random_logits(rows, vocab, seed=vocab + rows)
    check(run_triton(logits, RANKS, config), logits)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_matches_reference_16bit(dtype):
    """16-bit logits: the reference sees the same values upcast; bf16 makes many exact ties."""
    logits = random_logits(3, 5000, seed=7, dtype=dtype)
    check(run_triton(logits, RANKS), logits)


@needs_triton
def test_planted_ties_and_spikes():
    """Ties inside the top 16 (within one group, across groups and chunks), a peaked row (entropy ~ 0), a row
    whose top value appears 20 times (gaps all 0) and one with 5 values above thousands of ties."""
    logits = random_logits(4, 9000, seed=3)
    top = logits[0].max().item()
    logits[0, [5, 517, 4200, 8999]] = top + 1.0  # four equal maxima: 5 and 517 share a group, three chunks
    logits[0, [6, 7, 1030]] = top + 0.5  # three equal seconds: neighbours in a tile row, one in 6's group
    logits[1, 123] = logits[1].max() + 40.0  # a single dominant token: entropy and -logprob ~ 1e-13
    logits[2, torch.arange(20) * 449] = logits[2].max() + 2.0  # 20 copies of the top value
    logits[3] = logits[3].clamp(max=2.0)  # ~2,800 values tie at 2.0: the 16th largest group maximum is shared
    logits[3, [100, 612, 4094, 4095, 4096]] = 3.0  # above them: two in one group, three across a chunk boundary
    check(run_triton(logits, RANKS), logits)


@needs_triton
def test_constant_rows_and_large_magnitudes():
    """All-equal rows (gaps 0, logprob -log V, entropy log V) and logits of +-30 and shifted by 1000."""
    vocab = 4096 + 700
    logits = torch.cat([
        torch.zeros(1, vocab), torch.full((1, vocab), -7.25),
        random_logits(2, vocab, seed=11, scale=30.0),
        random_logits(1, vocab, seed=12, scale=30.0) + 1000.0,
        random_logits(1, vocab, seed=13, scale=30.0) - 1000.0,
    ])
    got = run_triton(logits, RANKS)
    check(got, logits)
    log_v = torch.tensor(float(vocab)).log().item()
    for r in (0, 1):
        assert got[r, 1:RANKS].eq(0).all()
        assert got[r, RANKS].item() == pytest.approx(-log_v, rel=1e-6)
        assert got[r, RANKS + 1].item() == pytest.approx(log_v, rel=1e-6)


@needs_triton
def test_minus_inf_logits():
    """-inf logits (masked tokens) anywhere but at rank 1: infinite gaps where fewer than 16 values are finite,
    chunks and groups with no finite value at all; and masking by the lowest finite float instead."""
    logits = random_logits(4, 9000, seed=5)
    logits[0, ::3] = float("-inf")
    logits[3, ::3] = logits[3, 1::3] = torch.finfo(torch.float32).min  # masking by the lowest finite value
    logits[1, :] = float("-inf")
    logits[1, [10, 4500, 8999]] = torch.tensor([1.0, 1.0, -2.0])  # 3 finite values: 13 gaps are inf
    logits[2, 4096:] = float("-inf")  # the second and third chunks have nothing finite
    got = run_triton(logits, RANKS)
    check(got, logits)
    assert got[1, 3:RANKS].isinf().all() and got[1, RANKS + 1].isfinite()


@needs_triton
@pytest.mark.parametrize("num_ranks", [1, 5, 32])
def test_other_rank_counts(num_ranks):
    logits = random_logits(2, 3000, seed=num_ranks)
    check(run_triton(logits, num_ranks), logits, num_ranks)


@needs_triton
def test_strided_rows_and_empty_batch():
    """Rows with a padded stride (a slice of a wider buffer) and zero rows."""
    wide = random_logits(3, 5000 + 64, seed=9)
    logits = wide[:, :5000]
    assert logits.stride(0) == 5064
    check(run_triton(logits, RANKS), logits)
    assert run_triton(wide[:0], RANKS).shape == (0, RANKS + 2)


@needs_triton
def test_compiles_for_sm90_without_spills():
    """The compiled path (not the interpreter): both kernels build for an H200 at the default launch sizes
    of small and large batches, without register spills."""
    from offline import run_without_interpreter

    lines = run_without_interpreter("""
import torch
from dscale_runtime.kernels import stack_usage
from dscale_runtime.kernels.triton_features import compile_offline
for dtype, rows, vocab in [(torch.bfloat16, 15, 151936), (torch.bfloat16, 960, 151936), (torch.float32, 960, 151936),
                           (torch.float32, 480, 16)]:  # NOTE: the last, DFlash 2's 16 selector scores per slot
    for kernel in compile_offline(dtype, rows, vocab):
        print(str(dtype).split(".")[1], rows, stack_usage(kernel))
""")
    assert len(lines) == 8 and all(line.endswith(("STACK:0", "?")) for line in lines), lines


# ------------------------------------------------------------------------------------------- router
def test_router_on_cpu_is_exactly_the_reference(monkeypatch):
    monkeypatch.setenv("DSCALE_FEATURES", "triton")  # read by KernelChoice.resolve only, never by the router
    logits = random_logits(2 * 3, 500, seed=1).view(2, 3, 500)
    assert features_backend(logits, RANKS) == "ref"
    assert torch.equal(confidence_features(logits, RANKS), confidence_features_ref(logits, RANKS))
    assert dvl_features.confidence_features_ref is confidence_features_ref  # the re-export is the definition


@needs_triton
def test_router_runs_the_backend_it_is_given(monkeypatch):
    logits = random_logits(2 * 3, 700, seed=2).view(2, 3, 700)
    want = confidence_features_ref(logits, RANKS)
    monkeypatch.setenv("DSCALE_FEATURES", "ref")  # not read per call: the argument alone decides
    assert features_backend(logits, RANKS, "triton") == "triton"
    got = confidence_features(logits, RANKS, backend="triton")
    assert got.shape == want.shape == (2, 3 * (RANKS + 2)) and got.isfinite().all()
    check(got.view(6, RANKS + 2), logits.view(6, 700))
    assert torch.equal(confidence_features(logits, RANKS, backend="ref"), want)
    # Toy vocabularies smaller than the rank count always take the reference (it pads the missing ranks).
    toy = random_logits(2, 10, seed=3).view(1, 2, 10)
    assert features_backend(toy, RANKS, backend="triton") == "ref"
    assert torch.equal(confidence_features(toy, RANKS, backend="triton"), confidence_features_ref(toy, RANKS))


@needs_triton
def test_acceptance_features_take_the_runners_backend(monkeypatch):
    """`acceptance_features` runs the confidence columns through the backend it is given (the runner's
    KernelChoice.features) and by default through the auto rule: the reference itself on CPU."""
    from dscale_runtime.kernels import triton_features

    calls = []
    original = triton_features.confidence_features_triton
    monkeypatch.setattr(triton_features, "confidence_features_triton",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    spec = FeatureSpec(version="dscale-features-v2")  # NOTE: the confidence path; v3's agreement: test_dvl
    logits = random_logits(2 * spec.num_positions, 300, seed=4).view(2, spec.num_positions, 300)
    hidden = torch.randn(2, spec.num_positions, 24, generator=torch.Generator().manual_seed(5))
    projection = hidden_projection(spec, 24)
    context = context_features(spec, 2, [30, 7], [3, 0], [[4, 15, 0], []], "cpu")
    sampling = sampling_features(spec, torch.tensor([0.0, 0.7]), torch.tensor([False, True]))
    portable = acceptance_features(spec, logits, hidden, projection, context, sampling=sampling)
    assert calls == [] and portable.shape == (2, spec.width)
    assert torch.equal(portable[:, : spec.num_confidence], confidence_features_ref(logits, spec.num_ranks))
    fast = acceptance_features(spec, logits, hidden, projection, context, backend="triton", sampling=sampling)
    assert calls == [1]
    torch.testing.assert_close(fast, portable, rtol=1e-4, atol=1e-5)
    assert torch.equal(fast[:, spec.num_confidence :], portable[:, spec.num_confidence :])


def test_router_rejects_bad_values(monkeypatch):
    logits = torch.zeros(1, 2, 32)
    with pytest.raises(ValueError, match=r"backend='cuda'.*auto, ref, triton"):
        confidence_features(logits, RANKS, backend="cuda")
    monkeypatch.setenv("DSCALE_FEATURES", "fast")
    with pytest.raises(ValueError, match=r"DSCALE_FEATURES='fast'.*auto, ref, triton"):
        KernelChoice.resolve("cpu", torch.float32)


# ----------------------------------------------------------------------------------------------- CUDA
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [8 * 15, 64 * 15])
def test_cuda_matches_reference_at_qwen3_vocab(rows, dtype):
    logits = random_logits(rows, QWEN3_VOCAB, seed=rows, dtype=dtype, device="cuda")
    logits[0, 1000:1000 + 40] = logits[0].max()  # 40 tied maxima
    logits[1, 77] = logits[1].max() + 40.0  # a peaked row
    check(run_triton(logits, RANKS), logits)
    routed = confidence_features(logits.view(rows // 15, 15, QWEN3_VOCAB), RANKS, backend="triton")
    assert features_backend(logits, RANKS) == "triton"
    check(routed.view(rows, RANKS + 2), logits)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_follows_the_logits():
    """Captured once, replayed over new logits copied into the captured buffer: no host read in the launch."""
    rows = 8 * 15
    static = random_logits(rows, QWEN3_VOCAB, seed=0, dtype=torch.bfloat16, device="cuda").view(8, 15, -1)
    confidence_features(static, RANKS)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = confidence_features(static, RANKS)
    for seed in range(1, 4):
        new = random_logits(rows, QWEN3_VOCAB, seed=seed, scale=2.0 * seed, dtype=torch.bfloat16, device="cuda")
        static.copy_(new.view_as(static))
        out.fill_(float("nan"))
        graph.replay()
        check(out.view(rows, RANKS + 2), new)


@pytest.mark.gpu
@needs_cuda
def test_cuda_bench_runs():
    path = Path(__file__).parents[1] / "benchmarks" / "bench_features.py"
    spec = importlib.util.spec_from_file_location("bench_features", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bench = module.bench

    for rows in (15, 8 * 15, 64 * 15):
        for dtype in (torch.bfloat16, torch.float32):
            fast, ref = bench(rows, QWEN3_VOCAB, dtype, iters=10)
            print(f"rows {rows} {dtype}: triton {fast:.4f} ms, reference {ref:.4f} ms")
            assert 0 < fast and 0 < ref


# ------------------------------------------------------------------------------ v3 agreement columns
def ring_agreement_reference(spec: FeatureSpec, ring, slots, ctx, block) -> torch.Tensor:
    """`dvl.features.agreement_features` over the window the runner gathers from the ring (`token_window`)."""
    from dscale_runtime.dvl.features import agreement_features

    r = ring.shape[1]
    positions = ctx[:, None] + torch.arange(1 - r, 1, device=ring.device)
    tokens = ring[slots].gather(1, positions % r)
    return agreement_features(spec, torch.cat([tokens[:, :-1], block[:, :1]], 1), positions >= 0, block)


def agreement_case(window: int, width: int, vocab: int, seed: int, device="cpu"):
    """A ring of 13 rows over a small vocabulary (many matches), 12 requests whose contexts cover the start of a
    sequence (no token before it), the ring's wrap and long sequences, in permuted ring rows."""
    gen = torch.Generator().manual_seed(seed)
    ring = torch.randint(0, vocab, (13, window), generator=gen)
    ctx = torch.tensor([0, 1, 5, window - 2, window - 1, window, window + 1, 3 * window + 7, 1000, 2, 60, 64])
    slots = torch.randperm(12, generator=gen)
    block = torch.randint(0, vocab, (12, width), generator=gen)
    block[:3, 1:] = ring[slots[:3], :1].expand(-1, width - 1)  # NOTE: runs of one token: long spans and lookups
    return [t.to(device) for t in (ring, slots, ctx, block)]


@needs_triton
@pytest.mark.parametrize("window,width,ngram,lookup,vocab", [
    (128, 16, 8, 4, 3),  # the v3 default spec
    (128, 16, 8, 4, 50),  # few matches
    (24, 16, 8, 4, 2),  # a window that is not a power of two (the engine tests' 24)
    (32, 8, 4, 2, 2),  # another block width, span and lookup
], ids=str)
def test_agreement_kernel_equals_the_reference(interpreter, window, width, ngram, lookup, vocab):
    """The one-launch agreement columns read from the ring equal the reference over the gathered window exactly
    (integer counts and flags)."""
    import dataclasses

    from dscale_runtime.kernels.triton_agreement import agreement_columns_triton

    spec = dataclasses.replace(FeatureSpec(num_positions=width - 1), agreement_window=window, agreement_ngram=ngram,
                               agreement_lookup=lookup)
    ring, slots, ctx, block = agreement_case(window, width, vocab, seed=window + vocab)
    want = ring_agreement_reference(spec, ring, slots, ctx, block)
    assert torch.equal(agreement_columns_triton(ring, slots, ctx, block, ngram, lookup), want)
    assert (want[:, : width - 1] > 0).any() and (want[:, width - 1] > 0).any() or vocab > 10
    assert agreement_columns_triton(ring, slots[:0], ctx[:0], block[:0], ngram, lookup).shape == (0, 2 * width - 1)


@needs_triton
def test_agreement_kernel_compiles_for_sm90_without_spills():
    from offline import run_without_interpreter

    lines = run_without_interpreter("""
from dscale_runtime.kernels import stack_usage
from dscale_runtime.kernels.triton_agreement import compile_offline
for window, width in [(128, 16), (24, 8)]:
    print(window, width, stack_usage(compile_offline(window, width)))
""")
    assert len(lines) == 2 and all(line.endswith(("STACK:0", "?")) for line in lines), lines


@pytest.mark.gpu
@needs_cuda
def test_cuda_agreement_kernel_equals_the_reference():
    from dscale_runtime.kernels.triton_agreement import agreement_columns_triton

    spec = FeatureSpec(num_positions=15)
    ring, slots, ctx, block = agreement_case(spec.agreement_window, 16, 3, seed=1, device="cuda")
    want = ring_agreement_reference(spec, ring, slots, ctx, block)
    got = agreement_columns_triton(ring, slots, ctx, block, spec.agreement_ngram, spec.agreement_lookup)
    assert torch.equal(got, want)
