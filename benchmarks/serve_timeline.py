"""Where a served benchmark's slow first tokens went: reads a timeline folder (`benchmarks/serve_timeline/`, recorded
with DSCALE_TIMELINE during `dscale-bench --launch`) beside that run's bench_requests.csv.

For every process: its collector's pauses while the clients were timing requests and, for a server's processes,
while it served (count, total, the longest; a client's own collections before and after each pass included). For
every engine: its steps' wall times (median, p99, longest) and its stretches (runs of steps over twice the median
step, 20 ms of steps or more). For every pass, the requests whose TTFT is over 3x the pass's median (issue 24
acceptance 4's bound), each split along its path: client start -> HTTP arrival (the handler's `arrival`) ->
admission by the engine thread -> first token at the client; with the engine steps inside that window (count, summed
wall, longest) and any collector pause of any process that overlaps it. Client records and the CSV's rows are the
same requests (TTFT equal to the nanosecond).

    python benchmarks/serve_timeline.py TIMELINE_DIR BENCH_DIR [--top 12] [--out report.json]
"""

from __future__ import annotations

import argparse
import bisect
import csv
import glob
import json
import math
import os
import statistics
from collections import defaultdict


def load(folder: str) -> list[dict]:
    procs = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            d = json.load(f)
        d["role"] = ("engine" if d["step"] else "http" if d["events"] or d["submit"] else
                     "client" if d["client"] else "other")
        procs.append(d)
    return procs


