"""Evaluation on the prompt-disjoint test split, side by side with the baselines a user could pick instead.

Metrics: per-position AUROC, Brier score and ECE of P(accepted >= j); R^2 of the predicted accepted count
(sum of monotone scores); Spearman of the mean top1-top2 gap with the accepted count; retention
(sum min(y, k - 1) / sum y) of the raw seeds and after Algorithm 1 at budgets `ratio x W x N` over cohorts of N
requests (paper Fig. 10), with the mean verify length, beside the bound: the oracle allocation, which knows every
request's accepted count (`oracle_lengths`, the optimum of the budgeted problem). Everything is also reported per
temperature (`by_temperature`): calibration and retention of the records decoded at each.

NOTE: a prompt-disjoint test split keeps only ~10% of any logged batch (a step at concurrency 32 holds ~3
test requests), so cohorts are consecutive test records, in logged order, of one concurrency level and one
temperature: the nearest thing to one verification batch that the held-out prompts allow.
Baselines on the same cohorts: a fixed width using the same budget (8 at 0.5, 4 at 0.25); the mean-gap heuristic
as score; an online per-position logistic model on the top1-top2 margin, refit every 100 logged steps
(vLLM-style, no offline training), fitted on each temperature's records alone (the most it could adapt).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import r2_score, roc_auc_score

from dscale_runtime.dvl.allocate import allocate, budget_rows
from dscale_runtime.dvl.features import FeatureSpec
from dscale_runtime.dvl.predictor import seed_lengths
from dscale_predictor.data import Traces

ONLINE_REFIT_STEPS = 100


def gap2(features: np.ndarray, spec: FeatureSpec) -> np.ndarray:
    """Top1-top2 logit gap at every draft position: [R, P]."""
    return features[:, [j * spec.per_position + 1 for j in range(spec.num_positions)]]


def monotone(p: np.ndarray) -> np.ndarray:
    return np.minimum.accumulate(p, axis=1)


def ece(prob: np.ndarray, label: np.ndarray, bins: int = 10) -> float:
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(prob, edges[1:-1]), 0, bins - 1)
    total = 0.0
    for b in range(bins):
        mask = idx == b
        if mask.any():
            total += mask.sum() * abs(prob[mask].mean() - label[mask].mean())
    return float(total / len(prob))


def heuristic_scores(test: Traces, train: Traces, spec: FeatureSpec) -> np.ndarray:
    """Mean-gap heuristic: s_j = g_j / (g_j + tau), tau = the train median gap, made non-increasing."""
    tau = float(np.median(gap2(train.features, spec)))
    g = gap2(test.features, spec)
    return monotone(g / (g + max(tau, 1e-6)))


def online_logistic_scores(test: Traces, spec: FeatureSpec, refit_every: int = ONLINE_REFIT_STEPS) -> np.ndarray:
    """Per-position logistic P(draft j accepted | j - 1 accepted) on the top1-top2 margin, fitted online on the
    batches seen so far (in logged order) and refit every `refit_every` batches; s_j = product up to j."""
    g = gap2(test.features, spec)
    y = test.accepted
    order, seen = [], set()
    for b in test.batch_id.tolist():
        if b not in seen:
            seen.add(b)
            order.append(b)
    rows_of: dict[str, list[int]] = {}
    for i, b in enumerate(test.batch_id.tolist()):
        rows_of.setdefault(b, []).append(i)
    p = spec.num_positions
    cond = np.full((len(y), p), 0.5)  # prior before the first fit
    models: list = [None] * p
    history: list[int] = []
    for n, batch in enumerate(order):
        if n and n % refit_every == 0:
            hist = np.array(history)
            for j in range(p):
                reached = hist[y[hist] >= j]  # rows whose draft j + 1 was judged
                labels = (y[reached] >= j + 1).astype(int)
                if len(reached) >= 10 and 0 < labels.sum() < len(labels):
                    models[j] = LogisticRegression().fit(g[reached, j : j + 1], labels)
        rows = np.array(rows_of[batch])
        for j, model in enumerate(models):
            if model is not None:
                cond[rows, j] = model.predict_proba(g[rows, j : j + 1])[:, 1]
        history += rows_of[batch]
    return np.cumprod(cond, axis=1)


def oracle_lengths(accepted: np.ndarray, budget: int, block_size: int) -> np.ndarray:
    """The bound: verify lengths [N] that know each request's accepted count y [N] and spend `budget` rows.

    Algorithm 1 on the label scores s_j = 1[j <= y] (seeds 1 + y): when the seeds exceed the budget it drops tail
    slots (each worth one kept draft), otherwise it adds slots worth nothing. Every row past the N anchors keeps at
    most one draft, so min(sum y, budget - N) kept drafts is the optimum, and this reaches it."""
    y = torch.from_numpy(np.asarray(accepted, dtype=np.int64))
    scores = (torch.arange(1, block_size)[None, :] <= y[:, None]).float()  # [N, W-1]
    return allocate(scores, seed_lengths(scores, block_size), torch.ones(len(y), dtype=torch.bool), budget).numpy()


def cohort_groups(test: Traces) -> list[np.ndarray]:
    """Test rows by (concurrency, temperature), each in logged order."""
    keys = sorted(set(zip(test.concurrency.tolist(), test.temperature.tolist())))
    return [np.flatnonzero((test.concurrency == c) & (test.temperature == t)) for c, t in keys]


def cohort_retention(scores: np.ndarray | None, test: Traces, n: int, budget_ratio: float, block_size: int,
                     fixed_width: int | None = None, oracle: bool = False) -> dict | None:
    """Retention and mean verify length over cohorts of n consecutive test records of one concurrency level and
    temperature; `scores` None with `fixed_width` a fixed width, with `oracle` the bound."""
    kept = total = lens = raw_kept = raw_lens = 0
    cohorts = 0
    for rows in cohort_groups(test):
        for start in range(0, len(rows) - n + 1, n):
            kept_c, total_c, lens_c, raw_kept_c, raw_lens_c = _cohort(scores, test, rows[start : start + n],
                                                                      budget_ratio, block_size, fixed_width, oracle)
            kept, total, lens = kept + kept_c, total + total_c, lens + lens_c
            raw_kept, raw_lens = raw_kept + raw_kept_c, raw_lens + raw_lens_c
            cohorts += 1
    if not cohorts or not total:
        return None
    out = {"cohorts": cohorts, "retention": round(float(kept / total), 4),
           "mean_verify_len": round(float(lens / (cohorts * n)), 3)}
    if scores is not None:
        out.update({"retention_raw": round(float(raw_kept / total), 4),
                    "mean_verify_len_raw": round(float(raw_lens / (cohorts * n)), 3)})
    return out


def _cohort(scores, test: Traces, pick: np.ndarray, budget_ratio: float, block_size: int, fixed_width: int | None,
            oracle: bool = False):
    """(kept, total, verify slots) after Algorithm 1 and (kept, verify slots) of the raw seeds, for one cohort."""
    n = len(pick)
    y = test.accepted[pick]
    if oracle:
        k0 = k = oracle_lengths(y, budget_rows(n, block_size, budget_ratio), block_size)
    elif fixed_width is not None:
        k0 = k = np.full(n, fixed_width)
    else:
        s = torch.from_numpy(scores[pick]).float()
        k0_t = seed_lengths(s, block_size)
        k_t = allocate(s, k0_t, torch.ones(n, dtype=torch.bool), budget_rows(n, block_size, budget_ratio))
        k0, k = k0_t.numpy(), k_t.numpy()
    return np.minimum(y, k - 1).sum(), y.sum(), k.sum(), np.minimum(y, k0 - 1).sum(), k0.sum()


def retention_table(methods: dict[str, np.ndarray], test: Traces, cohort_sizes: tuple[int, ...],
                    budget_ratios: tuple[float, ...], block_size: int) -> dict:
    """{ratio: {N: {method: figures}}}: every method, a budget-matched fixed width and the bound (`oracle`), with
    each method's share of the bound (`of_bound`)."""
    table = {}
    for ratio in budget_ratios:
        width = max(1, min(block_size, int(ratio * block_size + 0.5)))
        rows = {}
        for n in cohort_sizes:
            row = {name: cohort_retention(s, test, n, ratio, block_size) for name, s in methods.items()}
            row[f"fixed_width_{width}"] = cohort_retention(None, test, n, ratio, block_size, fixed_width=width)
            bound = row["oracle"] = cohort_retention(None, test, n, ratio, block_size, oracle=True)
            for name, figures in row.items():
                if figures is not None and bound is not None and bound["retention"] > 0:
                    figures["of_bound"] = round(figures["retention"] / bound["retention"], 4)
            rows[str(n)] = row
        table[str(ratio)] = rows
    return table


