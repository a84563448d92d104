"""Live calibration of the acceptance predictor under drifting traffic (issue 27, acceptance 3), on the demo pair.

A DScale engine (`--predictor`; the default `artifacts/demo.pt` is trained and calibrated at T = 0 and T = 1 since
2026-12-03, so the drift shows with a predictor trained on greedy traces alone, e.g. from `dscale-train --target
demo --temperatures '[0.0]'`) serves a closed loop of `--concurrency` requests: greedy until `--greedy-steps`
request-steps, then seeded T = 1 (the top-1 rule, whose output equals target-only sampling token for token).
After every committed step it records the live calibration error the engine reports
(`Engine.calibration.report()`, the /metrics figures: ECE of P(accepted >= j), j = 1..3, over the request-steps
that verified j) and, with `--retention` (full-width verification beside each DScale step,
for analysis only), the uncensored error over every request-step against the full-width accepted count,
same window. Prints, per run (`--calibration on,off`), when after the move to T = 1 the live error came back
under `--threshold` and stayed there, the errors at the end, retention, accepted drafts per request-step; and
checks every request's output against target-only decoding of the same requests (`--check-output`), with, for
a differing one, how close the target's choice was there (`closeness`).

    python benchmarks/live_calibration.py --calibration on,off --retention --check-output
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import DEMO_DIR, stdlib_prompts
from dscale_runtime.dvl.calibration import LiveCalibration
from dscale_runtime.engine import Engine


def traffic(engine: Engine, prompts: list[str], args) -> tuple[list, dict]:
    """Closed loop until `greedy + sampled` request-steps: returns [(prompt, params)] and {index: tokens}."""
    sent, outputs, index = [], {}, 0
    while engine.counters.request_steps < args.greedy_steps + args.sampled_steps:
        while engine.num_running + engine.num_waiting < args.concurrency:
            greedy = engine.counters.request_steps < args.greedy_steps
            params = SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=args.max_tokens,
                                    seed=None if greedy else 10_000 + index)
            engine.add_request(prompts[index % len(prompts)], params, request_id=str(index))
            sent.append((prompts[index % len(prompts)], params))
            index += 1
        for out in engine.step():
            outputs[int(out.request_id)] = out.token_ids
    while engine.has_unfinished():
        for out in engine.step():
            outputs[int(out.request_id)] = out.token_ids
    return sent, outputs


@torch.no_grad()
def closeness(prompt: str, params: SamplingParams, ours: list[int], theirs: list[int]) -> dict:
    """At the first differing token, recomputed in float64 from transformers' float32 logits over the shared
    prefix: greedy, the top-1 minus top-2 logit; sampled, the distance of the request's keyed uniform to the
    CDF boundary between the two tokens (a draw within rounding of a boundary picks either: not a bug)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dscale_runtime.sampling import TARGET, keyed_uniforms, split_seed

    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    model = AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=torch.float32).eval()
    j = next(k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    logits = model(torch.tensor([ids + ours[:j]])).logits[0, -1].double()
    if params.temperature == 0:
        top = logits.topk(2).values
        return {"first_difference": j, "top2_margin": float(top[0] - top[1])}
    cdf = torch.softmax(logits / params.temperature, -1).cumsum(0)
    lo, hi = split_seed(params.seed)
    u = keyed_uniforms(torch.tensor([lo]), torch.tensor([hi]), torch.tensor([len(ids) + j]), TARGET, "ref").item()
    edge = cdf[min(ours[j], theirs[j])].item()
    return {"first_difference": j, "uniform_to_cdf_boundary": abs(u - edge)}


def run(args, calibration: bool, prompts: list[str]) -> dict:
    cfg = EngineConfig(mode="dscale", max_running_requests=args.concurrency, max_model_len=1024,
                       sampling_rule="top1", live_calibration=calibration, calibration_window=args.window,
                       measure_retention=args.retention, budget_ratio=args.budget_ratio)
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter", predictor=args.predictor,
                                    config=cfg)
    width = engine.block_size
    truth = LiveCalibration(width - 1, apply=False)  # the same watch over uncensored labels: every slot "verified"
    trail = []  # (request_steps, live errors, true errors)
    record = []  # per DScale step: (request_steps before it, conditionals, full-width accepted, greedy share)
    commit = engine._commit_step

    def watched(requests, result, mode, kind, ctx, decode_steps, knots=None):
        finished = commit(requests, result, mode, kind, ctx, decode_steps, knots)
        if result.conditionals is not None:
            true = None
            if result.full_accepted is not None:
                record.append((engine.counters.request_steps - len(requests), result.conditionals,
                               np.asarray(result.full_accepted), [r.params.temperature == 0 for r in requests]))
                truth.observe(result.conditionals, result.full_accepted, [width] * len(result.accepted), knots)
                true = truth.report()["error"]
            trail.append((engine.counters.request_steps, engine.calibration.report()["error"], true))
        return finished

    engine._commit_step = watched
    start = time.perf_counter()
    sent, outputs = traffic(engine, prompts, args)
    seconds = time.perf_counter() - start
    after = [(s - args.greedy_steps, live, true) for s, live, true in trail if s > args.greedy_steps]
    above = [s for s, live, _ in after if max(live) >= args.threshold]
    back = above[-1] if above else 0  # request-steps after the move from which the live error stayed under
    c = engine.counters
    report = engine.calibration.report()
    result = {
        "calibration": calibration, "seconds": round(seconds, 1), "request_steps": c.request_steps,
        "live_error_back_under_after": back if after and back < after[-1][0] else None,
        "live_error_end": [round(e, 4) for e in after[-1][1]], "live_error_raw_end": [round(e, 4) for e in
                                                                                       report["error_raw"]],
        "true_error_end": [round(e, 4) for e in after[-1][2]] if after and after[-1][2] else None,
        "live_error_max_last_500": [round(max(t[1][j] for t in after if t[0] > after[-1][0] - 500), 4)
                                    for j in range(3)],
        "predicted": [round(v, 3) for v in report["predicted"][:6]],
        "realised": [round(v, 3) for v in report["realised"][:6]],
        "accepted_per_request_step": round(c.accepted_drafts / c.request_steps, 3),
        "retention": round(c.retained_drafts / c.full_width_drafts, 4) if c.full_width_drafts else None,
        "refreshes": report["refreshes"],
    }
    if args.retention:
        at = [t for t in after if t[2] is not None]
        result["true_error_at"] = {s: [round(e, 4) for e in true] for s, _, true in at[:: max(1, len(at) // 8)]}
        result["live_error_at"] = {s: [round(e, 4) for e in live] for s, live, _ in at[:: max(1, len(at) // 8)]}
    if args.record:
        np.savez_compressed(args.record, start=np.array([r[0] for r in record]),
                            sizes=np.array([len(r[2]) for r in record]),
                            conditionals=np.concatenate([r[1] for r in record]),
                            full_accepted=np.concatenate([r[2] for r in record]),
                            greedy=np.concatenate([r[3] for r in record]))
    if args.check_output:
        target = Engine.from_pretrained(DEMO_DIR / "target", config=EngineConfig(
            mode="target", max_running_requests=args.concurrency, max_model_len=1024))
        want = target.generate([p for p, _ in sent], [q for _, q in sent])
        result["outputs_equal_to_target_only"] = sum(outputs[i] == o.token_ids for i, o in enumerate(want))
        result["differences"] = [{"request": i, "temperature": sent[i][1].temperature,
                                  **closeness(*sent[i], outputs[i], o.token_ids)}
                                 for i, o in enumerate(want) if outputs[i] != o.token_ids]
        result["outputs"] = len(sent)
    return result


def replay(path: str, args) -> dict:
    """Replay a recorded trace (`--record`) through the decision and the live calibration on the host: each
    step's raw conditionals -> the live map -> Algorithm 1 at the budget -> a = min(y, k - 1) from the recorded
    full-width count y -> the watch. The tokens do not depend on k, so this is the served run without its
    models (the context features' accepted-count history aside), fast enough to sweep windows."""
    from dscale_runtime.dvl.allocate import allocate, budget_rows
    from dscale_runtime.dvl.calibration import calibrated_scores
    from dscale_runtime.dvl.predictor import seed_lengths

    trace = np.load(path)
    starts, sizes = trace["start"], trace["sizes"]
    cond_all, y_all = trace["conditionals"], trace["full_accepted"]
    width = cond_all.shape[1] + 1
    cal = LiveCalibration(width - 1, apply=args.calibration == "on", window=args.window)
    truth = LiveCalibration(width - 1, apply=False)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    switch = args.greedy_steps
    trail, kept, full = [], np.zeros(2), np.zeros(2)  # [greedy, sampled] phases
    for start, a, b in zip(starts, offsets[:-1], offsets[1:]):
        cond, y = cond_all[a:b], y_all[a:b]
        knots = cal.knots if cal.apply else None
        c = torch.from_numpy(cond).float()
        scores = calibrated_scores(c, torch.from_numpy(knots)) if knots is not None else torch.cumprod(c, 1)
        n = len(y)
        k = allocate(scores, seed_lengths(scores, width), torch.ones(n, dtype=torch.bool),
                     budget_rows(n, width, args.budget_ratio)).numpy()
        accepted = np.minimum(y, k - 1)
        phase = int(start >= switch)
        kept[phase] += accepted.sum()
        full[phase] += y.sum()
        cal.observe(cond, accepted.tolist(), k.tolist(), knots)
        truth.observe(cond, y.tolist(), [width] * n, knots)
        trail.append((start + n - switch, cal.report()["error"], truth.report()["error"]))
    after = [t for t in trail if t[0] > 0]
    above = [s for s, live, _ in after if max(live) >= args.threshold]
    above_true = [s for s, _, true in after if max(true) >= args.threshold]
    return {"replay": path, "calibration": args.calibration, "window": args.window, "budget_ratio": args.budget_ratio,
            "live_error_back_under_after": above[-1] if above else 0,
            "true_error_back_under_after": above_true[-1] if above_true else 0,
            "live_error_end": [round(e, 4) for e in after[-1][1]], "true_error_end": [round(e, 4) for e in after[-1][2]],
            "live_error_raw_end": [round(e, 4) for e in cal.report()["error_raw"]],
            "true_error_before_switch": [round(e, 4) for e in [t for t in trail if t[0] <= 0][-1][2]],
            "live_error_first_under_after": next((s for s, live, _ in after if max(live) < args.threshold), None),
            "live_error_at_2000": [round(e, 4) for e in next(t[1] for t in after if t[0] >= 2000)],
            "share_above_after_2000": round(np.mean([max(t[1]) >= args.threshold for t in after if t[0] >= 2000]), 3),
            "retention_greedy": round(kept[0] / full[0], 4), "retention_sampled": round(kept[1] / full[1], 4),
            "request_steps_after_switch": after[-1][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", default="on,off", help="comma-separated runs: on, off")
    parser.add_argument("--predictor", default=str(DEMO_DIR.parent / "demo.pt"), help="predictor artifact")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--greedy-steps", type=int, default=1000)
    parser.add_argument("--sampled-steps", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=EngineConfig.calibration_window,
                        help="EngineConfig.calibration_window")
    parser.add_argument("--budget-ratio", type=float, default=0.5)
    parser.add_argument("--threshold", type=float, default=0.03)
    parser.add_argument("--retention", action="store_true", help="measure the uncensored error and retention")
    parser.add_argument("--check-output", action="store_true", help="compare every output with target-only's")
    parser.add_argument("--record", default=None, help="with --retention: save every DScale step's raw "
                        "conditionals and full-width accepted counts to this .npz (for `replay`)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--replay", default=None, help="replay a recorded .npz instead of serving (`replay`)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.replay:
        for name in args.calibration.split(","):
            print(json.dumps(replay(args.replay, argparse.Namespace(**{**vars(args), "calibration": name})), default=float))
        return
    prompts = [p["prompt"] for p in stdlib_prompts()]
    for name in args.calibration.split(","):
        print(json.dumps(run(args, name == "on", prompts)), flush=True)


if __name__ == "__main__":
    main()