def stretches(steps: list, factor: float = 2.0, min_ms: float = 20.0) -> list[tuple[float, float, int]]:
    """(start, seconds, steps) of each run of consecutive steps whose wall is over factor x the median step, counted
    by the steps' own summed wall (not the run's span: an idle engine waits between steps) when it reaches min_ms."""
    if not steps:
        return []
    median = statistics.median(s[1] for s in steps)
    out, run = [], []
    for s in [*steps, (math.inf, 0.0, 0)]:  # NOTE: the sentinel ends a run that lasts to the last step
        if s[1] > factor * median:
            run.append(s)
            continue
        wall = sum(r[1] for r in run)
        if run and wall * 1e3 >= min_ms:
            out.append((run[0][0], wall, len(run)))
        run = []
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline")
    parser.add_argument("bench")
    parser.add_argument("--top", type=int, default=12, help="slow requests listed per pass")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    procs = load(args.timeline)
    report: dict = {"processes": [], "passes": []}
    pauses = []  # (start, seconds, role, pid)
    timed = [c for p in procs for c in p["client"]]
    window = (min(c[0] for c in timed), max(c[2] for c in timed)) if timed else (0.0, 0.0)
    for p in procs:
        own = [t[0] for key in ("step", "submit", "admit") for t in p[key]]  # a server's span: its own activity
        lo, hi = (max(window[0], min(own)), min(window[1], max(own))) if own else window
        gcs = [g for g in p["gc"] if lo <= g[0] <= hi]  # NOTE: while clients were timing requests
        full = [g for g in gcs if g[2] == 2]
        entry = {"pid": p["pid"], "role": p["role"], "collections_logged": len(gcs), "full": len(full),
                 "pause_total_ms": 1e3 * sum(g[1] for g in gcs),
                 "pause_max_ms": 1e3 * max((g[1] for g in gcs), default=0)}
        if p["step"]:
            walls = sorted(s[1] for s in p["step"])
            entry.update(steps=len(walls), step_median_ms=1e3 * statistics.median(walls),
                         step_p99_ms=1e3 * walls[int(0.99 * (len(walls) - 1))], step_max_ms=1e3 * walls[-1],
                         stretches=[(round(1e3 * d, 1), n) for _, d, n in stretches(p["step"])])
        if p.get("types"):  # DSCALE_TIMELINE_TYPES: the oldest generation's population at each full collection
            window_types = [t for t in p["types"] if window[0] <= t[0] <= window[1]] or p["types"]
            entry["oldest_generation"] = [(round(t - window[0], 2), total, top[:5]) for t, total, top in window_types]
            first, last = window_types[0], window_types[-1]
            grown = {k: v - dict(first[2]).get(k, 0) for k, v in last[2]}
            print(f"  pid {p['pid']}: oldest generation {first[1]} -> {last[1]} objects over its full collections; "
                  f"grown most: {sorted(grown.items(), key=lambda kv: -kv[1])[:6]}")
        report["processes"].append(entry)
        pauses += [(g[0], g[1], p["role"], p["pid"]) for g in gcs if g[1] >= 0.002]
        print(f"pid {p['pid']} {p['role']:6s}: {len(gcs)} collections logged ({len(full)} full), pauses "
              f"{entry['pause_total_ms']:.0f} ms in all, longest {entry['pause_max_ms']:.1f} ms"
              + (f"; {entry['steps']} steps, median {entry['step_median_ms']:.2f} ms, p99 {entry['step_p99_ms']:.2f}, "
                 f"longest {entry['step_max_ms']:.1f}; {len(entry['stretches'])} stretches over 2x for >= 20 ms "
                 f"{entry['stretches'][:8]}" if p["step"] else ""))
    pauses.sort()
    engines = [p for p in procs if p["step"]]
    admits = sorted(a for p in procs for a in p["admit"] if a[1] is not None)  # (admitted at, arrival)
    arrivals = sorted((a[1], a[0]) for a in admits)
    clients = {round(c[1] - c[0], 9): c for p in procs for c in p["client"]}
    requests_csv = os.path.join(args.bench, "bench_requests.csv")
    if not os.path.isfile(requests_csv):
        raise SystemExit(f"{requests_csv}: no such file (BENCH_DIR is dscale-bench's --output folder)")
    rows = list(csv.DictReader(open(requests_csv)))
    by_pass = defaultdict(list)
    for r in rows:
        by_pass[(r["mode"], int(r["concurrency"]), int(r["pass"]))].append(r)
    for key, rs in by_pass.items():
        ttfts = [float(r["ttft"]) for r in rs]
        median = statistics.median(ttfts)
        slow = sorted((r for r in rs if float(r["ttft"]) > 3 * median), key=lambda r: -float(r["ttft"]))
        entry = {"mode": key[0], "concurrency": key[1], "pass": key[2], "requests": len(rs),
                 "ttft_median_ms": 1e3 * median, "over_3x": len(slow), "one_percent": len(rs) / 100, "slow": []}
        for r in slow[: args.top]:
            c = clients.get(round(float(r["ttft"]), 9))
            if c is None:
                continue
            start, first = c[0], c[1]
            i = bisect.bisect_left(arrivals, (start,))
            arrival, admitted = arrivals[i] if i < len(arrivals) else (float("nan"), float("nan"))
            inside = [s for e in engines for s in e["step"] if s[0] < first and s[0] + s[1] > start]
            gcs = [(round(1e3 * d, 1), role) for t, d, role, _ in pauses if t < first and t + d > start]
            entry["slow"].append({
                "start_ms": round(1e3 * float(r["start"]), 1), "ttft_ms": round(1e3 * float(r["ttft"]), 1),
                "to_arrival_ms": round(1e3 * (arrival - start), 2),
                "to_admission_ms": round(1e3 * (admitted - arrival), 2),
                "steps": len(inside), "steps_wall_ms": round(1e3 * sum(s[1] for s in inside), 1),
                "longest_step_ms": round(1e3 * max((s[1] for s in inside), default=0), 1),
                "live": max((s[2] for s in inside), default=0), "gc": gcs})
        report["passes"].append(entry)
        print(f"\n{key[0]} c={key[1]} pass {key[2]}: {len(rs)} requests, TTFT median {1e3 * median:.1f} ms, "
              f"{len(slow)} over 3x (1% = {len(rs) / 100:.0f})")
        for s in entry["slow"]:
            print(f"  at {s['start_ms']:8.1f} ms TTFT {s['ttft_ms']:6.1f}: arrival +{s['to_arrival_ms']:.2f}, "
                  f"admitted +{s['to_admission_ms']:.2f}; {s['steps']} steps {s['steps_wall_ms']} ms (longest "
                  f"{s['longest_step_ms']}, live {s['live']}); gc {s['gc']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
