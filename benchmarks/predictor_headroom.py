"""Where the acceptance predictor's retention at a tight budget is limited (issue 27 acceptance 1): the same MLP and
loss as dscale-train on the same prompt-disjoint split, varied one way at a time, against the bound.

Variants (`--variants`):
- base: the trace's features, dscale-train's widths [224, 128] (~114K parameters over v3's 371 columns);
- wide: widths [1024, 512, 256] (~1M parameters): is the model's capacity the limit?
- lag: the request's previous step's confidence columns appended (0 and a flag where it has none): does more
  history than the last accepted counts help?
- nohidden: the projected drafter hidden states zeroed: do they carry anything?
Each variant trains with AdamW (lr 5e-4, weight decay 0.1, 256 records per step, early stopping on the validation
loss after 4 epochs without gain) and reports retention after Algorithm 1 and its share of the bound at every
budget and cohort size, for the records of one temperature. A trace folder collected with a wider hidden projection
(its manifest's feature spec says how wide) runs through the same code.

    python benchmarks/predictor_headroom.py --traces traces/t01 --temperature 0 --out headroom.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from dscale_predictor.data import prompt_split, read_traces
from dscale_predictor.evaluate import retention_table
from dscale_predictor.model import record_losses
from dscale_runtime.dvl.features import FeatureSpec

WIDTHS = {"base": (224, 128), "wide": (1024, 512, 256), "lag": (224, 128), "nohidden": (224, 128)}


def lagged(features: np.ndarray, prompt_id: np.ndarray, temperature: np.ndarray, spec: FeatureSpec) -> np.ndarray:
    """The previous record of the same request (prompt and temperature, in logged order)'s confidence columns."""
    last: dict = {}
    prev = np.full(len(features), -1)
    for i, key in enumerate(zip(prompt_id.tolist(), temperature.tolist())):
        prev[i] = last.get(key, -1)
        last[key] = i
    lag = np.zeros((len(features), spec.num_confidence + 1), np.float32)
    seen = prev >= 0
    lag[seen, :-1] = features[prev[seen], : spec.num_confidence]
    lag[seen, -1] = 1.0
    return np.concatenate([features, lag], axis=1)


def fit_scores(x: np.ndarray, y: np.ndarray, parts: dict, widths: tuple[int, ...], seed: int) -> np.ndarray:
    """Train on parts['train'], stop on parts['val'], return monotone scores of every record."""
    mean, std = x[parts["train"]].mean(0), x[parts["train"]].std(0) + 1e-3
    xn, yt = torch.from_numpy((x - mean) / std).float(), torch.from_numpy(y)
    torch.manual_seed(seed)
    layers, width = [], x.shape[1]
    for h in widths:
        layers += [torch.nn.Linear(width, h), torch.nn.GELU()]
        width = h
    net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 15))
    opt = torch.optim.AdamW(net.parameters(), lr=5e-4, weight_decay=0.1)
    train, val = torch.from_numpy(parts["train"]), torch.from_numpy(parts["val"])
    best, state, stale = float("inf"), None, 0
    for _ in range(40):
        net.train()
        order = train[torch.randperm(len(train))]
        for start in range(0, len(order), 256):
            idx = order[start : start + 256]
            loss = record_losses(net(xn[idx]), yt[idx]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            v = record_losses(net(xn[val]), yt[val]).mean().item()
        if v < best - 1e-5:
            best, state, stale = v, {k: t.clone() for k, t in net.state_dict().items()}, 0
        else:
            stale += 1
            if stale >= 4:
                break
    net.load_state_dict(state)
    with torch.no_grad():
        return torch.sigmoid(net(xn)).cummin(dim=1).values.double().numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True)
    ap.add_argument("--temperature", type=float, default=0.0, help="the records evaluated (training uses all)")
    ap.add_argument("--variants", nargs="+", default=list(WIDTHS), choices=list(WIDTHS))
    ap.add_argument("--val-fraction", type=float, default=0.1)
    ap.add_argument("--test-fraction", type=float, default=0.2)
    ap.add_argument("--budget-ratios", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    traces = read_traces(args.traces)
    spec = FeatureSpec.from_dict(traces.manifest["feature_spec"])
    split = prompt_split(traces.prompt_id, traces.dataset,
                         (1 - args.val_fraction - args.test_fraction, args.val_fraction, args.test_fraction), args.seed)
    parts = {name: np.flatnonzero(split == i) for name, i in (("train", 0), ("val", 1), ("test", 2))}
    test = traces.subset(parts["test"])
    rows = np.flatnonzero(test.temperature == args.temperature)
    out = {"traces": args.traces, "temperature": args.temperature, "feature_spec": spec.to_dict(), "variants": {}}
    for name in args.variants:
        x = traces.features.astype(np.float32)
        if name == "lag":
            x = lagged(x, traces.prompt_id, traces.temperature, spec)
        if name == "nohidden":
            x = x.copy()
            x[:, spec.num_confidence : spec.num_confidence + spec.num_hidden] = 0.0
        scores = fit_scores(x, traces.accepted.astype(np.int64), parts, WIDTHS[name], args.seed)[parts["test"]]
        table = retention_table({"predictor": scores[rows]}, test.subset(rows), (8, 16, 32),
                                tuple(args.budget_ratios), spec.num_positions + 1)
        out["variants"][name] = {r: {n: {"retention": row["predictor"]["retention"],
                                         "of_bound": row["predictor"]["of_bound"],
                                         "bound": row["oracle"]["retention"]} for n, row in t.items()}
                                 for r, t in table.items()}
        print(name, json.dumps(out["variants"][name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
