"""The target's decoding policy and the step's random draws: graph-safe, counter-based, reproducible.

Policy: temperature, top-k and top-p turn logits into per-row distributions (`policy_probs`, the vLLM/OpenAI
meaning of the three fields; the filters are a per-row floor on the scaled logits found without sorting, with
the tie rule of `kernels/filters.py`; `policy_probs_ref` sorts, the oracle). Draws: every uniform the engine
uses is a hash of (request seed, absolute token position, purpose) (`keyed_uniforms`), never a stateful
generator, so a step is a pure tensor function (it can be captured as a CUDA graph and replayed) and a
request's draws do not depend on what shares its batch, on graphs being on or off, or on how many slots a
step verifies. A token is drawn by inverting the distribution's
CDF at one such uniform (`sample_inverse_cdf`).

NOTE: target-only sampling draws the token at position t as inverse-CDF(P_t, u(seed, t, TARGET)); the
speculative steps draw every verification row's target token with the same key, so under the top-1 rule a
seeded request produces exactly the tokens target-only sampling produces (DESIGN 3.5, `verify.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dscale_runtime.kernels.choice import auto_backend
from dscale_runtime.kernels.filters import ROW_PROGRAM_VOCAB, filter_floor, filter_keep_ref, scaled_logits
from dscale_runtime.kernels.sampling import _SECOND_KEY, chunk_exp_sums, keyed_uniforms, purpose_key  # noqa: F401

# Purposes of a draw (the third key of `keyed_uniforms`): one independent stream each.
TARGET = 1  # the target's token at a position (target-only sampling, verification rows, the first token)
DRAFT = 2  # a draft sampled from the drafter's policy (sampled-drafts rule)
COIN = 3  # the accept/reject coin of a sampled draft
RESIDUAL = 4  # the successor drawn from the residual max(0, p - q) after a rejection

SEED_BITS = 64
_MASK32 = 0xFFFFFFFF


def split_seed(seed: int) -> tuple[int, int]:
    """A seed in [0, 2^64) -> (low 32 bits, high 32 bits), the form the step buffers hold."""
    if not 0 <= seed < 1 << SEED_BITS:
        raise ValueError(f"seed must lie in [0, 2^64), got {seed}")
    return seed & _MASK32, seed >> 32


@dataclass
class SamplingRows:
    """Per-row policy and draw keys (rows: requests, or verification rows gathered with `.rows`)."""

    greedy: torch.Tensor  # [R] bool: argmax rows (temperature 0)
    temperature: torch.Tensor  # [R] float32 (1 where greedy: never used there)
    top_k: torch.Tensor  # [R] int64, <= 0 means off
    top_p: torch.Tensor  # [R] float32, 1 means off
    seed_lo: torch.Tensor  # [R] int64
    seed_hi: torch.Tensor  # [R] int64
    backend: str = "ref"  # the sampler's kernel path (draws, chunk sums, inverse CDF): the target's `fused`

    def rows(self, index: torch.Tensor) -> "SamplingRows":
        """The same parameters for rows that belong to requests `index` [M]."""
        return SamplingRows(self.greedy[index], self.temperature[index], self.top_k[index], self.top_p[index],
                            self.seed_lo[index], self.seed_hi[index], self.backend)

    def uniforms(self, positions: torch.Tensor, purpose: int) -> torch.Tensor:
        """Draws [R, ...] for positions [R, ...] (rows broadcast along the trailing dims)."""
        shape = (-1,) + (1,) * (positions.dim() - 1)
        return keyed_uniforms(self.seed_lo.view(shape), self.seed_hi.view(shape), positions, purpose, self.backend)


def policy_probs(logits: torch.Tensor, rows: SamplingRows, filtered: bool, backend: str | None = None) -> torch.Tensor:
    """Logits [R, V] -> fp32 probabilities [R, V] of the temperature / top-k / top-p policy.

    The tempered softmax over s = (l - max l) / T; with `filtered` (a host decision: some row uses top-k or
    top-p) restricted to s >= the row's floor (`kernels.filters`: a radix select, no sort; `backend`, default
    the rows' own). Rows without filters get the tempered softmax either way."""
    shift, inv_t = logits.float().amax(dim=-1), _inv_t(rows)
    s = scaled_logits(logits, shift, inv_t)
    if not filtered:
        return _normalised(s, None)
    floor = filter_floor(logits, shift, inv_t, rows.top_k, rows.top_p, backend or rows.backend)
    return _normalised(s, s >= floor[:, None])


