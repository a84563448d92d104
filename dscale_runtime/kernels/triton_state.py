"""The step's device-state reads and writes around the parts (`runner.BucketStep.resolve` / `advance`) in one Triton
launch each: a program per request row.

`resolve`: a row whose `host` flag is 0 takes its anchor, context length and (DScale) context-feature history from
the device state of its slot, with columns 0-1 rebuilt (the batch's live count, the context length); other rows keep
what the host staged. `advance`: each row writes its slot's next anchor (the successor), context length
(ctx + accepted + 1), history (one more step: columns 2-3 counted up, the accepted count first among the recent
ones) and, with the v3 token ring, the anchor and accepted drafts at their positions' columns. The torch
definitions in the runner take about 10 and 30 launches; the values are the same (integers, and fp32 copies and
increments of small integers). Padding rows share the dummy slot: what they write there is never read as a
request's state, here as in the reference.

Grids depend on shapes only: safe to capture in a CUDA graph. Import this module only where triton is installed
(the runner does so lazily); TRITON_INTERPRET=1 runs it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.kernels.triton_fused import interpreted, require_interpreter_on_cpu


@triton.jit
def _resolve_kernel(anchor_ptr, ctx_ptr, context_ptr, host_ptr, slot_ptr, live_ptr, state_anchor_ptr,
                    state_ctx_ptr, history_ptr, n, context_stride, history_stride,
                    C: tl.constexpr, CB: tl.constexpr, NB: tl.constexpr, HISTORY: tl.constexpr):
    i = tl.program_id(0)
    ahead = tl.load(host_ptr + i) == 0
    slot = tl.load(slot_ptr + i)
    ctx = tl.where(ahead, tl.load(state_ctx_ptr + slot), tl.load(ctx_ptr + i))
    tl.store(anchor_ptr + i, tl.where(ahead, tl.load(state_anchor_ptr + slot), tl.load(anchor_ptr + i)))
    tl.store(ctx_ptr + i, ctx)
    if HISTORY:
        b = tl.arange(0, NB)
        live = tl.sum(tl.load(live_ptr + b, mask=b < n, other=0), axis=0).to(tl.float32)
        c = tl.arange(0, CB)
        inside = c < C
        row = tl.load(history_ptr + slot * history_stride + c, mask=inside, other=0.0)
        row = tl.where(c == 0, live, tl.where(c == 1, ctx.to(tl.float32), row))
        staged = tl.load(context_ptr + i * context_stride + c, mask=inside, other=0.0)
        tl.store(context_ptr + i * context_stride + c, tl.where(ahead, row, staged), mask=inside)


@triton.jit
def _advance_kernel(accepted_ptr, successor_ptr, block_ptr, slot_ptr, ctx_ptr, context_ptr, state_anchor_ptr,
                    state_ctx_ptr, history_ptr, ring_ptr, accepted_stride, successor_stride, block_stride,
                    context_stride, history_stride, ring_stride, dummy, W: tl.constexpr, WB: tl.constexpr,
                    R: tl.constexpr, C: tl.constexpr, CB: tl.constexpr,
                    HISTORY: tl.constexpr, RING: tl.constexpr):
    i = tl.program_id(0)
    slot = tl.load(slot_ptr + i)
    ctx = tl.load(ctx_ptr + i)
    accepted = tl.load(accepted_ptr + i * accepted_stride)
    if RING:  # NOTE: the rest of the block goes to the dummy row, as in the reference
        j = tl.arange(0, WB)
        token = tl.load(block_ptr + i * block_stride + j, mask=j < W, other=0)
        row = tl.where(j <= accepted, slot, dummy)
        tl.store(ring_ptr + row * ring_stride + (ctx + j) % R, token, mask=j < W)
    tl.store(state_anchor_ptr + slot, tl.load(successor_ptr + i * successor_stride))
    tl.store(state_ctx_ptr + slot, ctx + accepted + 1)
    if HISTORY:
        c = tl.arange(0, CB)
        old = tl.load(context_ptr + i * context_stride + c, mask=c < C, other=0.0)
        before = tl.load(context_ptr + i * context_stride + c - 1, mask=(c >= 5) & (c < C), other=0.0)
        new = tl.where(c == 2, old + 1.0, tl.where(c == 3, tl.minimum(old + 1.0, C - 4.0), 0.0))
        new = tl.where(c == 4, accepted.to(tl.float32), tl.where(c >= 5, before, new))
        tl.store(history_ptr + slot * history_stride + c, new, mask=c < C)


def resolve_triton(anchor, ctx, context, host, slot, live, state_anchor, state_ctx, history) -> None:
    """`BucketStep.resolve` on the step buffers (anchor, ctx, host, slot, live [B] int64; context [B, C] float32)
    and the device state (anchor, ctx [S + 1] int64; history [S + 1, C] float32 or None), in place."""
    n = anchor.shape[0]
    require_interpreter_on_cpu(anchor, "the Triton state kernels", "decision")
    c = context.shape[1]
    if n == 0:
        return
    _resolve_kernel[(n,)](anchor, ctx, context, host, slot, live, state_anchor, state_ctx,
                          history if history is not None else context, n, context.stride(0),
                          history.stride(0) if history is not None else 0, C=c, CB=triton.next_power_of_2(max(c, 2)),
                          NB=triton.next_power_of_2(n), HISTORY=history is not None, num_warps=1)


def advance_triton(accepted, successor, block, slot, ctx, context, state_anchor, state_ctx, history, ring,
                   dummy: int) -> None:
    """`BucketStep.advance`: accepted, successor [B] int64 (strided columns of the step's result), slot, ctx [B]
    int64, block [B, W] int64, context [B, C] float32 (the step's buffers), the device state (anchor, ctx, history
    or None, ring [S + 1, R] int64 or None), in place."""
    n, w = block.shape
    require_interpreter_on_cpu(block, "the Triton state kernels", "decision")
    if n == 0:
        return
    c = context.shape[1]
    assert block.stride(1) == 1 and context.stride(1) == 1
    _advance_kernel[(n,)](accepted, successor, block, slot, ctx, context, state_anchor, state_ctx,
                          history if history is not None else context, ring if ring is not None else block,
                          accepted.stride(0), successor.stride(0), block.stride(0), context.stride(0),
                          history.stride(0) if history is not None else 0,
                          ring.stride(0) if ring is not None else 0, dummy, W=w, WB=triton.next_power_of_2(w),
                          R=ring.shape[1] if ring is not None else 1, C=c, CB=triton.next_power_of_2(max(c, 2)),
                          HISTORY=history is not None, RING=ring is not None, num_warps=1)


def compile_offline(batch: int = 32, block_size: int = 16, window: int = 128, num_context: int = 8,
                    arch: int = 90) -> list:
    """Both kernels (with history and ring) compiled for an NVIDIA target without a GPU (`kernels.compile_for_gpu`):
    a CI check of the compiled path, which the interpreter does not make. Needs triton imported without
    TRITON_INTERPRET."""
    from dscale_runtime.kernels import compile_for_gpu

    assert not interpreted(), "compile_offline needs triton imported without TRITON_INTERPRET"
    pointers = {"*": "*i64", "context_ptr": "*fp32", "history_ptr": "*fp32"}
    cb = triton.next_power_of_2(max(num_context, 2))
    resolve = {"C": num_context, "CB": cb, "NB": triton.next_power_of_2(batch), "HISTORY": True}
    advance = {"W": block_size, "WB": triton.next_power_of_2(block_size), "R": window, "C": num_context, "CB": cb,
               "HISTORY": True, "RING": True}
    return [compile_for_gpu(_resolve_kernel, resolve, pointers, 1, arch),
            compile_for_gpu(_advance_kernel, advance, pointers, 1, arch)]
