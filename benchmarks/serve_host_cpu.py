"""The host work of a real `dscale-serve` on any machine: its engine's steps replayed from a cache (issues 24, 25).

The server is the real one (uvicorn, the app, the engine thread or process, the real `Engine` with its scheduler,
prefix cache, runner buffers, commits and stop checks, the detokenizer), on the demo pair. Only the device work is
taken out: each bucket's decode step runs for real once and then returns that first result again (the accepted counts
set to a fixed pattern per bucket, so requests go on for all their tokens), and every prefill returns fixed first
tokens without a forward. What is left is what a GPU server's host pays per token, where its steps take a fraction
of a millisecond: a served demo pair on the H200 is host-bound (docs/benchmarks.md).

The client is `dscale-bench --url` in its own process. Per pass it records tokens/s and the CPU seconds of every
thread of the server's process tree, read from /proc, so the CPU cost per output token and its split between
threads (event loop, engine thread, prompt pool; engine process) are exact, not sampled. With several `--trees`
(checkouts of this repository, e.g. a `git worktree` of the commit before a change) or several `--flags` (server
flags, one string per server) each round starts one server per entry in turn, so that they are compared side by
side, round by round (this machine's speed drifts).

    python benchmarks/serve_host_cpu.py --trees /tmp/base . --rounds 4 --concurrency 8 32 --out runs/host
    python benchmarks/serve_host_cpu.py --flags "" "--engine-process true" --server-cores 0-3 --client-cores 4-7
    python benchmarks/serve_host_cpu.py --mode dscale --gpu-choice --flags "" "--target-fallback true"

Linux only (/proc, sched_setaffinity): the server runs on `--server-cores`, the client on `--client-cores`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHED = "DSCALE_CACHED_STEPS"
"""Set in the server's environment: this module, imported there (`--serve`, or as the engine process's main module
under spawn), replaces the device steps with their cache."""
DEVICE_MS = {"target": 0.26, "speculative": 0.40}
"""The device ms per step `--gpu-choice` gives a step (an H100's replays at bucket 1 on the demo pair, 2026-12-06)."""
REAL_MS = [0.0]
"""Milliseconds of cached steps' real runs not yet charged to a cycle's device waits (`emulate_gpu_choice`)."""
CHOICE = "DSCALE_CACHED_CHOICE"
"""Set in the server's environment by `--gpu-choice`: the engine keeps the live choice's state as a CUDA engine does
(`emulate_gpu_choice`)."""


def cache_device_steps() -> None:
    """Each bucket's decode step (per kind) runs once for real, then its first result is returned again, with
    accepted counts fixed per bucket (0..6 by row, seeded by the bucket size); a prefill returns token 100 for every
    request without a forward."""
    import torch

    from dscale_runtime import prefill, runner

    results: dict = {}
    real_step = runner.BucketStep.__call__

    def cached_step(self):
        key = (self.buf.size, self.kind)
        if key not in results:
            self.buf.ctx_bound = None  # NOTE: prefills that never ran left the device state behind the host's bound
            start = time.perf_counter()
            out = real_step(self).clone()
            REAL_MS[0] += (time.perf_counter() - start) * 1e3
            if self.kind.mode != "target":
                generator = torch.Generator().manual_seed(self.buf.size)
                out[:, 0] = torch.randint(0, 7, (out.shape[0],), generator=generator)
            results[key] = out
        return results[key]

    firsts: dict[int, torch.Tensor] = {}

    def cached_prefill(self):
        n = self.buf.requests
        if n not in firsts:
            firsts[n] = torch.full((n,), 100, dtype=torch.int64)
        return firsts[n]

    runner.BucketStep.__call__ = cached_step
    prefill.PrefillStep.__call__ = cached_prefill
    if os.environ.get(CHOICE):
        emulate_gpu_choice()


def emulate_gpu_choice() -> None:
    """Give every engine the live state of a captured CUDA engine, which a CPU engine lacks: its cycles feed
    `host_ms` / `wall_ms` (a cached step's one real run left out), its committed steps `live_step_ms`, its buckets have
    start-up step times, each step reports DEVICE_MS as its device time, and `--target-fallback true` turns the
    fallback on (a CPU runner keeps it off without graphs)."""
    from dscale_runtime.engine import Engine
    from dscale_runtime.runner import StepRunner

    built, launch, cycle = Engine.__init__, StepRunner.launch, Engine._time_cycle

    def time_cycle(self) -> None:
        if self._cycle is not None:  # NOTE: a cached step's one real run is none of the cycle's time on a GPU
            self._cycle[0] += REAL_MS[0] / 1e3
        REAL_MS[0] = 0.0
        cycle(self)

    def timed_launch(self, *args, **kwargs):
        pending = launch(self, *args, **kwargs)
        pending.started = DEVICE_MS["target" if pending.kind.mode == "target" else "speculative"]  # NOTE: its device ms
        return pending

    def init(self, *args, **kwargs) -> None:
        built(self, *args, **kwargs)
        runner = self.runner
        self.time_live_steps = self.time_host = True
        runner.target_fallback = self.config.target_fallback and self.config.mode != "target"
        modes = {runner.mode_for(b) for b in runner.buckets} | ({"target"} if runner.target_fallback else set())
        runner.policy_ms = {b: {m: DEVICE_MS["target" if m == "target" else "speculative"] for m in modes}
                            for b in runner.buckets}

    Engine.__init__ = init
    Engine._time_cycle = time_cycle
    StepRunner.launch = timed_launch


if os.environ.get(CACHED):
    sys.path.insert(0, os.environ.get("DSCALE_TREE", str(ROOT)))
    cache_device_steps()


def serve(argv: list[str]) -> None:
    from dscale_runtime.server.main import main

    main(argv)


def thread_cpu(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of every thread of `root`'s process tree, by 'pid:tid'."""
    from serve_paired import process_tree  # NOTE: not at import: a --serve process imports this module too

    tick, seconds = os.sysconf("SC_CLK_TCK"), {}
    for pid in process_tree(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            seconds[f"{pid}:{tid}"] = (int(fields[11]) + int(fields[12])) / tick
    return seconds


def thread_names(root: int, keys) -> dict[str, str]:
    """'pid:tid' -> a readable name: the process's role (http, engine) and the thread's (main, or its number)."""
    names = {}
    for key in keys:
        pid, tid = key.split(":")
        role = "http" if int(pid) == root else "engine-process"
        names[key] = f"{role}:{'main' if pid == tid else tid}"
    return names


def bench_pass(url: str, concurrency: int, duration: float, warmup: int, out: Path, cores: str) -> dict:
    """One `dscale-bench --url` pass (its own process on `cores`); returns the point's medians."""
    command = [sys.executable, "-c", "from dscale_runtime.bench import main; main()", "--url", url,
               "--concurrency", str(concurrency), "--num-requests", "64", "--warmup", str(warmup),
               "--repetitions", "1", "--min-duration-s", str(duration), "--max-tokens", "64", "--output", str(out)]
    subprocess.run(["taskset", "-c", cores, *command], check=True, capture_output=True, cwd=ROOT)
    report = json.loads((out / "bench.json").read_text())
    return report["points"][0]["median"]


def run_server(tree: Path, flags: str, port: int, args, out: Path) -> list[dict]:
    """Start one cached-step server of `tree` with `flags`, warm every bucket, then one measured pass per
    concurrency."""
    from serve_paired import steps_by_step  # NOTE: not at import: a --serve process imports this module too
    from dscale_runtime.bench import read_counters
    env = {**os.environ, CACHED: "1", "DSCALE_TREE": str(tree), "PYTHONPATH": str(tree)}
    if args.gpu_choice:
        env[CHOICE] = "1"
    log = (out / "server.log").open("w")
    command = ["taskset", "-c", args.server_cores, sys.executable, str(Path(__file__).resolve()), "--serve",
               "--mode", args.mode, "--port", str(port), "--max-model-len", "1024",
               "--max-running-requests", str(max(args.concurrency)), "--dtype", "float32", *flags.split()]
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tree)
    url, rows = f"http://127.0.0.1:{port}", []
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server of {tree} exited; see {out / 'server.log'}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server of {tree} did not come up in 300 s")
            time.sleep(0.5)
        for c in sorted(set(args.concurrency), reverse=True):  # NOTE: every bucket's real first run before timing
            bench_pass(url, c, 1.0, 64, out / f"warm{c}", args.client_cores)
        for c in args.concurrency:
            before = thread_cpu(server.pid)
            point = bench_pass(url, c, args.duration, 16, out / f"c{c}", args.client_cores)
            after = thread_cpu(server.pid)
            used = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0.005}
            names = thread_names(server.pid, used)
            tokens = point["completion_tokens"]
            rows.append({"concurrency": c, "tok_s": tokens / point["duration"], "duration": point["duration"],
                         "steps_by_step": steps_by_step(read_counters(url)),
                         "requests": point["requests"], "cpu_s": sum(used.values()),
                         "cpu_us_per_token": 1e6 * sum(used.values()) / tokens,
                         "threads_us_per_token": {names[k]: round(1e6 * v / tokens, 2) for k, v in
                                                  sorted(used.items(), key=lambda kv: -kv[1])}})
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", default=[str(ROOT)], help="checkouts to compare (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds each measured pass lasts at least")
    parser.add_argument("--mode", default="dflash", choices=["target", "dflash", "dscale"])
    parser.add_argument("--flags", nargs="+", default=[""],
                        help="dscale-serve flags per server (one string each, e.g. '--engine-process true'); with one "
                             "string per tree, or one for all")
    parser.add_argument("--gpu-choice", action="store_true",
                        help="the engines keep the live choice's state as on a GPU (start-up step times, live device "
                             "and host costs; `--target-fallback true` in --flags turns the fallback on)")
    parser.add_argument("--server-cores", default="0")
    parser.add_argument("--client-cores", default="1")
    parser.add_argument("--port", type=int, default=8470)
    parser.add_argument("--out", type=Path, default=Path("runs/serve_host_cpu"))
    args = parser.parse_args()
    trees, flags = [Path(t).resolve() for t in args.trees], args.flags
    for tree in trees:
        if not (tree / "dscale_runtime").is_dir():
            parser.error(f"--trees: {tree} is not a checkout of this repository (no dscale_runtime/)")
    if len(trees) == 1:
        trees = trees * len(flags)
    if len(flags) == 1:
        flags = flags * len(trees)
    if len(flags) != len(trees):
        parser.error(f"--flags: {len(flags)} strings for {len(trees)} trees (give one, or one per tree)")
    servers = [f"{tree}{' ' + f if f else ''}" for tree, f in zip(trees, flags)]
    if len(set(servers)) < len(servers):
        parser.error("two servers have the same tree and flags")
    results = {s: {c: [] for c in args.concurrency} for s in servers}
    for r in range(args.rounds):
        shift = r % len(servers)  # NOTE: each round starts one server later
        for i, k in enumerate(list(range(len(servers)))[shift:] + list(range(len(servers)))[:shift]):
            out = args.out / f"r{r}" / f"s{k}"
            out.mkdir(parents=True, exist_ok=True)
            for row in run_server(trees[k], flags[k], args.port + i, args, out):
                results[servers[k]][row["concurrency"]].append(row)
                print(f"round {r} {servers[k]} c={row['concurrency']}: {row['tok_s']:,.0f} tok/s, "
                      f"{row['cpu_us_per_token']:.1f} CPU us per token {row['threads_us_per_token']}, decode steps "
                      f"so far {row['steps_by_step']}", flush=True)
    summary = []
    for c in args.concurrency:
        first = results[servers[0]][c]
        for server in servers:
            rows = results[server][c]
            ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(first, rows)]
            summary.append({"server": server, "concurrency": c,
                            "tok_s_rounds": [round(x["tok_s"]) for x in rows],
                            "tok_s_median": statistics.median(x["tok_s"] for x in rows),
                            "cpu_us_per_token_median": statistics.median(x["cpu_us_per_token"] for x in rows),
                            "vs_first_rounds": [round(x, 3) for x in ratios],
                            "vs_first_median": statistics.median(ratios)})
    print("\n| server | c | tok/s by round | median | CPU us / token | x the first server, by round (median) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for s in summary:
        print(f"| {s['server']} | {s['concurrency']} | {', '.join(f'{x:,}' for x in s['tok_s_rounds'])} | "
              f"{s['tok_s_median']:,.0f} | {s['cpu_us_per_token_median']:.1f} | "
              f"{', '.join(map(str, s['vs_first_rounds']))} ({s['vs_first_median']:.3f}) |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_host_cpu.json").write_text(json.dumps(
        {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
         "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "summary": summary,
         "rounds": {t: {str(c): rows for c, rows in by_c.items()} for t, by_c in results.items()}}, indent=1))
    print(f"wrote {args.out / 'serve_host_cpu.json'}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2:])
    else:
        sys.path.insert(0, str(ROOT))
        main()
