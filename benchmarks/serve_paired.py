"""Running dscale-serve servers compared pass by pass (issue 25 acceptance 3): at each sampling point and
concurrency, every server runs one closed-loop pass of >= --pass-s seconds in turn, for --rounds rounds (each
round starts one server later), so neighbouring passes of different servers see the same machine. On the GPU
machine the served demo pair is host-bound and the host's speed drifts by 10-30% over tens of seconds
(docs/benchmarks.md, 2026-12-04): a whole sweep per server cannot resolve a few percent, adjacent passes can.

Per point and server: the median tokens/s over the rounds and, per round, the server's tokens/s over the best
server's of that round and over target-only's of that round (the paired ratios: their median and range).
Requests are dscale-bench's (`dscale_runtime.bench`: the same manifest, seeds, warmup and pass sizing).

With `--core-sets` and `--pids` (Linux), the servers also trade CPU cores between rounds: in round r server i (and
every thread of its process tree) runs on core set (i + r) mod the number of sets, so no server keeps the cores
that a sibling hyperthread, an interrupt or the bench client slows (use a multiple of the server count as
--rounds for an equal share).

    python benchmarks/serve_paired.py --servers target=http://127.0.0.1:8001,dscale=http://127.0.0.1:8002 \\
        --points "greedy:--temperature 0;t1:--temperature 1" --concurrency 1,8,32 --rounds 5 --pass-s 2 \\
        --out paired.json
(`benchmarks/serve_sweep_gpu.sh` with PAIRED=1 starts the servers and runs this.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dscale_runtime.bench import BenchConfig, Clients, closed_loop, manifest, read_counters, server_identity, \
    summarise  # noqa: E402

SAMPLING = {"--temperature": ("temperature", float), "--top-p": ("top_p", float), "--top-k": ("top_k", int)}


def parse_points(text: str) -> dict[str, dict]:
    """'name:--temperature 0.7 --top-p 0.8;...' -> {name: BenchConfig sampling fields}."""
    points = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        name, _, flags = entry.partition(":")
        words, fields = shlex.split(flags), {}
        if len(words) % 2:
            raise ValueError(f"point {name!r}: flags come in pairs, got {flags!r}")
        for flag, value in zip(words[::2], words[1::2]):
            if flag not in SAMPLING:
                raise ValueError(f"point {name!r}: unknown flag {flag} (known: {', '.join(SAMPLING)})")
            key, kind = SAMPLING[flag]
            fields[key] = kind(value)
        points[name] = fields
    if not points:
        raise ValueError("--points names no point")
    return points


def cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11} (the kernel's cpulist format, as taskset -c takes it)."""
    cpus = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or int(last or first) < int(first):
            raise ValueError(f"core set {text!r}: {part!r} is not a CPU number or an increasing range a-b")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"core set {text!r} names no CPU")
    return cpus


def process_tree(root: int) -> list[int]:
    """`root` and every process below it (by /proc/<pid>/stat's parent ids), root first."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # NOTE: gone since the listing
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def pin_tree(root: int, cpus: set[int]) -> int:
    """Every thread of `root`'s process tree onto `cpus`; returns how many threads were pinned."""
    pinned = 0
    for pid in process_tree(root):
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in threads:
            try:
                os.sched_setaffinity(tid, cpus)
                pinned += 1
            except (ProcessLookupError, PermissionError):  # NOTE: a thread that ended meanwhile
                continue
    return pinned


def steps_by_step(counters: dict[str, float]) -> dict[str, float]:
    """A server's decode steps so far by the step they ran (dflash, dscale, target), from its `read_counters`."""
    return {name.split('step="')[1].split('"')[0]: value for name, value in counters.items()
            if name.startswith("dscale_decode_steps_by_step_total{")}


def one_pass(config: BenchConfig, url: str, model: str, c: int, measured: list[dict], clients: Clients) -> dict:
    """One closed-loop pass: dscale-bench's summary, with the decode steps it ran by step (`steps`)."""
    before = read_counters(url)
    records, client_cpu = clients.run_pass(config, url, model, c, measured)
    after = read_counters(url)
    summary = summarise(records, before, after, client_cpu)
    steps = steps_by_step(before)
    summary["steps"] = {k: v - steps.get(k, 0.0) for k, v in steps_by_step(after).items()}
    return summary


def paired(servers: dict[str, str], points: dict[str, dict], levels: list[int], rounds: int, pass_s: float,
           num_requests: int, warmup: int, max_tokens: int, pids: dict[str, int] | None = None,
           core_sets: list[set[int]] | None = None, client_processes: int = 1, on_row=None) -> list[dict]:
    """With `pids` and `core_sets`, round r pins server i to core set (i + r) mod len(core_sets) first. The passes'
    closed loops run in `client_processes` processes (dscale-bench --client-processes). `on_row(rows)` runs after
    each point and concurrency (the rows so far), so a sweep stopped early keeps what it measured."""
    with Clients(client_processes) as clients:
        return _paired(servers, points, levels, rounds, pass_s, num_requests, warmup, max_tokens, pids, core_sets,
                       clients, on_row)