def calibration(scores: np.ndarray, test: Traces, num_positions: int) -> dict:
    """ECE of P(accepted >= j) per position, with the predicted and realised mean accepted count."""
    labels = test.accepted[:, None] >= np.arange(1, num_positions + 1)[None, :]
    return {"records": int(len(test)), "mean_accepted": round(float(test.accepted.mean()), 4),
            "mean_predicted": round(float(scores.sum(1).mean()), 4),
            "ece": [round(ece(scores[:, j], labels[:, j].astype(float)), 4) for j in range(num_positions)]}


def add_uncalibrated(report: dict, uncalibrated: np.ndarray, test: Traces, num_positions: int) -> None:
    """Put the calibration of the scores before an artifact's temperature map beside each temperature's entry."""
    for t, entry in report["by_temperature"].items():
        rows = np.flatnonzero(test.temperature == float(t))
        entry["uncalibrated"] = calibration(uncalibrated[rows], test.subset(rows), num_positions)


def evaluate(scores: np.ndarray, raw_probs: np.ndarray, test: Traces, train: Traces, spec: FeatureSpec,
             cohort_sizes: tuple[int, ...], budget_ratios: tuple[float, ...], block_size: int) -> dict:
    """scores: the predictor's monotone scores [R, P] on the test split; raw_probs: sigmoids before cummin.
    `retention` is the table at the first budget ratio; `retention_by_budget` holds every ratio."""
    y = test.accepted
    labels = (y[:, None] >= np.arange(1, spec.num_positions + 1)[None, :]).astype(float)
    auroc, brier, calib = [], [], []
    for j in range(spec.num_positions):
        has_both = 0 < labels[:, j].sum() < len(labels)
        auroc.append(round(float(roc_auc_score(labels[:, j], scores[:, j])), 4) if has_both else None)
        brier.append(round(float(np.mean((scores[:, j] - labels[:, j]) ** 2)), 4))
        calib.append(round(ece(scores[:, j], labels[:, j]), 4))
    report = {
        "test_records": int(len(y)), "test_prompts": int(len(set(test.prompt_id.tolist()))),
        "mean_accepted": round(float(y.mean()), 4),
        "per_position": {"auroc": auroc, "brier": brier, "ece": calib},
        "r2_accepted": round(float(r2_score(y, scores.sum(1))), 4),
        "r2_accepted_raw_sum": round(float(r2_score(y, raw_probs.sum(1))), 4),
        "spearman_mean_gap_vs_accepted": round(float(spearmanr(gap2(test.features, spec).mean(1), y).statistic), 4),
    }
    online = np.zeros_like(scores, dtype=np.float64)
    for t in sorted(set(test.temperature.tolist())):
        rows = np.flatnonzero(test.temperature == t)
        online[rows] = online_logistic_scores(test.subset(rows), spec)
    methods = {"predictor": scores, "mean_gap_heuristic": heuristic_scores(test, train, spec),
               "online_logistic": online}
    table = retention_table(methods, test, cohort_sizes, budget_ratios, block_size)
    report["retention"] = table[str(budget_ratios[0])]
    report["retention_by_budget"] = table
    report["by_temperature"] = {}
    for t in sorted(set(test.temperature.tolist())):
        rows = np.flatnonzero(test.temperature == t)
        part = test.subset(rows)
        entry = calibration(scores[rows], part, spec.num_positions)
        entry["sampling_rules"] = sorted(set(part.sampling_rule.tolist()))
        entry["retention_by_budget"] = retention_table({k: v[rows] for k, v in methods.items()}, part, cohort_sizes,
                                                       budget_ratios, block_size)
        report["by_temperature"][str(t)] = entry
    return report
