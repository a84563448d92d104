"""Evaluate predictor artifacts on a trace folder's prompt-disjoint test split, beside the baselines and the bound.

The split is dscale-train's (same seed and fractions give the same test prompts), so an artifact trained by
dscale-train on these traces is judged on prompts it never saw; an artifact trained on other traces (the shipped
`artifacts/demo.pt`) may have seen them: the figures then flatter it. Each artifact reads the features in its own
layout (a v1 artifact on v2 traces drops the sampling columns). The report is `dscale_predictor.evaluate`'s, per
artifact: calibration, retention at every budget and cohort size, the oracle bound, and all of it per temperature.

    python benchmarks/predictor_report.py --traces traces/t01 --predictors artifacts/demo.pt runs/x/x.pt \
        --out docs/data/predictor_t01_2026-12-02.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from dscale_predictor.data import prompt_split, read_traces, select_traces
from dscale_predictor.evaluate import add_uncalibrated, evaluate
from dscale_runtime.dvl.features import FeatureSpec
from dscale_runtime.dvl.predictor import load_predictor


def report_for(path: str, traces_dir: str, seed: int, fractions: tuple[float, float, float],
               cohort_sizes: tuple[int, ...], budget_ratios: tuple[float, ...],
               temperatures: list[float] | None = None) -> dict:
    """dscale-train's evaluation of the artifact at `path` on the traces' test split (optionally some
    temperatures only)."""
    model, _ = load_predictor(path)
    traces = read_traces(traces_dir)
    split = prompt_split(traces.prompt_id, traces.dataset, fractions, seed)
    spec = FeatureSpec.from_dict(traces.manifest["feature_spec"])
    parts = {name: select_traces(traces.subset(split == i), spec, temperatures, model.spec.version)[0]
             for name, i in (("train", 0), ("test", 2))}
    test = parts["test"]
    with torch.no_grad():
        x = torch.from_numpy(test.features)
        raw = torch.sigmoid(model(x)).numpy()
        scores = model.scores(x).numpy()  # through the artifact's calibration, where it has one
    out = evaluate(scores, raw, test, parts["train"], model.spec, cohort_sizes, budget_ratios,
                   model.spec.num_positions + 1)
    if model.calibration_knots is not None:
        add_uncalibrated(out, np.minimum.accumulate(raw, axis=1), test, model.spec.num_positions)
    out.update({"predictor": str(path), "feature_spec": model.spec.version,
                "calibration_temperatures": list(model.calibration_temperatures),
                "parameters": sum(p.numel() for p in model.parameters())})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--predictors", nargs="+", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--test-fraction", type=float, default=0.1)
    ap.add_argument("--cohort-sizes", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--budget-ratios", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--out", default=None, help="JSON file for the reports")
    args = ap.parse_args()
    fractions = (1 - args.val_fraction - args.test_fraction, args.val_fraction, args.test_fraction)
    reports = {p: report_for(p, args.traces, args.seed, fractions, tuple(args.cohort_sizes),
                             tuple(args.budget_ratios)) for p in args.predictors}
    for path, rep in reports.items():
        print(f"== {path} ({rep['feature_spec']}, {rep['parameters']} parameters): R^2 {rep['r2_accepted']}")
        for t, entry in rep["by_temperature"].items():
            before = f" (uncalibrated {entry['uncalibrated']['ece'][:3]})" if "uncalibrated" in entry else ""
            print(f"  T={t}: {entry['records']} records, mean accepted {entry['mean_accepted']} predicted "
                  f"{entry['mean_predicted']}, ECE j=1..3 {entry['ece'][:3]}{before}")
            for ratio, table in entry["retention_by_budget"].items():
                cells = [f"N={n}: " + " ".join(f"{m} {row[m]['retention']}" for m in ("oracle", "predictor",
                         "online_logistic") if row.get(m)) for n, row in table.items()]
                print(f"    budget {ratio}: " + "; ".join(cells))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"traces": args.traces, "seed": args.seed, "reports": reports},
                                             indent=1) + "\n")


if __name__ == "__main__":
    main()