def _paired(servers, points, levels, rounds, pass_s, num_requests, warmup, max_tokens, pids, core_sets,
            clients: Clients, on_row=None) -> list[dict]:
    names = list(servers)
    if core_sets and (not pids or set(pids) != set(names) or len(core_sets) < len(names)):
        raise ValueError(f"core rotation needs a pid for every server ({', '.join(names)}) and at least "
                         f"{len(names)} core sets; got pids for {sorted(pids or {})} and {len(core_sets)} sets")
    models = {name: server_identity(url)[0] for name, url in servers.items()}
    rows = []
    for point, sampling in points.items():
        config = BenchConfig(url=next(iter(servers.values())), num_requests=num_requests, warmup=warmup,
                             min_duration_s=pass_s, max_tokens=max_tokens, **sampling)
        warm, measured = manifest(config)
        for c in levels:
            for name in names:
                asyncio.run(closed_loop(servers[name], models[name], warm, c, config.timeout))
            passes: dict[str, list[dict]] = {name: [] for name in names}
            cores: dict[str, list[list[int]]] = {name: [] for name in names}
            for r in range(rounds):
                for i, name in enumerate(names):
                    if core_sets:
                        cpus = core_sets[(i + r) % len(core_sets)]
                        pin_tree(pids[name], cpus)
                        cores[name].append(sorted(cpus))
                for name in names[r % len(names):] + names[: r % len(names)]:
                    passes[name].append(one_pass(config, servers[name], models[name], c, measured, clients))
            tok = {name: [p["output_throughput"] for p in passes[name]] for name in names}
            best_of_round = [max(tok[name][r] for name in names) for r in range(rounds)]
            row = {"point": point, **sampling, "concurrency": c, "servers": {}}
            for name in names:
                vs_best = [tok[name][r] / best_of_round[r] for r in range(rounds)]
                entry = {"tok_s": statistics.median(tok[name]), "tok_s_rounds": tok[name],
                         "vs_best": statistics.median(vs_best), "vs_best_range": [min(vs_best), max(vs_best)],
                         "acceptance_length": statistics.median(p["mean_acceptance_length"] for p in passes[name]),
                         "ttft_median": statistics.median(p["ttft_median"] for p in passes[name]),
                         "pass_s_min": min(p["duration"] for p in passes[name]),
                         "client_cpu_max": max(p["client_cpu"] for p in passes[name]),
                         "steps_by_step": {k: sum(p.get("steps", {}).get(k, 0.0) for p in passes[name])
                                           for k in sorted({k for p in passes[name] for k in p.get("steps", {})})}}
                if core_sets:
                    entry["cores_rounds"] = cores[name]
                if "target" in tok:
                    vs_target = [tok[name][r] / tok["target"][r] for r in range(rounds)]
                    entry.update(vs_target=statistics.median(vs_target),
                                 vs_target_range=[min(vs_target), max(vs_target)])
                row["servers"][name] = entry
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            print(f"[paired] {point} c={c}: " + "; ".join(
                f"{n} {e['tok_s']:.0f} tok/s, x best {e['vs_best']:.3f} [{e['vs_best_range'][0]:.3f}-"
                f"{e['vs_best_range'][1]:.3f}]" + (f", x target {e['vs_target']:.3f}" if "vs_target" in e else "")
                for n, e in row["servers"].items()), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    names = list(rows[0]["servers"])
    lines = ["| point | c | " + " | ".join(f"{n}: tok/s, x best (paired, range), x target" for n in names) + " |",
             "| --- | --- |" + " --- |" * len(names)]
    for row in rows:
        cells = []
        for n in names:
            e = row["servers"][n]
            cells.append(f"{e['tok_s']:,.0f}, {e['vs_best']:.3f} [{e['vs_best_range'][0]:.3f}-"
                         f"{e['vs_best_range'][1]:.3f}]" + (f", {e['vs_target']:.2f}" if "vs_target" in e else ""))
        lines.append(f"| {row['point']} | {row['concurrency']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", required=True, help="name=url,name=url,... (a server named 'target' is the "
                                                         "baseline of the 'x target' ratios)")
    parser.add_argument("--points", default="greedy:--temperature 0;t1:--temperature 1;"
                                            "t07p08:--temperature 0.7 --top-p 0.8")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pass-s", type=float, default=2.0, help="seconds each pass lasts at least")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--pids", default=None, help="name=pid,... the servers' process ids (with --core-sets)")
    parser.add_argument("--core-sets", default=None,
                        help="cpulists separated by ';' (e.g. '0-3;4-7;8-11'), one or more per server: the servers "
                             "rotate over them round by round")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="processes the closed loops run in (dscale-bench --client-processes)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    servers = dict(s.split("=", 1) for s in args.servers.split(",") if s)
    if not servers or args.rounds < 1 or args.client_processes < 1:
        parser.error("--servers needs name=url entries, --rounds >= 1 and --client-processes >= 1")
    pids = {k: int(v) for k, v in (p.split("=", 1) for p in args.pids.split(",") if p)} if args.pids else None
    core_sets = [cpu_list(c) for c in args.core_sets.split(";") if c.strip()] if args.core_sets else None
    if (pids is None) != (core_sets is None):
        parser.error("--pids and --core-sets go together")
    def save(rows: list[dict]) -> None:
        if args.out:
            Path(args.out).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))

    rows = paired(servers, parse_points(args.points), [int(c) for c in args.concurrency.split(",")], args.rounds,
                  args.pass_s, args.num_requests, args.warmup, args.max_tokens, pids, core_sets,
                  args.client_processes, on_row=save)
    print(table(rows))
    save(rows)
    return rows


if __name__ == "__main__":
    main()
