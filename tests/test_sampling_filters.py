"""Sort-free top-k / top-p (`kernels/filters.py`, `kernels/triton_filters.py`) against the sorting definition.

Oracles: `filter_keep_ref` / `policy_probs_ref` (sorting), and exact probabilities written out by hand on rows
whose weights are exactly 1 (T = 1e9 spreads logits 0..-4 over s = -4e-9..0: distinct tie groups of weight
exp(s) = 1.0 in fp32, so every mass is an integer number of units and top_p = 0.5 lands exactly on one).
The Triton kernels run through Triton's interpreter on CPU machines (conftest sets TRITON_INTERPRET=1) and
compiled on CUDA (marker `gpu`, the Qwen3 vocabulary, inside a CUDA graph too).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from markers import needs_cuda, needs_triton
from dscale_runtime.kernels.filters import filter_floor, filter_floor_radix, filter_keep_ref, scaled_logits
from dscale_runtime.sampling import (
    SamplingRows,
    make_policy,
    policy_probs,
    policy_probs_ref,
    sample,
    sample_inverse_cdf_ref,
)

INF = float("inf")


def rows_of(temperature, top_k, top_p) -> SamplingRows:
    n = len(temperature)
    return SamplingRows(torch.zeros(n, dtype=torch.bool), torch.tensor(temperature, dtype=torch.float32),
                        torch.tensor(top_k, dtype=torch.long), torch.tensor(top_p, dtype=torch.float32),
                        torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))


def random_batch(rows: int, vocab: int, seed: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, SamplingRows]:
    """Mixed rows: heavy ties (integer logits), smooth ones, filters off / top-k / top-p / both, T in 0.3..3."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[: rows // 3] = torch.randint(-5, 3, (rows // 3, vocab), generator=gen).float()  # big tie groups
    temperature = (torch.rand(rows, generator=gen) * 2.7 + 0.3).tolist()
    top_k = torch.randint(1, 300, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.98 + 0.01
    kind = torch.arange(rows) % 4  # 0: neither, 1: top-k, 2: top-p, 3: both
    top_k = torch.where((kind == 1) | (kind == 3), top_k, -1)
    top_p = torch.where(kind >= 2, top_p, 1.0)
    top_k[1] = vocab + 7  # beyond the vocabulary: off
    return logits.to(dtype), rows_of(temperature, top_k.tolist(), top_p.tolist())


def keep_of(logits: torch.Tensor, rows: SamplingRows, floor: torch.Tensor) -> torch.Tensor:
    s = scaled_logits(logits, logits.float().amax(-1), 1.0 / rows.temperature.to(logits.device).clamp_min(1e-6))
    return s >= floor.to(s.device)[:, None]


def ref_keep(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    s = scaled_logits(logits, logits.float().amax(-1), 1.0 / rows.temperature.to(logits.device).clamp_min(1e-6))
    return filter_keep_ref(s, rows.top_k.to(s.device), rows.top_p.to(s.device))


def floors(logits: torch.Tensor, rows: SamplingRows, backend: str) -> torch.Tensor:
    shift = logits.float().amax(-1)
    inv_t = (1.0 / rows.temperature.clamp_min(1e-6)).to(logits.device)
    return filter_floor(logits, shift, inv_t, rows.top_k.to(logits.device), rows.top_p.to(logits.device), backend)


# Hand-checked rows (T = 1e9: every weight is exactly 1; tokens 0..3 have logits 3, 2, 1, 0 unless tied).
EDGE = [  # (logits, top_k, top_p, kept tokens)
    ([3, 2, 1, 0], -1, 0.5, [0, 1]),  # p Z = 2 units x 2^40 = M(token 2): M < p Z fails, token 2 drops
    ([3, 2, 1, 0], -1, float(np.nextafter(np.float32(0.5), np.float32(1))), [0, 1, 2]),  # just above: it stays
    ([3, 2, 1, 0], -1, float(np.nextafter(np.float32(0.5), np.float32(0))), [0, 1]),
    ([3, 2, 1, 0], -1, 0.75, [0, 1, 2]),
    ([3, 2, 1, 0], -1, 0.25, [0]),
    ([3, 2, 1, 0], -1, 1.0, [0, 1, 2, 3]),  # top_p 1: off
    ([3, 2, 1, 0], -1, 1e-30, [0]),  # tiny top_p: the most likely only
    ([3, 3, 2, 1], -1, 0.25, [0, 1]),  # the top group stays whole (mass 1/2 > 0.25)
    ([3, 3, 2, 1], -1, 0.5, [0, 1]),  # M(token 2) = 2 = p Z
    ([3, 2, 2, 1], -1, 0.5, [0, 1, 2]),  # M(tokens 1, 2) = 1 < 2: the tie group stays together
    ([3, 3, 2, 1], 1, 1.0, [0, 1]),  # top_k 1 keeps every token tied with the largest
    ([3, 2, 2, 1], 2, 1.0, [0, 1, 2]),  # ties with the k-th stay
    ([3, 2, 1, 0], 4, 1.0, [0, 1, 2, 3]),  # top_k = V: off
    ([3, 2, 1, 0], 9, 1.0, [0, 1, 2, 3]),  # top_k > V: off
    ([3, 2, 1, 0], 3, 0.5, [0, 1]),  # both: Z over the top 3 (3 units), p Z = 1.5 > M(token 1) = 1
    ([3, 2, 1, 0], 2, 0.5, [0]),  # both: Z = 2, p Z = 1 = M(token 1)
    ([0, 0, 0, 0], 1, 0.1, [0, 1, 2, 3]),  # one group: everything ties with the argmax
]


def edge_batch() -> tuple[torch.Tensor, SamplingRows, torch.Tensor]:
    """The EDGE rows (vocab 4, T = 1e9), one unfiltered row at T = 1, expected probabilities [R, 4] float64."""
    logits = torch.tensor([row[0] for row in EDGE] + [[1.0, 0.5, 0.0, -2.0]])
    rows = rows_of([1e9] * len(EDGE) + [1.0], [row[1] for row in EDGE] + [-1], [row[2] for row in EDGE] + [1.0])
    want = torch.zeros(len(EDGE) + 1, 4, dtype=torch.float64)
    for i, (_, _, _, kept) in enumerate(EDGE):
        want[i, kept] = 1.0 / len(kept)
    want[-1] = torch.softmax(logits[-1].double(), -1)
    return logits, rows, want


# ------------------------------------------------------------------------------------------------ CPU paths
def test_edge_rows_have_the_exact_probabilities_by_every_cpu_path():
    logits, rows, want = edge_batch()
    for probs in (policy_probs_ref(logits, rows, True), policy_probs(logits, rows, True)):
        assert torch.allclose(probs.double(), want, rtol=1e-6, atol=0)
        assert torch.equal(probs > 0, want > 0)
    assert torch.equal(keep_of(logits, rows, floors(logits, rows, "ref")), want > 0)
    inv_t = 1.0 / rows.temperature.clamp_min(1e-6)
    static = filter_floor_radix(logits, logits.float().amax(-1), inv_t, rows.top_k, rows.top_p, graph_safe=True)
    assert torch.equal(keep_of(logits, rows, static), want > 0)


@pytest.mark.parametrize("dtype,vocab", [(torch.bfloat16, 2000), (torch.float32, 1100), (torch.float16, 517)])
def test_radix_floor_equals_the_sorting_reference(dtype, vocab):
    logits, rows = random_batch(32, vocab, seed=vocab, dtype=dtype)
    floor = floors(logits, rows, "ref")
    want = ref_keep(logits, rows)
    assert torch.equal(keep_of(logits, rows, floor), want)
    inv_t = 1.0 / rows.temperature.clamp_min(1e-6)
    static = filter_floor_radix(logits, logits.float().amax(-1), inv_t, rows.top_k, rows.top_p, graph_safe=True)
    assert torch.equal(static, floor)  # the graph-safe rounds (what CUDA runs) find the same floors
    assert torch.equal(policy_probs(logits, rows, True), policy_probs_ref(logits, rows, True))
    # the rows without filters keep everything (floor -inf); filtered rows really filter
    off = (rows.top_k <= 0) | (rows.top_k >= vocab)
    off &= rows.top_p >= 1
    assert torch.isneginf(floor[off]).all() and (want[~off].sum(-1) < vocab).all()


def test_top_p_at_every_cumulative_mass_matches_the_reference():
    """top_p set to each group's cumulative mass (rounded to fp32) and its fp32 neighbours: the kept sets of the
    radix path equal the sorting reference's, and both follow M < p Z group by group (float64, as defined)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randint(-6, 1, (1, 400), generator=gen).float() * 0.75
    s = scaled_logits(logits, logits.amax(-1), torch.ones(1))
    q = (torch.exp(s) * 2.0**40).long()[0]
    values = sorted(set(s[0].tolist()), reverse=True)
    group_mass = [int(q[s[0] == v].sum()) for v in values]
    z = sum(group_mass)
    cases = []
    for j in range(1, len(values)):
        edge = np.float32(sum(group_mass[:j]) / z)
        cases += [edge, np.nextafter(edge, np.float32(0)), np.nextafter(edge, np.float32(1))]
    batch = logits.expand(len(cases), -1)
    rows = rows_of([1.0] * len(cases), [-1] * len(cases), [float(c) for c in cases])
    got = keep_of(batch, rows, floors(batch, rows, "ref"))
    assert torch.equal(got, ref_keep(batch, rows))
    for i, p in enumerate(cases):
        kept_groups = [v for j, v in enumerate(values) if float(sum(group_mass[:j])) < float(p) * float(z) or j == 0]
        assert torch.equal(got[i], s[0] >= min(kept_groups))


def test_a_filtered_policy_samples_its_filtered_distribution():
    logits, rows = random_batch(12, 2000, seed=3)
    policy = make_policy(logits, rows, filtered=True)
    want = policy_probs_ref(logits, rows, True).double()
    every = torch.arange(2000)
    got = torch.stack([policy.probs_at(torch.full((2000,), i), every) for i in range(12)])
    assert torch.allclose(got, want, atol=1e-6, rtol=0) and torch.equal(got > 0, want > 0)
    assert torch.allclose(policy.row_weights(torch.arange(12)) / policy.total[:, None], want, atol=1e-6, rtol=0)
    u = torch.rand(12, 100, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    draws = torch.stack([sample(policy, u[:, i]) for i in range(100)], dim=1)
    assert (want.gather(1, draws) > 0).all()
    ref = torch.stack([sample_inverse_cdf_ref(want, u[:, i]) for i in range(100)], dim=1)
    assert (draws == ref).float().mean() > 0.99


# -------------------------------------------------------------------------- Triton (interpreter or CUDA)
@pytest.fixture
def kernel_device() -> str:
    from dscale_runtime.kernels import triton_filters

    if torch.cuda.is_available():
        return "cuda"
    if not triton_filters.interpreted():
        pytest.skip("triton was imported without TRITON_INTERPRET=1")
    return "cpu"


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
@pytest.mark.parametrize("path", ["row_program", "radix_rounds"])
def test_triton_floors_equal_the_reference(kernel_device, path, monkeypatch):
    """Both Triton paths: one program per row (vocabularies up to ROW_PROGRAM_VOCAB) and the radix rounds."""
    from dscale_runtime.kernels import triton_filters

    if path == "radix_rounds":
        monkeypatch.setattr(triton_filters, "ROW_PROGRAM_VOCAB", 0)
    device = kernel_device
    logits, rows, want = edge_batch()
    assert torch.equal(keep_of(logits, rows, floors(logits.to(device), rows, "triton")), want > 0)
    logits, rows = random_batch(8, 1200, seed=11)
    logits = logits.to(device)
    floor = floors(logits, rows, "triton")
    assert torch.equal(keep_of(logits, rows, floor), ref_keep(logits, rows))


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_program_searches_16_bit_logits_in_their_own_order(kernel_device, dtype):
    """bf16 / fp16 rows take 16 search steps over the logits' bits, fp32 rows 31 over s: the reference's kept sets,
    also where the scaling maps two distinct logits (0 and 6e-8 beside a maximum of 100) to one s, at a top-k
    and at a top-p boundary."""
    logits, rows = random_batch(8, 1200, seed=13, dtype=dtype)
    merged = torch.tensor([[100.0, 6e-8, 0.0, -50.0] + [-1e4] * 1196] * 2, dtype=dtype)
    logits = torch.cat([logits, merged]).to(kernel_device)
    rows = rows_of(rows.temperature.tolist() + [1.0, 1000.0], rows.top_k.tolist() + [2, -1],
                   rows.top_p.tolist() + [1.0, 0.3])
    floor = floors(logits, rows, "triton")
    assert torch.equal(keep_of(logits, rows, floor), ref_keep(logits, rows))
    assert keep_of(logits, rows, floor)[-2:, :4].tolist() == [[True, True, True, False]] * 2


@pytest.mark.gpu  # and on CPU machines through Triton's interpreter
@needs_triton
def test_triton_sampler_honours_the_floor(kernel_device):
    device = kernel_device
    logits, rows = random_batch(4, 1000, seed=12)
    logits = logits.to(device)
    rows = SamplingRows(*(t.to(device) for t in (rows.greedy, rows.temperature, rows.top_k, rows.top_p,
                                                 rows.seed_lo, rows.seed_hi)), backend="triton")
    policy = make_policy(logits, rows, filtered=True)
    ref = make_policy(logits, rows, filtered=True, backend="ref")
    assert torch.equal(policy.floor, ref.floor)
    assert torch.allclose(policy.chunk_sums, ref.chunk_sums, rtol=1e-5, atol=1e-30)
    u = torch.rand(4, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64).to(device)
    got = torch.stack([sample(policy, u[:, i], backend="triton") for i in range(12)], dim=1)
    want = torch.stack([sample(ref, u[:, i]) for i in range(12)], dim=1)
    assert (policy.row_weights(torch.arange(4, device=device)).gather(1, got) > 0).all()
    assert (got == want).float().mean() > 0.99


# ---------------------------------------------------------------------------------------------- CUDA only
@pytest.mark.gpu
@needs_cuda
def test_sort_free_filters_at_the_qwen3_vocabulary_in_a_cuda_graph():
    """bf16 logits [96, 151936]: Triton and torch floors give the sorting reference's kept sets and probabilities
    exactly (the same expf on CUDA), eagerly and replayed from a CUDA graph (on other logits than captured)."""
    check_filters_in_a_cuda_graph(151936)


@pytest.mark.gpu
@needs_cuda
def test_sort_free_filters_at_the_demo_vocabulary_in_a_cuda_graph():
    """The same at the demo pair's 4,096 tokens, where Triton takes one program per row."""
    from dscale_runtime.kernels import triton_filters

    assert 4096 <= triton_filters.ROW_PROGRAM_VOCAB
    check_filters_in_a_cuda_graph(4096)


def check_filters_in_a_cuda_graph(vocab: int) -> None:
    logits, rows = random_batch(96, vocab, seed=7)
    logits = logits.cuda()
    rows = SamplingRows(*(t.cuda() for t in (rows.greedy, rows.temperature, rows.top_k, rows.top_p, rows.seed_lo,
                                             rows.seed_hi)), backend="triton")
    want = ref_keep(logits, rows)
    probs = policy_probs_ref(logits, rows, True)
    for backend in ("triton", "ref"):
        floor = floors(logits, rows, backend)
        assert torch.equal(keep_of(logits, rows, floor), want), backend
        assert torch.equal(policy_probs(logits, rows, True, backend=backend), probs), backend
    static = logits.clone()
    other, _ = random_batch(96, vocab, seed=8)
    for backend in ("triton", "ref"):
        static.copy_(logits)
        floors(static, rows, backend)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = floors(static, rows, backend)
        static.copy_(other.cuda())
        graph.replay()
        assert torch.equal(keep_of(static, rows, captured), ref_keep(static, rows)), backend