def policy_probs_ref(logits: torch.Tensor, rows: SamplingRows, filtered: bool) -> torch.Tensor:
    """`policy_probs` by sorting the vocabulary (`kernels.filters.filter_keep_ref`, the rule's definition)."""
    s = scaled_logits(logits, logits.float().amax(dim=-1), _inv_t(rows))
    return _normalised(s, filter_keep_ref(s, rows.top_k, rows.top_p) if filtered else None)


def _inv_t(rows: SamplingRows) -> torch.Tensor:
    return 1.0 / rows.temperature.float().clamp_min(1e-6)


def _normalised(s: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """exp(s) [R, V] over the kept entries, divided by its float64 row sum -> fp32."""
    w = torch.exp(s) if keep is None else torch.where(keep, torch.exp(s), 0.0)
    return (w / w.sum(dim=-1, keepdim=True, dtype=torch.float64)).float()


CDF_CHUNK = 1024  # vocabulary entries per chunk of the two-level inverse CDF


@dataclass
class Policy:
    """R row distributions over the vocabulary, kept as their logits: weight w_r(x) = exp(s_rx), s_rx = (l_rx -
    shift_r) * inv_t_r (the tempered softmax up to a factor per row), 0 where s_rx < floor_r (top-k / top-p), or
    as dense weights (the residuals of rejected drafts). `chunk_sums` [R, C] float64 are the weights of each
    chunk of CDF_CHUNK entries; `total` [R] their sum. Built by `make_policy` / `Policy.dense`; read by `sample`
    and `weights_at`."""

    values: torch.Tensor  # [R, V] logits (model dtype) or dense weights (fp32 / fp64)
    shift: torch.Tensor | None  # [R] fp32 row max (None: `values` are the weights themselves)
    inv_t: torch.Tensor | None  # [R] fp32 1 / temperature
    chunk_sums: torch.Tensor  # [R, C] float64
    chunk: int = CDF_CHUNK  # entries per chunk
    floor: torch.Tensor | None = None  # [R] fp32 lowest kept s (-inf: every entry; None: no filter at all)
    row_total: torch.Tensor | None = None  # [R] float64 the rows' total weight where it was computed with them

    @property
    def total(self) -> torch.Tensor:  # [R] float64
        return self.chunk_sums.sum(-1) if self.row_total is None else self.row_total

    @classmethod
    def from_rows(cls, logits: torch.Tensor, stats: tuple, filtered: bool) -> "Policy":
        """The policy of logits [R, V] from its rows' (shift, inv_t, floor, total) as `row_tokens_triton` stores
        them beside the rows' tokens: one chunk the width of the row (the total its sum), no further pass."""
        shift, inv_t, floor, total = stats
        return cls(logits, shift, inv_t, total[:, None], 1 << max(logits.shape[1] - 1, 0).bit_length(),
                   floor if filtered else None, total)

    @classmethod
    def dense(cls, weights: torch.Tensor, chunk: int = CDF_CHUNK) -> "Policy":
        r, vocab = weights.shape
        pad = -vocab % chunk
        padded = torch.cat([weights, weights.new_zeros(r, pad)], dim=1) if pad else weights
        return cls(weights, None, None, padded.reshape(r, -1, chunk).sum(-1, dtype=torch.float64), chunk)

    def weights_at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """float64 weights of entries (rows, cols) (broadcast index tensors)."""
        v = self.values[rows, cols]
        if self.shift is None:
            return v.double()
        s = (v.float() - self.shift[rows]) * self.inv_t[rows]
        w = torch.exp(s).double()
        return w if self.floor is None else torch.where(s >= self.floor[rows], w, 0.0)

    def row_weights(self, rows: torch.Tensor) -> torch.Tensor:
        """float64 weights [n, V] of whole rows `rows` [n] (a few rows only: residuals)."""
        v = self.values[rows]
        if self.shift is None:
            return v.double()
        w = torch.exp((v.double() - self.shift[rows, None].double()) * self.inv_t[rows, None].double())
        if self.floor is None:
            return w
        # NOTE: the kept set is decided on the fp32 s, as everywhere else; only the weights are float64 here.
        return torch.where(scaled_logits(v, self.shift[rows], self.inv_t[rows]) >= self.floor[rows, None], w, 0.0)

    def probs_at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return self.weights_at(rows, cols) / self.total[rows]


def make_policy(logits: torch.Tensor, rows: SamplingRows, filtered: bool, backend: str | None = None,
                chunk: int = CDF_CHUNK, row_max: torch.Tensor | None = None) -> Policy:
    """The policy of logits [R, V], kept as the logits: the tempered softmax, and with `filtered` the rows'
    top-k / top-p floors (`kernels.filters.filter_floor`, a radix select over the row: no sort). The chunk sums
    are then the only other full pass (`kernels.sampling.chunk_exp_sums`: one Triton read of the logits on CUDA;
    `backend`, default the rows' own, is the target's KernelChoice `fused`). `row_max` [R]: the logits' row
    maxima when the caller has them."""
    backend = backend or rows.backend
    shift = (logits.amax(dim=-1) if row_max is None else row_max).float()
    inv_t = _inv_t(rows)
    floor = filter_floor(logits, shift, inv_t, rows.top_k, rows.top_p, backend) if filtered else None
    return Policy(logits, shift, inv_t, chunk_exp_sums(logits, shift, inv_t, chunk, backend, floor), chunk, floor)


def sample(policy: Policy, u: torch.Tensor, backend: str = "ref") -> torch.Tensor:
    """One token per row at uniforms u [R]: the first token whose cumulative weight exceeds u x total
    (`sample_inverse_cdf_ref`'s function), in two levels: the chunk sums locate the chunk, a scan of that
    chunk alone locates the token. Zero-weight tokens are never chosen. `backend` 'triton' runs both levels in
    one kernel (`kernels.triton_sampling.sample_triton`; its sums round in their own order)."""
    (r, vocab), chunk = policy.values.shape, policy.chunk
    if backend == "auto":
        backend = auto_backend(policy.values.device, torch.float32)
    if backend == "triton" and policy.values.stride(-1) == 1 and policy.chunk_sums.shape[1] <= 4096:
        from dscale_runtime.kernels.triton_sampling import sample_triton

        return sample_triton(policy.values, policy.shift, policy.inv_t, policy.chunk_sums, u.reshape(-1), chunk,
                             policy.floor)
    cum = policy.chunk_sums.cumsum(dim=-1)  # [R, C]
    total = cum[:, -1:].contiguous()
    value = u.view(-1, 1).double() * total  # [R, 1]
    # NOTE: the last chunk (token) of positive weight is the first to reach the total: a value rounded up to
    # the total lands there, never on a zero-weight chunk (token) after it.
    at = torch.minimum(torch.searchsorted(cum, value, right=True), torch.searchsorted(cum, total, right=False))
    prefix = torch.where(at > 0, cum.gather(1, (at - 1).clamp_min(0)), torch.zeros_like(value))
    index = at * chunk + torch.arange(chunk, device=u.device)  # [R, chunk]
    row = torch.arange(r, device=u.device)[:, None]
    local = policy.weights_at(row, index.clamp(max=vocab - 1)) * (index < vocab)
    local_cdf = local.cumsum(dim=-1) + prefix
    end = local_cdf[:, -1:].contiguous()
    inside = torch.minimum(torch.searchsorted(local_cdf, value, right=True),
                           torch.searchsorted(local_cdf, end, right=False))
    return (at * chunk + inside).view(-1)


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor, chunk: int = CDF_CHUNK,
                       backend: str = "ref") -> torch.Tensor:
    """`sample` over dense weights [R, V] (non-negative, any scale)."""
    return sample(Policy.dense(weights, chunk), u, backend)


