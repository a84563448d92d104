"""DScale's allocation and flat pack in Triton (`kernels/triton_pack.py`) against their torch definitions
(`dvl.allocate.allocate` with `dvl.predictor.seed_lengths`, `dvl.pack.flat_pack` and `packed_metadata`): equal
exactly, ties, grow and shrink budgets, padding requests and placeholder rows included. The interpreter on CPU
machines with triton installed, the compiler offline for sm_90, and the compiled kernels on CUDA (marker `gpu`)."""

from __future__ import annotations

import pytest
import torch

from markers import needs_cuda, needs_triton
from dscale_runtime.dvl.allocate import allocate, budget_rows
from dscale_runtime.dvl.pack import flat_pack, packed_metadata
from dscale_runtime.dvl.predictor import seed_lengths

W = 16


def case(trial: int, device="cpu"):
    """Scores (cumulative products, or sorted with ties), live flags with padding, a budget, a block, contexts,
    page tables and a buffer height M >= the live rows (placeholders past them)."""
    gen = torch.Generator().manual_seed(trial)
    n = [1, 3, 8, 13, 32, 40][trial % 6]
    raw = torch.rand(n, W - 1, generator=gen)
    if trial % 4 == 0:
        raw = (raw * 4).round() / 4  # NOTE: many equal scores: the stable order decides
    scores = torch.cumprod(raw, 1) if trial % 3 else torch.sort(raw, 1, descending=True).values
    live = (torch.rand(n, generator=gen) > 0.2).long()
    live[0] = 1
    ratio = [0.25, 0.5, 0.75, 1.0, 0.1][trial % 5]
    budget = torch.tensor(budget_rows(int(live.sum()), W, ratio))
    block = torch.randint(0, 1000, (n, W), generator=gen)
    ctx = torch.randint(0, 200, (n,), generator=gen)
    tables = torch.randint(1, 99, (n, 20), generator=gen)
    rows = budget_rows(n, W, ratio) + (trial % 3) * 5
    return [t.to(device) for t in (scores.contiguous(), live, budget, block, ctx, tables)] + [rows]


def check(trial: int, device="cpu") -> None:
    from dscale_runtime.kernels.triton_pack import allocate_triton, flat_pack_triton

    scores, live, budget, block, ctx, tables, rows = case(trial, device)
    lens = allocate(scores, seed_lengths(scores, W), live > 0, budget)
    assert torch.equal(allocate_triton(scores, live, budget, W), lens), trial
    rows = max(rows, int(lens.sum()))
    want = flat_pack(lens, block, ctx, tables, rows, 16)
    meta = packed_metadata(want, ctx, tables, 999, W)
    fields, query_lens, query_starts, kv_lens = flat_pack_triton(lens, block, ctx, tables, rows, 16)
    for name, value in fields.items():
        assert torch.equal(value, getattr(want, name)), (trial, name)
    live_rows = lens.sum().view(1)
    assert torch.equal(query_lens, torch.cat([lens, rows - live_rows])), trial
    assert torch.equal(query_starts, torch.cat([want.verify_offsets, live_rows])), trial
    assert torch.equal(kv_lens, meta.kv_lens), trial


@needs_triton
@pytest.mark.parametrize("trial", range(12))
def test_triton_allocation_and_pack_equal_the_reference(interpreter, trial):
    check(trial)


@needs_triton
def test_pack_and_state_kernels_compile_for_sm90_without_spills():
    from offline import run_without_interpreter

    lines = run_without_interpreter("""
from dscale_runtime.kernels import stack_usage
from dscale_runtime.kernels.triton_pack import compile_offline
from dscale_runtime.kernels import triton_state
for batch in (8, 32, 256):
    for kernel in compile_offline(batch) + triton_state.compile_offline(batch):
        print(batch, stack_usage(kernel))
""")
    assert len(lines) == 12 and all(line.endswith(("STACK:0", "?")) for line in lines), lines


@pytest.mark.gpu
@needs_cuda
def test_cuda_allocation_and_pack_equal_the_reference():
    for trial in range(30):
        check(trial, "cuda")


# ----------------------------------------------------------------------- the step's device state (resolve, advance)
def state_case(seed: int, history: bool, ring: bool, device: str = "cpu"):
    """Step buffers of 6 rows (4 live requests in distinct slots, two of them a step ahead of the host; 2 padding
    rows on the dummy slot) and a device state of 9 slots with an 8-column history and a 24-token ring."""
    import types

    from dscale_runtime.runner import DeviceState, StepBuffers

    gen = torch.Generator().manual_seed(seed)
    buf = StepBuffers(6, 3, 8, 16, torch.device(device))
    state = DeviceState(8, 8, torch.device(device), with_history=history, token_window=24 if ring else 0)
    state.anchor.copy_(torch.randint(0, 90, (9,), generator=gen))
    state.ctx.copy_(torch.randint(0, 300, (9,), generator=gen))
    if history:
        state.history.copy_(torch.randint(0, 9, (9, 8), generator=gen).float())
    if ring:
        state.tokens.copy_(torch.randint(0, 90, (9, 24), generator=gen))
    buf.anchor.copy_(torch.randint(0, 90, (6,), generator=gen))
    buf.ctx.copy_(torch.randint(0, 300, (6,), generator=gen))
    buf.live.copy_(torch.tensor([1, 1, 1, 1, 0, 0]))
    buf.slot.copy_(torch.tensor([5, 2, 7, 0, state.dummy, state.dummy]))
    buf.host.copy_(torch.tensor([1, 0, 1, 0, 1, 1]))
    buf.context.copy_(torch.randint(0, 9, (6, 8), generator=gen).float())
    step = types.SimpleNamespace(buf=buf, runner=types.SimpleNamespace(state=state, decision_backend="ref"))
    block = torch.randint(0, 90, (6, W), generator=gen).to(device)
    accepted = torch.tensor([0, 3, W - 1, 7, 2, 0])
    result = torch.stack([accepted, torch.randint(0, 90, (6,), generator=gen)], 1).to(device)  # NOTE: strided columns
    return step, block, result


def resolve_and_advance(history: bool, ring: bool, device: str = "cpu") -> None:
    from dscale_runtime.runner import BucketStep

    runs = []
    for backend in ("ref", "triton"):
        step, block, result = state_case(3, history, ring, device)
        step.runner.decision_backend = backend
        BucketStep.resolve(step)
        BucketStep.advance(step, result[:, 0], result[:, 1], block)
        buf, state = step.buf, step.runner.state
        runs.append([buf.anchor.clone(), buf.ctx.clone(), buf.context.clone(), state.anchor[:-1].clone(),
                     state.ctx[:-1].clone()] + ([state.history[:-1].clone()] if history else [])
                    + ([state.tokens[:-1].clone()] if ring else []))
    for want, got in zip(*runs):
        assert torch.equal(got, want)
    assert not torch.equal(runs[0][0], state_case(3, history, ring, device)[0].buf.anchor)  # NOTE: rows ahead moved


@needs_triton
@pytest.mark.parametrize("history,ring", [(True, True), (False, True), (True, False)])
def test_triton_resolve_and_advance_equal_the_reference(interpreter, history, ring):
    """The step's device-state reads (`resolve`) and writes (`advance`) in one launch each equal the torch
    reference on every request's slot (the dummy row takes what padding and unaccepted slots write, in both)."""
    resolve_and_advance(history, ring)


@pytest.mark.gpu
@needs_cuda
def test_cuda_resolve_and_advance_equal_the_reference():
    for history, ring in ((True, True), (False, True), (True, False)):
        resolve_and_advance(history, ring, "cuda")
