"""GPU check and timing of the sort-free top-k / top-p filters (issue 25 point 1), in one process.

For rows R in --rows x the Qwen3 vocabulary (151,936), bf16 logits (randn x 3, T = 0.7), and each filter
(top_p 0.8, top_k 50, both):
- checks: the Triton floors and the torch radix floors (on CUDA) keep exactly the sorting reference's set
  (`filters.filter_keep_ref`), `policy_probs` equals `policy_probs_ref` bit for bit, and a CUDA graph replay
  of the Triton floors equals the eager call on new logits;
- times, in ms per call (CUDA events, median of --repeats, after warm-up), eagerly and replayed from a CUDA
  graph of --calls back-to-back calls: `sort` (the policy as it was before: sort + softmax + cumsum + scatter,
  then the dense chunk sums), `sort_free` (`make_policy(filtered=True)`, Triton: floors + chunk sums),
  `floors_triton` / `floors_torch` (the floors alone), `unfiltered` (`make_policy(filtered=False)`).
Writes a JSON of every point to the path argument and prints a table. Needs CUDA and triton.

    python benchmarks/sampling_filters_gpu.py OUT.json [--rows 32 128 256 512]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from dscale_runtime.graphs import cuda_times
from dscale_runtime.kernels.filters import filter_floor, filter_keep_ref, scaled_logits
from dscale_runtime.sampling import Policy, SamplingRows, make_policy, policy_probs, policy_probs_ref

VOCAB = 151936
FILTERS = {"top_p 0.8": (-1, 0.8), "top_k 50": (50, 1.0), "top_k 50 + top_p 0.8": (50, 0.8)}


def sorting_policy(logits: torch.Tensor, rows: SamplingRows) -> Policy:
    """The filtered policy as `make_policy` built it before issue 25: a full sort of every row (the baseline)."""
    logits = logits.float() / rows.temperature.clamp_min(1e-6)[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    top_k = torch.where(rows.top_k > 0, rows.top_k, logits.shape[-1])
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= rows.top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return Policy.dense(torch.zeros_like(logits).scatter_(-1, order, torch.softmax(sorted_logits, dim=-1)))


def make_rows(n: int, top_k: int, top_p: float, device: str) -> SamplingRows:
    full = lambda v, dtype: torch.full((n,), v, dtype=dtype, device=device)  # noqa: E731
    return SamplingRows(full(False, torch.bool), full(0.7, torch.float32), full(top_k, torch.long),
                        full(top_p, torch.float32), full(0, torch.long), full(0, torch.long), backend="triton")


def floors(logits: torch.Tensor, rows: SamplingRows, backend: str) -> torch.Tensor:
    shift = logits.float().amax(-1)
    return filter_floor(logits, shift, 1.0 / rows.temperature.clamp_min(1e-6), rows.top_k, rows.top_p, backend)


def kept(logits: torch.Tensor, rows: SamplingRows, floor: torch.Tensor) -> torch.Tensor:
    return scaled_logits(logits, logits.float().amax(-1), 1.0 / rows.temperature.clamp_min(1e-6)) >= floor[:, None]


def check(logits: torch.Tensor, rows: SamplingRows, other: torch.Tensor) -> dict:
    s = scaled_logits(logits, logits.float().amax(-1), 1.0 / rows.temperature.clamp_min(1e-6))
    want = filter_keep_ref(s, rows.top_k, rows.top_p)
    out = {f"kept_equal_{b}": bool(torch.equal(kept(logits, rows, floors(logits, rows, b)), want))
           for b in ("triton", "ref")}
    got, ref = policy_probs(logits, rows, True, backend="triton"), policy_probs_ref(logits, rows, True)
    out["probs_equal"] = bool(torch.equal(got, ref))
    out["max_abs_prob_diff"] = float((got - ref).abs().max())
    out["kept_tokens_mean"] = float(want.sum(-1).float().mean())
    static = logits.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = floors(static, rows, "triton")
    static.copy_(other)
    graph.replay()
    out["graph_equal"] = bool(torch.equal(captured, floors(other, rows, "triton")))
    return out


def time_ms(fn, calls: int, repeats: int) -> dict:
    """ms per call, eager (calls back to back) and replayed from one CUDA graph of `calls` calls."""
    for _ in range(3):
        fn()  # warm-up and compilation outside any capture
    torch.cuda.synchronize()

    def median(run) -> float:
        return statistics.median(cuda_times(run, repeats)) / calls

    def eager():
        for _ in range(calls):
            fn()

    eager_ms = median(eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    graph_ms = median(graph.replay)
    del graph
    return {"eager_ms": round(eager_ms, 4), "graph_ms": round(graph_ms, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="JSON file to write")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128, 256, 512])
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--calls", type=int, default=10, help="calls per timed sample (and per graph)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "sampling_filters_gpu.py needs a CUDA device"
    gen = torch.Generator(device="cuda").manual_seed(0)
    points = []
    for n in args.rows:
        logits = (torch.randn(n, args.vocab, generator=gen, device="cuda") * 3).to(torch.bfloat16)
        other = (torch.randn(n, args.vocab, generator=gen, device="cuda") * 3).to(torch.bfloat16)
        for name, (top_k, top_p) in FILTERS.items():
            rows = make_rows(n, top_k, top_p, "cuda")
            point = {"rows": n, "vocab": args.vocab, "filter": name, **check(logits, rows, other)}
            paths = {
                "sort": lambda: sorting_policy(logits, rows),
                "sort_free": lambda: make_policy(logits, rows, True),
                "floors_triton": lambda: floors(logits, rows, "triton"),
                "floors_torch": lambda: floors(logits, rows, "ref"),
                "unfiltered": lambda: make_policy(logits, rows, False),
            }
            for path, fn in paths.items():
                point[path] = time_ms(fn, args.calls, args.repeats)
            points.append(point)
            print(f"R={n:4d} {name:22s} kept {point['kept_tokens_mean']:8.1f}  exact "
                  f"{point['kept_equal_triton'] and point['kept_equal_ref'] and point['probs_equal']} graph "
                  f"{point['graph_equal']}  ms eager/graph: " + "  ".join(
                      f"{p} {point[p]['eager_ms']:.3f}/{point[p]['graph_ms']:.3f}" for p in paths), flush=True)
            torch.cuda.empty_cache()
    import triton

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "temperature": 0.7, "logits": "bf16 randn x 3", "points": points,
              "all_exact": all(p["kept_equal_triton"] and p["kept_equal_ref"] and p["probs_equal"] and p["graph_equal"]
                               for p in points)}
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    print(f"all exact: {report['all_exact']}; wrote {args.output}")


if __name__ == "__main__":
    main()