def sample_inverse_cdf_ref(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The portable definition: one scan over the whole row (float64), the oracle of `sample`."""
    cdf = weights.double().cumsum(dim=-1)  # [R, V] non-decreasing
    total = cdf[:, -1:].contiguous()
    value = u.view(-1, 1).double() * total
    token = torch.searchsorted(cdf, value, right=True)
    # NOTE: value may round up to the total; the last token of positive weight is the first reaching it.
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(token, last).view(-1)


def _resolved(backend: str, logits: torch.Tensor) -> str:
    return auto_backend(logits.device, torch.float32) if backend == "auto" else backend


WIDE_ROW_VOCAB = 4096 * CDF_CHUNK
"""Sampled rows of up to this many tokens take `row_tokens_triton`: one program per row up to ROW_PROGRAM_VOCAB, its
wide form above (whose draw kernel holds a row's chunk sums in one block, as `sample`'s does)."""


def _row_programs(logits: torch.Tensor, backend: str, sampled: bool = False) -> bool:
    """Whether logits [R, V] take `triton_sampling.row_tokens_triton`: the Triton path, contiguous rows in a dtype it
    reads, of at most ROW_PROGRAM_VOCAB tokens (one program per row, one launch) or, when `sampled`, WIDE_ROW_VOCAB
    (above ROW_PROGRAM_VOCAB its wide form, four launches)."""
    limit = WIDE_ROW_VOCAB if sampled else ROW_PROGRAM_VOCAB
    return (backend == "triton" and logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[1] <= limit
            and logits.dtype in (torch.float32, torch.float16, torch.bfloat16))


def greedy_tokens(logits: torch.Tensor, backend: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's argmax, its first maximal entry, of logits [..., V] -> [...] int64 (torch.argmax's tokens). On the
    Triton path, contiguous rows of a vocabulary of at most ROW_PROGRAM_VOCAB tokens take one program each
    (`row_tokens_triton`, unsampled): torch's argmax reduction took 15 us over the demo drafter's 480 x 4,096 draft
    logits on the H200, the row kernel 2.6 us over the target's 512 verification rows (2026-12-03 profiles).
    `out`: an int64 [N, P] view (unit last stride) of logits [N, P, V]'s rows that takes the tokens, written by the
    row kernel itself where it runs (a block's draft slots: no copy launch), and returned."""
    backend = _resolved(backend, logits)
    if logits.dim() >= 2 and logits.is_contiguous():
        rows = logits.view(-1, logits.shape[-1])
        if _row_programs(rows, backend):
            from dscale_runtime.kernels.triton_sampling import row_tokens_triton

            if out is not None and out.dim() == 2 and out.stride(-1) == 1 and out.shape == logits.shape[:-1]:
                return row_tokens_triton(rows, False, False, out=out)
            tokens = row_tokens_triton(rows, False, False).view(logits.shape[:-1])
            return tokens if out is None else out.copy_(tokens)
    return logits.argmax(dim=-1) if out is None else out.copy_(logits.argmax(dim=-1))


def target_tokens(logits: torch.Tensor, rows: SamplingRows, positions: torch.Tensor, filtered: bool,
                  sampled: bool, index: torch.Tensor | None = None, max_index: int = 0, offset: int = 0,
                  with_policy: bool = True) -> tuple[torch.Tensor, Policy | None]:
    """The target's token for every row of logits [R, V] -> (tokens [R], its policy or None).

    Greedy rows take the argmax; when `sampled` (a host decision: some row samples) the others take
    inverse-CDF(policy, u(seed, position, TARGET)), positions[r] + `offset` being the index of the token drawn;
    every sampler kernel runs on the rows' `backend`. `rows` are per row of logits, or with `index` [R] per
    request: row r takes request min(index[r], max_index)'s parameters. The policy comes back when `sampled` and
    `with_policy` (the sampled-drafts rule reads it).

    A vocabulary of at most ROW_PROGRAM_VOCAB tokens on the Triton path takes one launch for the tokens
    (`triton_sampling.row_tokens_triton`: argmax, floor, chunk sums, draw and inverse CDF, the unfused kernels'
    arithmetic), whether or not the policy is also built, so every step and prefill draws a token by one
    function; the policy then comes from the same launch (`Policy.from_rows`: its greedy rows hold placeholders,
    finite, for a caller that reads only the sampled ones). Sampled rows of a larger vocabulary (Qwen3's) take its
    wide form: four launches, the same tokens and policy."""
    backend = _resolved(rows.backend, logits)
    if _row_programs(logits, backend, sampled):
        from dscale_runtime.kernels.triton_sampling import row_tokens_triton

        stats = sampled and with_policy
        out = row_tokens_triton(logits, sampled, filtered, index, max_index, rows.greedy, rows.temperature,
                                rows.top_k, rows.top_p, rows.seed_lo, rows.seed_hi, positions, offset,
                                purpose_key(TARGET), _SECOND_KEY, stats=stats,
                                wide=logits.shape[1] > ROW_PROGRAM_VOCAB)
        if not stats:
            return out, None
        return out[0], Policy.from_rows(logits, out[1], filtered)
    if not sampled:
        return logits.argmax(dim=-1), None
    gathered = rows if index is None else rows.rows(index.clamp(max=max_index))
    if offset:
        positions = positions + offset
    row_max, argmax = logits.max(dim=-1)  # NOTE: one read gives the greedy token and the policy's shift
    policy = make_policy(logits, gathered, filtered, row_max=row_max)
    drawn = sample(policy, gathered.uniforms(positions, TARGET), gathered.backend)
    return torch.where(gathered.greedy, argmax, drawn), policy if with_policy else None


def draft_draws(logits: torch.Tensor, rows: SamplingRows, ctx: torch.Tensor, drawn: torch.Tensor, filtered: bool,
                argmax: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, Policy]:
    """The drafts of the sampled-drafts rule: logits [B, S, V] of S draft slots per request (slot j at index
    ctx + j + 1), each drawn from the drafter's policy q at u(seed, ctx + j + 1, DRAFT) where `drawn` [B] (bool)
    and its argmax (`argmax` [B, S]) elsewhere -> (drafts [B, S], q over the B x S slots). On the Triton path a
    vocabulary of at most ROW_PROGRAM_VOCAB tokens takes one launch for both (`row_tokens_triton` with its
    rows' stats: the draws of `sample` on `make_policy`'s q), a larger one (up to WIDE_ROW_VOCAB) four; q's rows of
    undrawn requests then hold placeholders (their drafts were not drawn from it, so no rule reads them).
    `out` (int64 [B, S], unit last stride; may be `argmax` itself, a block's draft slots): takes the drafts, stored
    there by the one-program rows' launch (elsewhere copied), and is returned."""
    b, slots, vocab = logits.shape
    flat = logits.reshape(b * slots, vocab)
    if _row_programs(flat, _resolved(rows.backend, flat), True):
        from dscale_runtime.kernels.triton_sampling import row_tokens_triton

        wide = vocab > ROW_PROGRAM_VOCAB
        into = out if out is not None and not wide and out.stride(-1) == 1 else None
        tokens, stats = row_tokens_triton(flat, True, filtered, None, 0, ~drawn, rows.temperature, rows.top_k,
                                          rows.top_p, rows.seed_lo, rows.seed_hi, ctx, 1, purpose_key(DRAFT),
                                          _SECOND_KEY, per_request=slots, stats=True, wide=wide, out=into)
        drafts = tokens if into is not None else tokens.view(b, slots)
        if out is not None and into is None:
            drafts = out.copy_(drafts)
        return drafts, Policy.from_rows(flat, stats, filtered)
    per_slot = rows.rows(torch.arange(b, device=logits.device).repeat_interleave(slots))
    q = make_policy(flat, per_slot, filtered)
    positions = ctx[:, None] + torch.arange(1, slots + 1, device=logits.device)  # [B, S] the drafts' indices
    tokens = sample(q, rows.uniforms(positions, DRAFT).reshape(-1), rows.backend).view(b, slots)
    drafts = torch.where(drawn[:, None], tokens, argmax)
    return (drafts if out is None else out.copy_(drafts)), q
