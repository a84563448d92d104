"""Live calibration of the acceptance predictor: watched from committed DScale steps, refreshed on the host,
applied inside the step on the device.

The predictor's scores s_j = P(accepted >= j), j = 1..P (P = W - 1), are non-increasing. The step turns them
into raw conditionals x_j = s_j / s_{j-1} (s_0 = 1), the acceptance of draft j given that drafts 1..j-1 were
accepted, and (calibration on) maps each through a per-position monotone piecewise-linear function g_j with
K + 1 knots at x = 0, 1/K, ..., 1 (`knots` [P, K + 1], a fixed-address device tensor the host rewrites in
place; identity at start): the calibrated scores are s'_j = prod_{i <= j} g_i(x_i), non-increasing by
construction. The raw conditionals go back to the host with the step's results (`pack_unit`: 15 bits each,
four to an int64 column of the one result read).

Censoring. DScale verifies k slots (k - 1 drafts), so the step shows a = min(y, k - 1) of the full-width
accepted count y. At position j:
- the conditional label 1(y >= j) given y >= j - 1 is seen exactly when j <= k - 1 and a >= j - 1;
- the marginal label 1(y >= j) is seen when j <= k - 1 (then a >= j iff y >= j), and also when a < k - 1 <
  j (then it is 0); the second case is selected by y itself (a rejection was seen), the first by k alone.
k is a function of the features (the step's decision), decided before and independently of the acceptance
draws. So a sample kept by a rule that reads only k and the conditioning event has, given its features, the
label distribution of every sample: the fit of g_j uses {j <= k - 1, a >= j - 1} with label a >= j, and the
watched marginal calibration (`LiveCalibration.report`) uses {j <= k - 1} with label a >= j, both unbiased
for the request-steps that verified position j. (Keeping the a < k - 1 < j zeros too, or fitting the
marginal on every seen label, would bias P(y >= j) low: it keeps a position's failures and drops its
censored successes.)

The fit: per position, least squares of the label on the piecewise-linear basis of x (hat functions of the
knots) over exponentially decayed sufficient statistics (a window of `window` request-steps), penalised
toward straight lines (`smooth` x squared second differences of the knot values) and, weakly, toward the
identity (`prior`, which holds knots without data), then a weighted isotonic projection (pool adjacent
violators) and a clip to [0, 1]. Memory is fixed: O(P x K) numbers for the fit, O(P x bins) for the watch.
The refresh runs on the host every `refresh` request-steps (0.16 ms); the map changes verification lengths
only, never which tokens are emitted.

The watched error is a debiased ECE: per bin of the predicted score, |sum(predicted - realised)| less the
chance part a calibrated bin would show (sqrt(max(0, gap^2 - sum w^2 p (1 - p)))), summed over bins and
divided by the weight. Over a window of ~1,400 effective request-steps the plain ECE of a calibrated predictor
reads ~0.02-0.03 from sampling noise alone; the debiased one reads its miscalibration (both are reported).

Defaults, measured on the demo pair (benchmarks/live_calibration.py, replaying a served trace: 1,500 greedy
then 3,841 T = 1 request-steps, 16 running): window 128, refresh 32, 8 knot intervals and a watch of 700
request-steps bring the error at j = 1..3 from 0.234 / 0.150 / 0.078 (raw) to 0.023 / 0.019 / 0.011 at 2,000
request-steps after the move and keep it under 0.03 from 943 on; windows of 64 or 256 let j = 1 stray above 0.03
late in the run, 512 and above recover more slowly (0.026 / 0.033 / 0.028 at 2,000 with 512).
"""

from __future__ import annotations

import numpy as np
import torch

