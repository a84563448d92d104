"""One table over a benchmarks/serve_sweep_gpu.sh run: output tokens/s of every server configuration at every
sampling point and concurrency (the median over the sweep's rounds, their range in brackets), each relative to the best configuration there and to target-only, with the
TTFT p99 / median, the pass duration and the busiest client's CPU (`client_cpu`, cores: near 1 the client may have
limited the point) of each point; the decode steps by mode each server ran (/metrics).
Usage: python benchmarks/serve_sweep_summary.py OUT_DIR  (writes OUT_DIR/summary.json)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def steps_by_mode(metrics: Path) -> dict[str, float]:
    if not metrics.is_file():
        return {}
    pattern = re.compile(r'^dscale_decode_steps_by_step_total\{[^}]*step="(\w+)"\} ([0-9.e+]+)$')
    return {m.group(1): float(m.group(2)) for m in map(pattern.match, metrics.read_text().splitlines()) if m}


def merged(runs: list[dict]) -> dict:
    """One configuration's figures at one point over its rounds: the median throughput with every round's, the
    worst TTFT ratio, the shortest pass, the busiest client (nan where a bench.json predates `client_cpu`)."""
    tok_s = sorted(r["tok_s"] for r in runs)
    mid = len(tok_s) // 2
    median = tok_s[mid] if len(tok_s) % 2 else (tok_s[mid - 1] + tok_s[mid]) / 2
    return {"tok_s": median, "tok_s_rounds": [r["tok_s"] for r in runs],
            "ttft_p99_over_median": max(r["ttft_p99_over_median"] for r in runs),
            "duration_s": min(r["duration_s"] for r in runs), "requests": sum(r["requests"] for r in runs),
            "client_cpu": max(r["client_cpu"] for r in runs),
            "accept_len": runs[0]["accept_len"] if len(runs) == 1 else None if any(
                r["accept_len"] is None for r in runs) else sum(r["accept_len"] for r in runs) / len(runs)}


def main(out: Path) -> dict:
    rounds = {}  # (point, concurrency) -> config -> [figures of each round]
    steps = {}
    for config in sorted(p for p in out.iterdir() if p.is_dir()):
        steps[config.name] = steps_by_mode(config / "metrics.txt")
        for bench in sorted(config.glob("*/bench.json")):
            name = bench.parent.name.split(".r")[0]  # <point>.r<round> when the sweep ran several rounds
            for point in json.loads(bench.read_text())["points"]:
                figures = {"tok_s": point["median"]["output_throughput"],
                           "ttft_p99_over_median": point["pooled"]["ttft_p99_over_median"],
                           "duration_s": point["median"]["duration"], "requests": point["median"]["requests"],
                           "accept_len": point["median"]["mean_acceptance_length"],
                           "client_cpu": point["median"].get("client_cpu", float("nan"))}
                rounds.setdefault((name, point["concurrency"]), {}).setdefault(config.name, []).append(figures)
    rows = {key: {c: merged(runs) for c, runs in row.items()} for key, row in rounds.items()}
    configs = sorted({c for row in rows.values() for c in row})
    print("| point | c | " + " | ".join(f"{c} tok/s (x best, x target; TTFT p99/p50)" for c in configs)
          + " | TTFT p99/p50 (max) | pass s (min) | client CPU (max) |")
    print("| --- | --- | " + " | ".join("---" for _ in configs) + " | --- | --- | --- |")
    for (point, c), row in sorted(rows.items()):
        best = max(f["tok_s"] for f in row.values())
        target = row.get("target", {}).get("tok_s")
        cells = []
        for name in configs:
            f = row.get(name)
            if f is None:
                cells.append("-")
                continue
            ratios = f"{f['tok_s'] / best:.2f}, {f['tok_s'] / target:.2f}" if target else f"{f['tok_s'] / best:.2f}"
            spread = (f" [{min(f['tok_s_rounds']):.0f}-{max(f['tok_s_rounds']):.0f}]"
                      if len(f["tok_s_rounds"]) > 1 else "")
            cells.append(f"{f['tok_s']:.0f}{spread} ({ratios}; TTFT p99/p50 {f['ttft_p99_over_median']:.1f})")
        worst_ttft = max(f["ttft_p99_over_median"] for f in row.values())
        shortest = min(f["duration_s"] for f in row.values())
        busiest = max(f["client_cpu"] for f in row.values())
        print(f"| {point} | {c} | " + " | ".join(cells) + f" | {worst_ttft:.2f} | {shortest:.1f} | {busiest:.2f} |")
    print("\ndecode steps by mode per server:", json.dumps(steps))
    summary = {"points": {f"{p}/c{c}": row for (p, c), row in sorted(rows.items())}, "steps_by_mode": steps}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main(Path(sys.argv[1]))
