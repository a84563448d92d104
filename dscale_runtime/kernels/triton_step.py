"""The index work of every decode step around the two models, in three Triton launches (`KernelChoice.decision`):

- `block_metadata_triton`: the attention metadata of W rows per request after its context (`runner.block_metadata`:
  row_req, row_local, positions, slot_mapping, kv_lens, query_starts, query_lens) and, for a drafter, the block
  of tokens it drafts from (the anchor, then mask tokens). The reference takes about fifteen launches.
- `accept_triton`: the top-1 acceptance of every request (`verify.accept_greedy`: drafts accepted while they equal
  their rows' target tokens, the successor from the first differing row), the cache slots of the verified rows the
  drafter keeps (accepted rows of live requests; the scratch page for the others) and the step's result row
  (accepted, successor, k, full-width accepted, the block, DScale's packed conditionals). A sampled-drafts step
  passes its accepted counts and successors in, decided by `verify.accept_sampled_drafts`. The reference takes
  about thirty launches.
- `conditionals_triton`: DScale's raw conditionals x_j = s_j / s_{j-1} of the predictor's scores, packed 15 bits
  each for the host (`dvl.calibration.conditional_scores`, `pack_unit`), and with the live map the calibrated
  scores prod_{i <= j} g_i(x_i) (`calibrated_scores`), about thirty launches in the reference.

Integers are exact, so metadata, acceptance, kept slots and result rows equal the reference. The conditionals are
one IEEE division each (`div_rn`: Triton's `/` is approximate on the GPU) and round to 15 bits half to even, as
`torch.round` does: exact too. The calibrated scores are running products of the fp32 map values (interpolated
unfused: `enable_fp_fusion=False`) accumulated in fp64 and rounded to fp32 at each position, which is what torch's
CPU `cumprod` does; its CUDA scan accumulates in fp32, so on CUDA the two agree to rounding (they only set verify
lengths, which never change the output). Each program recomputes what it needs from its inputs, so every kernel is
one launch with a grid that depends on shapes only: safe to capture in a CUDA graph. Import this module only where
triton is installed (the runner does so lazily); TRITON_INTERPRET=1 runs it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dscale_runtime.attention import AttentionMetadata
from dscale_runtime.dvl.calibration import UNIT_BITS, UNITS_PER_WORD
from dscale_runtime.kernels.triton_fused import interpreted, require_interpreter_on_cpu
from dscale_runtime.kv_cache import SCRATCH_PAGE

ROWS = 128  # rows (or requests) per program of the metadata and acceptance kernels
SCORE_ROWS = 32  # requests per program of the conditionals kernel
RESULT_FIELDS = 4  # accepted, successor, k, full-width accepted: the result's columns before the block



@triton.jit
def _block_metadata_kernel(ctx_ptr, tables_ptr, anchor_ptr, block_ptr, row_req_ptr, row_local_ptr, positions_ptr,
                           slots_ptr, kv_lens_ptr, starts_ptr, lens_ptr, n, tables_stride, max_pages, page_size,
                           mask_token, W: tl.constexpr, RB: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    inside = rows < n * W
    req = rows // W
    local = rows % W
    ctx = tl.load(ctx_ptr + req, mask=inside, other=0)
    position = ctx + local
    page = tl.load(tables_ptr + req * tables_stride + tl.minimum(position // page_size, max_pages - 1), mask=inside,
                   other=0)
    tl.store(row_req_ptr + rows, req, mask=inside)
    tl.store(row_local_ptr + rows, local, mask=inside)
    tl.store(positions_ptr + rows, position, mask=inside)
    tl.store(slots_ptr + rows, page * page_size + position % page_size, mask=inside)
    first = inside & (local == 0)  # NOTE: one row per request writes its per-request columns
    tl.store(kv_lens_ptr + req, ctx + W, mask=first)
    tl.store(starts_ptr + req, rows, mask=first)
    tl.store(lens_ptr + req, tl.zeros_like(req) + W, mask=first)
    if BLOCK:
        anchor = tl.load(anchor_ptr + req, mask=first, other=0)
        tl.store(block_ptr + rows, tl.where(first, anchor, mask_token), mask=inside)


def block_metadata_triton(ctx: torch.Tensor, block_tables: torch.Tensor, page_size: int, width: int, causal: bool,
                          max_kv: int, anchor: torch.Tensor | None = None,
                          mask_token: int = 0) -> tuple[AttentionMetadata, torch.Tensor | None]:
    """`runner.block_metadata` over ctx [B] and block_tables [B, max_pages] (int64) in one launch -> (the metadata,
    and with `anchor` [B] the drafter's block [B, W] int64: the anchor, then `mask_token`; else None)."""
    n, max_pages = block_tables.shape
    assert ctx.dtype == block_tables.dtype == torch.int64 and ctx.is_contiguous() and block_tables.stride(1) == 1
    require_interpreter_on_cpu(ctx, "the Triton step metadata", "decision")
    device = ctx.device
    rows = {name: torch.empty(n * width, dtype=torch.int64, device=device)
            for name in ("row_req", "row_local", "positions", "slot_mapping")}
    kv_lens, starts, lens = (torch.empty(n, dtype=torch.int64, device=device) for _ in range(3))
    block = torch.empty(n, width, dtype=torch.int64, device=device) if anchor is not None else None
    if n:
        _block_metadata_kernel[(triton.cdiv(n * width, ROWS),)](
            ctx, block_tables, anchor if anchor is not None else ctx, block if block is not None else ctx,
            rows["row_req"], rows["row_local"], rows["positions"], rows["slot_mapping"], kv_lens, starts, lens, n,
            block_tables.stride(0), max_pages, page_size, mask_token, W=width, RB=ROWS, BLOCK=block is not None,
            num_warps=4)
    meta = AttentionMetadata(**rows, kv_lens=kv_lens, block_tables=block_tables, max_q=width, max_kv=max_kv,
                             causal=causal, query_starts=starts, query_lens=lens)
    return meta, block


@triton.jit
def _greedy_accepted(req, valid, block_ptr, block_stride, tokens_ptr, lens_ptr, offsets_ptr, num_rows,
                     W: tl.constexpr, WB: tl.constexpr):
    """Accepted drafts of requests `req` (a vector; `valid` masks it) by the top-1 rule, and their offsets."""
    offset = tl.load(offsets_ptr + req, mask=valid, other=0)
    k = tl.load(lens_ptr + req, mask=valid, other=0)
    slot = tl.arange(0, WB) + 1  # draft slots 1 .. W - 1 (columns past W - 1 masked)
    draft = (slot < W)[None, :] & valid[:, None]
    row = tl.minimum(tl.maximum(offset[:, None] + slot[None, :] - 1, 0), num_rows - 1)
    target = tl.load(tokens_ptr + row, mask=draft, other=-1)
    token = tl.load(block_ptr + req[:, None] * block_stride + slot[None, :], mask=draft, other=-2)
    match = (token == target) & (slot[None, :] < k[:, None]) & draft
    first_miss = tl.min(tl.where(match, W, slot[None, :]), axis=1)  # W when every slot matched
    return tl.minimum(first_miss, W) - 1, offset


@triton.jit
def _accept_kernel(tokens_ptr, block_ptr, lens_ptr, offsets_ptr, live_ptr, row_req_ptr, row_local_ptr, slots_ptr,
                   kept_ptr, out_ptr, accepted_ptr, successor_ptr, full_ptr, extra_ptr, n, num_rows, block_stride,
                   out_stride, given_stride, extra_stride, scratch_slot, W: tl.constexpr, WB: tl.constexpr,
                   RB: tl.constexpr, GIVEN: tl.constexpr, KEEP: tl.constexpr, FULL: tl.constexpr,
                   EXTRA: tl.constexpr, EB: tl.constexpr):
    idx = tl.program_id(0) * RB + tl.arange(0, RB)
    # the result rows of requests idx
    valid = idx < n
    if GIVEN:
        accepted = tl.load(accepted_ptr + idx * given_stride, mask=valid, other=0)
        successor = tl.load(successor_ptr + idx * given_stride, mask=valid, other=0)
    else:
        accepted, offset = _greedy_accepted(idx, valid, block_ptr, block_stride, tokens_ptr, lens_ptr, offsets_ptr,
                                            num_rows, W, WB)
        successor = tl.load(tokens_ptr + tl.minimum(offset + accepted, num_rows - 1), mask=valid, other=0)
    out = out_ptr + idx * out_stride
    tl.store(out, accepted, mask=valid)
    tl.store(out + 1, successor, mask=valid)
    tl.store(out + 2, tl.load(lens_ptr + idx, mask=valid, other=0), mask=valid)
    if FULL:
        tl.store(out + 3, tl.load(full_ptr + idx, mask=valid, other=0), mask=valid)
    else:
        tl.store(out + 3, tl.zeros_like(idx) - 1, mask=valid)
    col = tl.arange(0, WB)
    inside = valid[:, None] & (col < W)[None, :]
    block = tl.load(block_ptr + idx[:, None] * block_stride + col[None, :], mask=inside, other=0)
    tl.store(out[:, None] + 4 + col[None, :], block, mask=inside)
    if EXTRA > 0:
        e = tl.arange(0, EB)
        words = valid[:, None] & (e < EXTRA)[None, :]
        value = tl.load(extra_ptr + idx[:, None] * extra_stride + e[None, :], mask=words, other=0)
        tl.store(out[:, None] + 4 + W + e[None, :], value, mask=words)
    if KEEP:  # the slots of verified rows idx: kept where the row's request is live and accepted it
        row_ok = idx < num_rows
        req = tl.load(row_req_ptr + idx, mask=row_ok, other=0)
        mine = row_ok & (req < n)
        req = tl.minimum(req, n - 1)
        if GIVEN:
            upto = tl.load(accepted_ptr + req * given_stride, mask=mine, other=0)
        else:
            upto, _ = _greedy_accepted(req, mine, block_ptr, block_stride, tokens_ptr, lens_ptr, offsets_ptr,
                                       num_rows, W, WB)
        local = tl.load(row_local_ptr + idx, mask=row_ok, other=0)
        live = tl.load(live_ptr + req, mask=mine, other=0) > 0
        keep = mine & (local <= upto) & live
        slot = tl.load(slots_ptr + idx, mask=row_ok, other=0)
        tl.store(kept_ptr + idx, tl.where(keep, slot, scratch_slot), mask=row_ok)


def accept_triton(target_tokens: torch.Tensor, block: torch.Tensor, lens: torch.Tensor, offsets: torch.Tensor,
                  live: torch.Tensor, meta: AttentionMetadata, page_size: int, keep: bool,
                  given: tuple[torch.Tensor, torch.Tensor] | None = None, full_accepted: torch.Tensor | None = None,
                  extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One launch after the target's tokens [M] (every verification row's, int64) of a step over block [B, W]
    (anchor and drafts), verify lens / offsets and live [B] (int64), the verification metadata `meta` ->
    (result [B, 4 + W + words] int64: accepted, successor, k, full-width accepted (`full_accepted` [B], else -1),
    the block, `extra` [B, words]; and with `keep` the drafter's cache slots [M] of the verified rows: a row's own
    slot where its request is live and accepted it (row_local <= accepted), else the scratch page's first slot).
    `given` (accepted, successor) [B] int64 (strided columns allowed): a sampled-drafts step's counts, used as they
    are; else the top-1 rule decides them (`verify.accept_greedy`)."""
    n, w = block.shape
    m = target_tokens.shape[0]
    assert target_tokens.dtype == block.dtype == lens.dtype == offsets.dtype == live.dtype == torch.int64
    assert block.stride(1) == 1 and target_tokens.is_contiguous() and lens.is_contiguous() and offsets.is_contiguous()
    require_interpreter_on_cpu(block, "the Triton acceptance", "decision")
    words = extra.shape[1] if extra is not None else 0
    out = torch.empty(n, RESULT_FIELDS + w + words, dtype=torch.int64, device=block.device)
    kept = torch.empty(m, dtype=torch.int64, device=block.device) if keep else None
    if given is not None:
        assert given[0].stride(0) == given[1].stride(0), "accepted and successor share one stride"
    if extra is not None:
        assert extra.stride(1) == 1 and extra.dtype == torch.int64
    if n and m:
        _accept_kernel[(triton.cdiv(max(n, m if keep else 0), ROWS),)](
            target_tokens, block, lens, offsets, live, meta.row_req, meta.row_local, meta.slot_mapping,
            kept if kept is not None else out, out, given[0] if given else out, given[1] if given else out,
            full_accepted if full_accepted is not None else out, extra if extra is not None else out, n, m,
            block.stride(0), out.stride(0), given[0].stride(0) if given else 0,
            extra.stride(0) if extra is not None else 0, SCRATCH_PAGE * page_size, W=w,
            WB=triton.next_power_of_2(w), RB=ROWS, GIVEN=given is not None, KEEP=keep,
            FULL=full_accepted is not None, EXTRA=words, EB=triton.next_power_of_2(max(words, 1)), num_warps=4)
    return out, kept


@triton.jit
def _mapped(x, knots_ptr, valid, K: tl.constexpr):
    """A conditional x in [0, 1] through a map of K + 1 knots (`calibration.mapped_conditionals`'s arithmetic)."""
    t = x * K
    left = tl.minimum(tl.maximum(tl.floor(t), 0.0), K - 1.0)
    part = t - left
    lo = tl.load(knots_ptr + left.to(tl.int32), mask=valid, other=0.0)
    hi = tl.load(knots_ptr + left.to(tl.int32) + 1, mask=valid, other=0.0)
    return lo + part * (hi - lo)


@triton.jit
def _conditional(s, before):
    """s_j / s_{j-1}, 0 where s_{j-1} = 0, in [0, 1] (`calibration.conditional_scores`; IEEE division)."""
    x = tl.where(before > 0, tl.math.div_rn(s, tl.maximum(before, 1e-30)), 0.0)  # NOTE: not Triton's approximate `/`
    return tl.minimum(tl.maximum(x, 0.0), 1.0)


@triton.jit
def _conditionals_kernel(scores_ptr, knots_ptr, packed_ptr, calibrated_ptr, art_ptr, art_row, n, P: tl.constexpr,
                         K: tl.constexpr, KA: tl.constexpr, WORDS: tl.constexpr, UNIT: tl.constexpr,
                         PER_WORD: tl.constexpr, RB: tl.constexpr, CALIBRATE: tl.constexpr, ARTIFACT: tl.constexpr):
    rows = tl.program_id(0) * RB + tl.arange(0, RB)
    valid = rows < n
    top = (1 << UNIT) - 1
    before = tl.full([RB], 1.0, tl.float32)
    raw_before = tl.full([RB], 1.0, tl.float32)
    product = tl.full([RB], 1.0, tl.float64)  # NOTE: torch's CPU cumprod accumulates fp32 in fp64
    art_product = tl.full([RB], 1.0, tl.float64)
    word = tl.zeros([RB], dtype=tl.int64)
    for j in tl.static_range(P):
        s = tl.load(scores_ptr + rows * P + j, mask=valid, other=0.0).to(tl.float32)
        if ARTIFACT:  # NOTE: the predictor's uncalibrated score through its artifact's map first (`scores`)
            raw_x = _conditional(s, raw_before)
            raw_before = s
            art_product = art_product * _mapped(raw_x, art_ptr + rows.to(tl.int64) * art_row + j * (KA + 1), valid,
                                                KA).to(tl.float64)
            s = art_product.to(tl.float32)
            if not CALIBRATE:
                tl.store(calibrated_ptr + rows * P + j, s, mask=valid)
        x = _conditional(s, before)
        before = s
        # 15 bits, round half to even (torch.round): v - floor(v) is exact below 2^15
        v = x * top
        low = tl.floor(v)
        frac = v - low
        odd = (low.to(tl.int64) % 2) == 1
        q = low.to(tl.int64) + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1, 0)
        if j % PER_WORD == 0:
            word = q
        else:
            word = word + (q << (UNIT * (j % PER_WORD)))
        if (j % PER_WORD == PER_WORD - 1) or (j == P - 1):
            tl.store(packed_ptr + rows * WORDS + j // PER_WORD, word, mask=valid)
        if CALIBRATE:
            product = product * _mapped(x, knots_ptr + j * (K + 1), valid, K).to(tl.float64)
            tl.store(calibrated_ptr + rows * P + j, product.to(tl.float32), mask=valid)


def conditionals_triton(scores: torch.Tensor, knots: torch.Tensor | None,
                        artifact_knots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DScale's step after the predictor's scores [N, P] (non-increasing, in [0, 1]) in one launch -> (the raw
    conditionals packed for the host, [N, ceil(P / 4)] int64 = `pack_unit(conditional_scores(scores))`; the
    scores the allocation reads: `calibrated_scores(conditionals, knots)` [N, P] float32 with the live map `knots`
    [P, K + 1] float32, else `scores` itself).

    With `artifact_knots` [N, P, K_a + 1] float32 (each row's map, any row stride: `AcceptancePredictor.band_knots`,
    a stride of 0 for one band), `scores` are the predictor's uncalibrated ones, and the scores above are those that
    `AcceptancePredictor.scores` makes of them first, `calibrated_scores(conditional_scores(scores), artifact_knots)`
    (the ~25 launches of the artifact's calibration, in this one)."""
    n, p = scores.shape
    assert scores.is_contiguous() and scores.dtype in (torch.float32, torch.float16, torch.bfloat16)
    require_interpreter_on_cpu(scores, "the Triton conditionals", "decision")
    words = -(-p // UNITS_PER_WORD)
    packed = torch.empty(n, words, dtype=torch.int64, device=scores.device)
    mapped = knots is not None or artifact_knots is not None
    calibrated = torch.empty(n, p, dtype=torch.float32, device=scores.device) if mapped else scores
    if knots is not None:
        assert knots.shape[0] == p and knots.dtype == torch.float32 and knots.is_contiguous(), knots.shape
    if artifact_knots is not None:
        assert artifact_knots.shape[:2] == (n, p) and artifact_knots.dtype == torch.float32, artifact_knots.shape
        assert artifact_knots.stride(2) == 1 and artifact_knots.stride(1) == artifact_knots.shape[2], \
            "artifact_knots: each row's map [P, K + 1] contiguous"
    if n:
        _conditionals_kernel[(triton.cdiv(n, SCORE_ROWS),)](
            scores, knots if knots is not None else scores, packed, calibrated,
            artifact_knots if artifact_knots is not None else scores,
            artifact_knots.stride(0) if artifact_knots is not None else 0, n, P=p,
            K=knots.shape[1] - 1 if knots is not None else 1,
            KA=artifact_knots.shape[2] - 1 if artifact_knots is not None else 1, WORDS=words, UNIT=UNIT_BITS,
            PER_WORD=UNITS_PER_WORD, RB=SCORE_ROWS, CALIBRATE=knots is not None,
            ARTIFACT=artifact_knots is not None, num_warps=1, enable_fp_fusion=False)
    return packed, calibrated


def compile_offline(batch: int = 32, block_size: int = 16, knots: int = 9, arch: int = 90) -> list:
    """The three kernels compiled for an NVIDIA target without a GPU (`kernels.compile_for_gpu`): a CI check of the
    compiled path, which the interpreter does not make. Needs triton imported without TRITON_INTERPRET."""
    from dscale_runtime.kernels import compile_for_gpu

    assert not interpreted(), "compile_offline needs triton imported without TRITON_INTERPRET"
    wb, p = triton.next_power_of_2(block_size), block_size - 1
    words = -(-p // UNITS_PER_WORD)
    accept = {"W": block_size, "WB": wb, "RB": ROWS, "GIVEN": False, "KEEP": True, "FULL": False, "EXTRA": words,
              "EB": triton.next_power_of_2(words)}
    conditionals = {"P": p, "K": knots - 1, "KA": knots - 1, "WORDS": words, "UNIT": UNIT_BITS,
                    "PER_WORD": UNITS_PER_WORD, "RB": SCORE_ROWS, "CALIBRATE": True, "ARTIFACT": True}
    return [compile_for_gpu(_block_metadata_kernel, {"W": block_size, "RB": ROWS, "BLOCK": True}, {"*": "*i64"}, 4,
                            arch),
            compile_for_gpu(_accept_kernel, accept, {"*": "*i64"}, 4, arch),
            compile_for_gpu(_conditionals_kernel, conditionals, {"*": "*fp32", "packed_ptr": "*i64"}, 1, arch,
                            enable_fp_fusion=False)]