KNOT_INTERVALS = 8  # K: knots at 0, 1/K, ..., 1 of the raw conditional
ECE_BINS = 10  # equal-width bins of the predicted P(accepted >= j) for the calibration error
ECE_POSITIONS = 3  # /metrics reports the calibration error at j = 1..3
WATCH_WINDOW = 700  # request-steps: the decay of the watched statistics (the error's window)
REFRESH_REQUEST_STEPS = 32  # request-steps between refreshes of the map
UNIT_BITS, UNITS_PER_WORD = 15, 4


def identity_knots(num_positions: int, intervals: int = KNOT_INTERVALS) -> torch.Tensor:
    """[P, K + 1] float32 knot values of the identity map."""
    return torch.linspace(0.0, 1.0, intervals + 1).expand(num_positions, -1).contiguous()


def conditional_scores(scores: torch.Tensor) -> torch.Tensor:
    """Non-increasing scores s [N, P] in [0, 1] -> raw conditionals x_j = s_j / s_{j-1} (s_0 = 1) [N, P] float32;
    0 where s_{j-1} = 0 (then s_j = 0 too)."""
    s = scores.float()
    before = torch.cat([torch.ones_like(s[:, :1]), s[:, :-1]], dim=1)
    return torch.where(before > 0, s / before.clamp_min(1e-30), torch.zeros_like(s)).clamp(0.0, 1.0)


def mapped_conditionals(conditionals: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """g_j(x_j) [N, P] for raw conditionals [N, P] and knots [P, K + 1] (one map for every row) or [N, P, K + 1]
    (a map per row); tensor work with static shapes (graph-safe, no host read; gathers ONNX exports)."""
    k = knots.shape[-1] - 1
    t = conditionals.float() * k
    left = t.floor().clamp(0, k - 1)
    frac = t - left
    left = left.long()
    rows = knots if knots.dim() == 3 else knots.unsqueeze(0).expand(conditionals.shape[0], -1, -1)
    lo = rows.gather(2, left.unsqueeze(-1)).squeeze(-1)
    hi = rows.gather(2, (left + 1).unsqueeze(-1)).squeeze(-1)
    return lo + frac * (hi - lo)


def calibrated_scores(conditionals: torch.Tensor, knots: torch.Tensor) -> torch.Tensor:
    """Raw conditionals [N, P] and knots [P, K + 1] or [N, P, K + 1] -> calibrated scores
    s'_j = prod_{i <= j} g_i(x_i) [N, P]."""
    return torch.cumprod(mapped_conditionals(conditionals, knots), dim=1)


def calibrated_scores_ref(conditionals: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """`calibrated_scores` position by position with `np.interp` (float64): the oracle, and the host's copy."""
    x = np.asarray(conditionals, dtype=np.float64)
    grid = np.linspace(0.0, 1.0, knots.shape[1])
    mapped = np.stack([np.interp(x[:, j], grid, knots[j]) for j in range(knots.shape[0])], axis=1)
    return np.cumprod(mapped, axis=1)


def fit_knots(conditionals: np.ndarray, accepted: np.ndarray, intervals: int = KNOT_INTERVALS, prior: float = 1.0,
              smooth: float = 20.0) -> np.ndarray:
    """Offline fit of the map on uncensored records (full-width accepted counts, e.g. a validation split): the
    live fit's estimator (`LiveCalibration.fit`) over every record at risk at each position, without decay.
    conditionals [R, P] raw conditionals, accepted [R] -> knots [P, K + 1] float32."""
    x = np.asarray(conditionals, dtype=np.float64)
    a = np.asarray(accepted)[:, None]
    j = np.arange(1, x.shape[1] + 1)[None, :]
    fit = LiveCalibration(x.shape[1], apply=True, window=np.inf, intervals=intervals, prior=prior, smooth=smooth)
    fit._fit_add(x, (a >= j).astype(np.float64), np.broadcast_to(a >= j - 1, x.shape), 1.0)
    return fit.fit()


def pack_unit(values: torch.Tensor) -> torch.Tensor:
    """[N, P] values in [0, 1] -> [N, ceil(P / 4)] int64, 15 bits each (step 1 / 32767), four to a word."""
    n, p = values.shape
    words = -(-p // UNITS_PER_WORD)
    q = torch.round(values.float().clamp(0, 1) * (2**UNIT_BITS - 1)).long()
    q = torch.cat([q, q.new_zeros(n, words * UNITS_PER_WORD - p)], dim=1).view(n, words, UNITS_PER_WORD)
    shifts = UNIT_BITS * torch.arange(UNITS_PER_WORD, device=values.device)
    return (q << shifts).sum(-1)


def unpack_unit(words: np.ndarray, count: int) -> np.ndarray:
    """Inverse of `pack_unit` on the host: [N, words] int64 -> [N, count] float64."""
    words = np.asarray(words, dtype=np.int64)
    shifts = UNIT_BITS * np.arange(UNITS_PER_WORD)
    q = (words[:, :, None] >> shifts) & (2**UNIT_BITS - 1)
    return q.reshape(len(words), -1)[:, :count] / (2**UNIT_BITS - 1)


def isotonic(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, c2 = blocks.pop()
            v1, w1, c1 = blocks[-1]
            blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.concatenate([np.full(c, v) for v, _, c in blocks])


class LiveCalibration:
    """Host statistics of committed DScale steps: the map's fit and the watched calibration (module docstring).

    `observe` takes one step's raw conditionals, accepted counts and verify lengths, and the knots the step
    ran with; `knots` is the current map (numpy, replaced on refresh, never changed in place); `report()` the
    watched figures. `apply` False: the map stays the identity and the step uses the raw scores (the watch
    goes on)."""

    def __init__(self, num_positions: int, apply: bool, window: int = 128, intervals: int = KNOT_INTERVALS,
                 prior: float = 1.0, smooth: float = 20.0, refresh: int = REFRESH_REQUEST_STEPS,
                 watch_window: int = WATCH_WINDOW) -> None:
        p, k = num_positions, intervals
        self.num_positions, self.apply, self.prior, self.refresh = p, apply, prior, refresh
        second = np.diff(np.eye(k + 1), n=2, axis=0)  # [K - 1, K + 1] second differences of the knot values
        self.penalty = smooth * second.T @ second + prior * np.eye(k + 1)
        self.decay, self.watch_decay = 1.0 - 1.0 / window, 1.0 - 1.0 / watch_window
        self.grid = np.linspace(0.0, 1.0, k + 1)
        self.knots = np.tile(self.grid, (p, 1)).astype(np.float32)
        self.version = 0
        self.diag = np.zeros((p, k + 1))  # sum of phi_m^2
        self.off = np.zeros((p, k))  # sum of phi_m phi_{m+1}
        self.rhs = np.zeros((p, k + 1))  # sum of phi_m y
        # Watch, per position and bin of the predicted score: weight, sum predicted, sum realised, and the
        # variance term sum w^2 p (1 - p) (decayed by decay^2) of the bin's mean; for the used and raw scores.
        self.watch = np.zeros((2, 4, p, ECE_BINS))
        self.request_steps = 0
        self._since = 0

    def observe(self, conditionals: np.ndarray, accepted: list[int], verify_lens: list[int],
                knots: np.ndarray | None) -> bool:
        """Add one committed step ([n, P] raw conditionals); returns True when the map was refreshed."""
        x = np.asarray(conditionals, dtype=np.float64)
        n, p = x.shape
        a = np.asarray(accepted)[:, None]
        k = np.asarray(verify_lens)[:, None]
        j = np.arange(1, p + 1)[None, :]
        label = (a >= j).astype(np.float64)  # [n, P]
        verified = j <= k - 1  # the marginal label is seen, selected by k alone
        at_risk = verified & (a >= j - 1)  # the conditional label is seen
        self._fit_add(x, label, at_risk, self.decay**n)
        raw = np.cumprod(x, axis=1)
        used = calibrated_scores_ref(x, knots) if knots is not None else raw
        self.watch[:, :3] *= self.watch_decay**n
        self.watch[:, 3] *= self.watch_decay ** (2 * n)
        rows = np.broadcast_to(np.arange(p), (n, p))
        for which, pred in enumerate((used, raw)):
            bins = np.minimum((pred * ECE_BINS).astype(np.int64), ECE_BINS - 1)
            for stat, value in enumerate((np.ones_like(pred), pred, label, pred * (1 - pred))):
                np.add.at(self.watch[which, stat], (rows[verified], bins[verified]), value[verified])
        self.request_steps += n
        self._since += n
        if self.apply and self._since >= self.refresh:
            self._since = 0
            self.knots = self.fit()
            self.version += 1
            return True
        return False

    def _fit_add(self, x: np.ndarray, label: np.ndarray, keep: np.ndarray, decay: float) -> None:
        intervals = self.grid.size - 1
        t = x * intervals
        left = np.minimum(np.floor(t), intervals - 1).astype(np.int64)
        frac = t - left
        self.diag *= decay
        self.off *= decay
        self.rhs *= decay
        pos = np.broadcast_to(np.arange(x.shape[1]), x.shape)[keep]
        left, frac, y = left[keep], frac[keep], label[keep]
        np.add.at(self.diag, (pos, left), (1 - frac) ** 2)
        np.add.at(self.diag, (pos, left + 1), frac**2)
        np.add.at(self.off, (pos, left), frac * (1 - frac))
        np.add.at(self.rhs, (pos, left), (1 - frac) * y)
        np.add.at(self.rhs, (pos, left + 1), frac * y)

    def fit(self) -> np.ndarray:
        """The map from the current statistics: [P, K + 1] float32 knot values."""
        p, m = self.diag.shape
        a = np.zeros((p, m, m)) + self.penalty  # [P, K + 1, K + 1] the tridiagonal normal equations + penalty
        index = np.arange(m)
        a[:, index, index] += self.diag
        a[:, index[:-1], index[1:]] += self.off
        a[:, index[1:], index[:-1]] += self.off
        values = np.linalg.solve(a, (self.rhs + self.penalty @ self.grid)[..., None])[..., 0]  # [P, K + 1]
        for j in np.flatnonzero((np.diff(values, axis=1) < 0).any(axis=1)):
            values[j] = isotonic(values[j], self.diag[j] + self.prior)
        return np.clip(values, 0.0, 1.0).astype(np.float32)

    def report(self) -> dict:
        """Watched figures over the recent request-steps that verified each position (decayed window): per
        j = 1..P the weight, mean predicted P(accepted >= j) (as the step used it, and the raw predictor's) and
        the realised frequency; the calibration error (ECE over `ECE_BINS` bins) of both for j = 1..3."""
        used, raw = self.watch
        weight = used[0].sum(1)
        safe = np.maximum(weight, 1e-12)

        def ece(w: np.ndarray, debiased: bool = True) -> np.ndarray:
            gap = (w[1] - w[2]) ** 2
            if debiased:  # NOTE: minus the variance a calibrated bin's mean gap would show by chance
                gap = np.maximum(gap - w[3], 0.0)
            return np.sqrt(gap).sum(1) / safe

        nan = np.where(weight > 0, 1.0, np.nan)
        return {"weight": weight.tolist(), "predicted": (used[1].sum(1) / safe * nan).tolist(),
                "predicted_raw": (raw[1].sum(1) / safe * nan).tolist(),
                "realised": (used[2].sum(1) / safe * nan).tolist(),
                "error": (ece(used) * nan)[:ECE_POSITIONS].tolist(),
                "error_raw": (ece(raw) * nan)[:ECE_POSITIONS].tolist(),
                "error_plain": (ece(used, False) * nan)[:ECE_POSITIONS].tolist(),
                "request_steps": self.request_steps, "refreshes": self.version}
