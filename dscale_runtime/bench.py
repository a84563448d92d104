"""`dscale-bench`: closed-loop HTTP benchmark of dscale-serve, the paper's protocol (IV-A).

c workers each send their next request as soon as the last one finished. For every mode and concurrency:
warmup requests, then `repetitions` passes over the same fixed manifest of measured requests (demo prompts,
fixed max_tokens; greedy unless --temperature > 0, request i seeded with --sampling-seed + i). A pass is sized
to last long enough to measure: after the manifest's --num-requests the workers keep going (the seeded draw
from the prompt set continued, cycling through it) until the pass has lasted --min-duration-s, never past
--max-requests. Each pass gives its duration, requests completed, output-token and request throughput, TTFT /
TPOT / E2E mean, median, p90, p95 (E2E, TTFT), p99 and the mean acceptance length (from the server's /metrics
counters over the pass); each point gives the medians over its passes, their spread (min / median / max over
the passes) and the percentiles over all its passes' requests pooled (with TTFT p99 / median). `--launch`
starts one dscale-serve per mode and stops it after its sweep; without it the benchmark measures the server at
`--url`. Writes bench.json, bench.csv, bench_requests.csv (one row per measured request) and bench.png to
`--output`.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import random
import shlex
import socket
import ssl
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import aiohttp
import certifi
import httpx
import numpy as np

from dscale_runtime.config import MODES
from dscale_runtime.server.flags import parse_config

LATENCIES = ("ttft", "tpot", "e2e")
PERCENTILES = {"median": 50, "p90": 90, "p99": 99}  # of every latency over requests, e.g. ttft_median, e2e_p99
LATENCY_FIGURES = tuple(f"{name}_{q}" for name in LATENCIES for q in PERCENTILES) + ("ttft_p99_over_median",)
# Per pass (their medians per point: the "median" of a point, the CSV's columns after the sampling settings);
# the first ten are the original report's, the rest were added after them (issue 24: sizing and spread).
METRICS = ("output_throughput", "e2e_mean", "e2e_p95", "e2e_p99", "ttft_mean", "ttft_p95", "tpot_mean",
           "mean_acceptance_length", "completion_tokens", "duration",
           "requests", "request_throughput", *(k for k in LATENCY_FIGURES if k != "e2e_p99"), "client_cpu")
CLIENT_BUSY = 0.8
"""A pass whose closed loop kept a client thread busier than this share of a core may have been limited by the
client (one asyncio thread per client process): the pass line says so (then raise --client-processes, or run the
client on a quieter machine)."""
SAMPLING = ("temperature", "top_p", "top_k", "sampling_seed")
SIZING = ("min_duration_s", "max_requests")
# Min / median / max over a point's passes ("spread"; CSV columns NAME_min and NAME_max after the medians).
SPREAD = ("output_throughput", "request_throughput", "duration", "requests", "ttft_median", "ttft_p99",
          "ttft_p99_over_median", "tpot_median", "e2e_median", "e2e_p99")
# Over all the requests of a point's passes together ("pooled"; CSV columns pooled_NAME).
POOLED = ("requests", *LATENCY_FIGURES)
REQUEST_COLUMNS = ("mode", "concurrency", "pass", "index", "id", "seed", "start", "ttft", "tpot", "e2e",
                   "completion_tokens")


@dataclass(frozen=True)
class BenchConfig:
    """The sweep: where the server is (or which to launch), the manifest, the points, the outputs."""

    url: str | None = None
    """A running dscale-serve (e.g. http://127.0.0.1:8000); its mode is read from /v1/models. Not with --launch."""
    launch: bool = False
    """Start one dscale-serve per mode in --modes (with the server flags below) and stop it after its sweep."""
    modes: str = "dflash,dscale"
    """Modes to sweep with --launch, comma-separated (target, dflash, dscale)."""
    concurrency: str = "1,4,8,16"
    """Closed-loop client counts, comma-separated."""
    num_requests: int = 32
    """Measured requests per pass (the manifest)."""
    warmup: int = 4
    """Requests sent at each point before measuring (not counted)."""
    repetitions: int = 3
    """Passes over the manifest per point; the report gives each pass, the medians and their spread."""
    min_duration_s: float = 5.0
    """Seconds each measured pass lasts at least: past --num-requests the clients keep sending (the draw from the
    prompt set continued) until this much time has passed since the pass's first request, up to --max-requests.
    0 = exactly --num-requests per pass."""
    max_requests: int | None = None
    """Most requests one pass sends, the duration target notwithstanding (default: 100 x --num-requests)."""
    max_tokens: int = 64
    """max_tokens of every request."""
    temperature: float = 0.0
    """temperature of every request (0 = greedy, the paper's protocol)."""
    top_p: float = 1.0
    """top_p of every request, in (0, 1] (1 = off)."""
    top_k: int = -1
    """top_k of every request (-1 = off, else >= 1)."""
    sampling_seed: int = 0
    """Base of the per-request sampling seeds: request i of the manifest sends seed = sampling_seed + i."""
    prompts: str = "stdlib"
    """Prompt set: 'stdlib' (held-out demo prompts), 'humaneval', 'demo' (both) or a JSONL file with 'prompt'."""
    seed: int = 0
    """Seed of the manifest's draw from the prompt set (the sampling seeds are --sampling-seed)."""
    output: str = "runs/bench"
    """Folder for bench.json, bench.csv, bench.png and the launched servers' logs."""
    plot: str | None = None
    """Where to write the PNG instead of OUTPUT/bench.png (e.g. docs/img/bench_cpu_demo.png)."""
    target: str | None = None
    """--launch: dscale-serve --target (default: the demo pair)."""
    drafter: str | None = None
    """--launch: dscale-serve --drafter (default: the demo pair)."""
    predictor: str | None = None
    """--launch: dscale-serve --predictor (default: artifacts/demo.pt)."""
    max_running_requests: int | None = None
    """--launch: dscale-serve --max-running-requests (default: the largest concurrency)."""
    budget_ratio: float = 0.5
    """--launch: dscale-serve --budget-ratio."""
    device: str = "cpu"
    """--launch: dscale-serve --device."""
    serve_args: str = ""
    """--launch: more dscale-serve flags, one string split as a shell line (e.g. '--engine-process true'); they come
    after the flags above, so they override them."""
    timeout: float = 600.0
    """Seconds one request (or a launched server's start) may take."""
    client_processes: int = 1
    """Processes the closed loop's clients run in, each an asyncio loop on its own core (at most --concurrency):
    raise it when a pass says the client used most of a core (one process took half a core for ~21K streamed events/s
    on a 2-core CPU machine, benchmarks/bench_client_ceiling.py). The clients split as evenly as the concurrency
    allows; a pass's requests and its duration target stay one pass's."""

    def __post_init__(self) -> None:
        if self.launch == (self.url is not None):
            raise ValueError("give either --url URL (a running dscale-serve) or --launch (start servers here)")
        bad = [m for m in self.mode_list if m not in MODES]
        if bad or not self.mode_list:
            raise ValueError(f"--modes must list modes among {', '.join(MODES)}, got '{self.modes}'")
        try:
            levels = self.concurrency_list
        except ValueError:
            levels = []
        if not levels or min(levels) < 1:
            raise ValueError(f"--concurrency must be positive integers separated by commas, got '{self.concurrency}'")
        for name in ("num_requests", "max_tokens", "repetitions", "client_processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not (math.isfinite(self.min_duration_s) and self.min_duration_s >= 0):
            raise ValueError(f"--min-duration-s must be a finite number >= 0 (0 = off), got {self.min_duration_s}")
        if self.max_requests is not None and self.max_requests < self.num_requests:
            raise ValueError(f"--max-requests must be >= --num-requests ({self.num_requests}), got {self.max_requests}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1 = off), got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"--top-k must be -1 (off) or >= 1, got {self.top_k}")
        if self.serve_args and not self.launch:
            raise ValueError("--serve-args is for --launch (a server at --url runs with its own flags)")
        try:
            shlex.split(self.serve_args)
        except ValueError as exc:
            raise ValueError(f"--serve-args must split as a shell line ({exc}): '{self.serve_args}'") from None

    @property
    def mode_list(self) -> list[str]:
        return [m.strip() for m in self.modes.split(",") if m.strip()]

    @property
    def concurrency_list(self) -> list[int]:
        return [int(c) for c in self.concurrency.split(",") if c.strip()]

    @property
    def sampling(self) -> dict:
        """The sampling settings every request carries, reported with every point (bench.json, bench.csv)."""
        return {k: getattr(self, k) for k in SAMPLING}

    @property
    def request_cap(self) -> int:
        """Most requests one measured pass sends (--max-requests or its default)."""
        return self.max_requests if self.max_requests is not None else 100 * self.num_requests

    @property
    def sizing(self) -> dict:
        """How every pass is sized, reported with every point: the duration target and the request cap."""
        return {"min_duration_s": self.min_duration_s, "max_requests": self.request_cap}


# ---------------------------------------------------------------------------------------------- manifest
def load_prompts(name: str) -> list[dict]:
    from dscale_runtime.demo import prompts

    sets = {"stdlib": prompts.stdlib_prompts, "humaneval": prompts.humaneval_prompts, "demo": prompts.demo_prompts}
    if name in sets:
        return sets[name]()
    if not Path(name).is_file():
        raise ValueError(f"--prompts must be stdlib, humaneval, demo or a JSONL file; '{name}' is none of these")
    return prompts.load_prompt_file(name)


def _draw(config: BenchConfig) -> Callable[[int], dict]:
    """Request i of the seeded draw from the prompt set (cycled when it is short), with seed sampling_seed + i."""
    pool = load_prompts(config.prompts)
    order = list(range(len(pool)))
    random.Random(config.seed).shuffle(order)

    def request(i: int) -> dict:
        p = pool[order[i % len(order)]]
        return {"id": p["id"], "prompt": p["prompt"], "max_tokens": config.max_tokens,
                "temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                "seed": config.sampling_seed + i}

    return request


def manifest(config: BenchConfig) -> tuple[list[dict], list[dict]]:
    """(warmup requests, measured requests): a seeded draw from the prompt set, cycled when it is short. Measured
    request i carries seed sampling_seed + i (warmup j: + num_requests + j), the same in every pass and point."""
    request = _draw(config)
    return ([request(config.num_requests + j) for j in range(config.warmup)],
            [request(i) for i in range(config.num_requests)])


def request_stream(config: BenchConfig) -> Callable[[int], dict]:
    """Request k of a measured pass: the manifest's for k < num_requests, then (a pass held to --min-duration-s)
    the draw continued past the warmup requests, seed sampling_seed + warmup + k. The same in every pass."""
    request = _draw(config)
    return lambda k: request(k if k < config.num_requests else k + config.warmup)


# ---------------------------------------------------------------------------------------------- one pass
async def _send(http: aiohttp.ClientSession, model: str, request: dict, start: float | None = None) -> dict:
    body = {"model": model, "prompt": request["prompt"], "stream": True, "stream_options": {"include_usage": True},
            **{k: request[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed")}}
    start = time.perf_counter() if start is None else start
    first, tokens = None, None
    async with http.post("v1/completions", json=body) as response:  # NOTE: relative: after the --url's path
        if response.status != 200:
            detail = (await response.read()).decode(errors="replace")
            raise RuntimeError(f"request {request['id']}: HTTP {response.status}: {detail}")
        async for line in response.content:  # NOTE: bytes, one SSE line each (its newline kept)
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request {request['id']}: {chunk['error']['message']}")
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens is None:
        raise RuntimeError(f"request {request['id']}: the stream ended without usage")
    return {"start": start, "first": first if first is not None else end, "end": end, "tokens": tokens}


class _OneProcess:
    """A pass's next index where one process sends the whole pass (its workers share one thread: no lock)."""

    def __init__(self) -> None:
        self.value = 0

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass


async def closed_loop(url: str, model: str, requests: list[dict], concurrency: int, timeout: float,
                      min_duration_s: float = 0.0, max_requests: int | None = None,
                      more: Callable[[int], dict] | None = None, counter=None) -> list[dict]:
    """Send `requests` with `concurrency` workers, each starting its next request when its last one ends. With
    min_duration_s > 0 the workers go on past them with request k = more(k) (default: requests cycled) until the
    pass has lasted min_duration_s from its first request's start: a worker whose last request ended before that
    sends another, so the last request ends at or after it. `max_requests` (>= len(requests)) bounds the pass.
    Client processes sharing one pass share its next index through `counter` (a multiprocessing Value, 0 at the
    pass's start): each index is sent once, by one process, and each process holds the pass to min_duration_s
    from its own first request. Every record carries its request's index k in the pass, its id and its seed."""
    n = len(requests)
    cap = max(n, max_requests) if max_requests is not None else math.inf
    more = more or (lambda k: requests[k % n])
    records: list[dict] = []
    counter = counter if counter is not None else _OneProcess()
    first_start = None

    def claim(clock: float) -> int | None:
        """The next index of the pass, or None when it is over for a worker whose last request ended at `clock`."""
        counter.acquire()
        try:
            k = counter.value
            if k >= n and (k >= cap or clock - first_start >= min_duration_s):
                return None
            counter.value = k + 1
            return k
        finally:
            counter.release()

    async def worker(http: aiohttp.ClientSession) -> None:
        nonlocal first_start
        last_end = None
        while True:  # the check and the claim of index k have no await between them: one worker claims each k
            now = time.perf_counter()
            first_start = now if first_start is None else first_start
            k = claim(now if last_end is None else last_end)
            if k is None:
                return
            request = requests[k] if k < n else more(k)
            record = await _send(http, model, request, start=now)
            last_end = record["end"]
            records.append({**record, "index": k, "id": request["id"], "seed": request.get("seed")})

    # NOTE: aiohttp (C HTTP parser), as vLLM's and SGLang's serving benchmarks: httpx parses every chunk in
    # Python (h11), ~3x the CPU per streamed event, so one process saturated its core at c = 32 and its own lag
    # was most of the measured TTFT (benchmarks/bench_client_ceiling.py). One connection per worker, in a session
    # of its own (a shared pool costs every request a scan of its connections); one TLS context for all (each new
    # one loads the CA store, ~20 ms).
    tls = ssl.create_default_context(cafile=certifi.where())
    base = url.rstrip("/") + "/"
    clients = [aiohttp.ClientSession(base_url=base, timeout=aiohttp.ClientTimeout(total=timeout),
                                     connector=aiohttp.TCPConnector(limit=1, ssl=tls), read_bufsize=2**20)
               for _ in range(concurrency)]  # NOTE: read_bufsize: an SSE line may reach 2 MiB (aiohttp: 2x it)
    try:
        await asyncio.gather(*(worker(http) for http in clients))
    finally:
        for http in clients:
            await http.close()
    return records


def read_counters(url: str) -> dict[str, float]:
    """A server's /metrics samples by metric name (a labelled family: its last series), each labelled series also
    under its full name (`dscale_decode_steps_by_step_total{model_name="m",step="dflash"}`)."""
    counters = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            counters[name.split("{")[0]] = counters[name] = float(value)
    return counters


def request_latencies(record: dict) -> dict:
    """TTFT, TPOT (nan for a one-token answer) and E2E of one request record, in seconds."""
    tokens = record["tokens"]
    return {"ttft": record["first"] - record["start"], "e2e": record["end"] - record["start"],
            "tpot": (record["end"] - record["first"]) / (tokens - 1) if tokens > 1 else float("nan")}


def latency_figures(records: list[dict]) -> dict:
    """Request count, TTFT / TPOT / E2E median, p90 and p99 (numpy's linear percentiles over the requests; TPOT
    over those with more than one token) and TTFT p99 / median of a set of request records."""
    figures: dict = {"requests": len(records)}
    latencies = [request_latencies(r) for r in records]
    for name in LATENCIES:
        values = [x[name] for x in latencies if not math.isnan(x[name])]
        for q, pct in PERCENTILES.items():
            figures[f"{name}_{q}"] = float(np.percentile(values, pct)) if values else float("nan")
    median = figures["ttft_median"]
    figures["ttft_p99_over_median"] = figures["ttft_p99"] / median if median > 0 else float("nan")
    return figures


def summarise(records: list[dict], before: dict[str, float], after: dict[str, float],
              client_cpu: float = float("nan")) -> dict:
    """One pass's figures from its request records and the server counters around it; `client_cpu`: the CPU
    seconds of the client's thread per second of the pass (1.0: a whole core)."""
    e2e = np.array([r["end"] - r["start"] for r in records])
    ttft = np.array([r["first"] - r["start"] for r in records])
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in records)
    duration = max(r["end"] for r in records) - min(r["start"] for r in records)
    steps = after["dscale_request_steps_total"] - before["dscale_request_steps_total"]
    accepted = after["dscale_accepted_drafts_total"] - before["dscale_accepted_drafts_total"]
    figures = {
        "output_throughput": tokens / duration,
        "e2e_mean": float(e2e.mean()), "e2e_p95": float(np.percentile(e2e, 95)),
        "e2e_p99": float(np.percentile(e2e, 99)),
        "ttft_mean": float(ttft.mean()), "ttft_p95": float(np.percentile(ttft, 95)),
        "tpot_mean": float(np.mean(tpot)) if tpot else float("nan"),
        "mean_acceptance_length": 1.0 + accepted / steps if steps else float("nan"),
        "completion_tokens": tokens, "duration": duration,
        "request_throughput": len(records) / duration, "client_cpu": client_cpu,
    }
    figures.update(latency_figures(records))
    return {k: figures[k] for k in METRICS}


def spread(passes: list[dict]) -> dict:
    """Min / median / max over the passes of each figure in SPREAD (nan passes left out; all nan: nan)."""
    out = {}
    for k in SPREAD:
        values = [p[k] for p in passes if not math.isnan(p[k])]
        out[k] = ({"min": min(values), "median": statistics.median(values), "max": max(values)} if values
                  else dict.fromkeys(("min", "median", "max"), float("nan")))
    return out


def point_figures(passes: list[dict], records: list[list[dict]]) -> dict:
    """A point's report from its passes' figures and request records: the passes, their medians, their spread
    and the latency percentiles over all the point's requests pooled."""
    return {"passes": passes, "median": {k: statistics.median(p[k] for p in passes) for k in METRICS},
            "spread": spread(passes), "pooled": latency_figures([r for pass_records in records for r in pass_records])}


_COUNTER = None
"""In a client process: the next index of the pass under way, shared by every client process (`Clients`)."""


def _share_counter(counter) -> None:
    global _COUNTER
    _COUNTER = counter


def _timed_loop(url: str, model: str, requests: list[dict], concurrency: int, config: BenchConfig,
                counter=None) -> tuple[list[dict], float]:
    """One measured pass's closed loop on this thread (`counter`: shared with other client processes): its records
    and the CPU the thread used per second of the loop."""
    more = request_stream(config)
    with collector_paused():
        cpu, wall = time.thread_time(), time.perf_counter()
        records = asyncio.run(closed_loop(url, model, requests, concurrency, config.timeout, config.min_duration_s,
                                          config.request_cap, more, counter))
        return records, (time.thread_time() - cpu) / (time.perf_counter() - wall)


@contextlib.contextmanager
def collector_paused():
    """The client's cyclic garbage collector off for a measured pass (as `timeit` does), its heap collected and
    frozen first, everything restored after: a full collection in a client process stops its event loop for tens of
    ms (25-60 ms on a 2-core CPU machine, 2026-12-06), and the requests it serves would carry that pause in their
    TTFT and TPOT as if the server had made it. Reference counting still frees the pass's acyclic garbage; its
    cycles wait for the collection after the pass."""
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if not frozen:  # NOTE: a heap frozen before the pass (not by it) stays frozen
            gc.unfreeze()
        if enabled:
            gc.enable()
        gc.collect()


def _client_part(url: str, model: str, requests: list[dict], concurrency: int, config: BenchConfig,
                 start: float) -> tuple[list[dict], float]:
    """One client process's share of a measured pass (`concurrency` of its workers, from `start`, a perf_counter
    time when every process begins): `_timed_loop`'s figures, each record with the process's id ("client")."""
    time.sleep(max(0.0, start - time.perf_counter()))
    records, cpu = _timed_loop(url, model, requests, concurrency, config, _COUNTER)
    return [{**r, "client": os.getpid()} for r in records], cpu


class Clients:
    """Where the measured passes' closed loops run: this thread (one process), or `processes` spawned processes
    (a context manager: they start once, before the first pass, and serve every pass after)."""

    START_S = 0.2
    """The parts of a pass begin together this long after it is handed out (a process that is late begins late)."""

    def __init__(self, processes: int = 1) -> None:
        self.processes = processes
        self.pool = None

    def __enter__(self) -> "Clients":
        if self.processes > 1:
            import concurrent.futures
            import multiprocessing

            context = multiprocessing.get_context("spawn")
            self.counter = context.Value("q", 0)
            self.pool = concurrent.futures.ProcessPoolExecutor(self.processes, mp_context=context,
                                                               initializer=_share_counter, initargs=(self.counter,))
            list(self.pool.map(time.sleep, [0.05] * self.processes))  # NOTE: every process up before a pass
        return self

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None

    def run_pass(self, config: BenchConfig, url: str, model: str, concurrency: int,
                 measured: list[dict]) -> tuple[list[dict], float]:
        """One measured pass (sized by config; past `measured` the draw continued, `request_stream`): its request
        records and the client's CPU, the busiest client thread's CPU seconds per second of the pass."""
        parts = min(self.processes, concurrency) if self.pool is not None else 1
        if parts == 1:  # NOTE: the closed loop runs on this thread: its CPU time is the client's own
            return _timed_loop(url, model, measured, concurrency, config)
        self.counter.value = 0
        start = time.perf_counter() + self.START_S
        shares = [concurrency // parts + (j < concurrency % parts) for j in range(parts)]
        futures = [self.pool.submit(_client_part, url, model, measured, share, config, start) for share in shares]
        results = [f.result() for f in futures]
        return [r for records, _ in results for r in records], max(cpu for _, cpu in results)


def measure_point(config: BenchConfig, url: str, model: str, concurrency: int, warmup: list[dict],
                  measured: list[dict], clients: Clients | None = None) -> dict:
    """Warmup, then config.repetitions passes (each sized by --min-duration-s / --max-requests; past `measured`
    a pass sends the draw continued, `request_stream(config)`) on `clients` (default: this thread). The point's
    "records" (one list of request records per pass) are for bench_requests.csv; run() takes them out of the
    report."""
    if warmup:
        asyncio.run(closed_loop(url, model, warmup, concurrency, config.timeout))
    clients = clients or Clients()
    passes, records = [], []
    for i in range(config.repetitions):
        before = read_counters(url)
        pass_records, client_cpu = clients.run_pass(config, url, model, concurrency, measured)
        passes.append(summarise(pass_records, before, read_counters(url), client_cpu))
        records.append(sorted(pass_records, key=lambda r: r["index"]))
        short = passes[-1]["duration"] < config.min_duration_s
        busy = (f"; the client used {client_cpu:.2f} of a core and may have limited this pass "
                f"(--client-processes {config.client_processes})"
                if client_cpu > CLIENT_BUSY else f"; client CPU {client_cpu:.2f} of a core")
        print(f"[dscale-bench]   pass {i + 1}: {passes[-1]['requests']} requests in {passes[-1]['duration']:.2f} s"
              f"{f' (stopped at --max-requests {config.request_cap}, short of the --min-duration-s target)' if short else ''}"
              f"{busy}", flush=True)
    return {"concurrency": concurrency, **point_figures(passes, records), "records": records}


# ---------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServer:
    """One `dscale-serve` subprocess for one mode; its log goes to the output folder."""

    def __init__(self, config: BenchConfig, mode: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        running = config.max_running_requests or max(config.concurrency_list)
        self.command = [sys.executable, "-m", "dscale_runtime.server.main", "--mode", mode, "--port", str(self.port),
                        "--max-running-requests", str(running), "--budget-ratio", str(config.budget_ratio),
                        "--device", config.device, "--log-level", "warning"]
        for flag in ("target", "drafter", "predictor"):
            if getattr(config, flag):
                self.command += [f"--{flag}", getattr(config, flag)]
        self.command += shlex.split(config.serve_args)
        self.log_path, self.timeout = log_path, config.timeout

    def __enter__(self) -> "LaunchedServer":
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"dscale-serve exited with code {self.process.returncode}; its log "
                                   f"({self.log_path}):\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"dscale-serve did not answer /health within {self.timeout:.0f} s "
                                   f"(log: {self.log_path})")
            time.sleep(0.5)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


def server_identity(url: str) -> tuple[str, str]:
    """(model name, mode) of the server at `url`."""
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    return model["id"], model.get("mode", "unknown")


# ---------------------------------------------------------------------------------------------- report
def sampling_caption(sampling: dict) -> str:
    """One line naming the sampling settings, e.g. 'temperature 0.0 (greedy), top_p 1.0, top_k -1 (off), ...'."""
    return (f"temperature {sampling['temperature']}{' (greedy)' if sampling['temperature'] == 0 else ''}, "
            f"top_p {sampling['top_p']}, top_k {sampling['top_k']}{' (off)' if sampling['top_k'] == -1 else ''}, "
            f"seed {sampling['sampling_seed']} + request index")


def sizing_caption(sizing: dict) -> str:
    """One line naming how the passes were sized, e.g. 'each pass >= 5.0 s, at most 3200 requests'."""
    if not sizing["min_duration_s"]:
        return "each pass exactly --num-requests (no duration target)"
    return f"each pass >= {sizing['min_duration_s']} s, at most {sizing['max_requests']} requests"


def spread_table(points: list[dict]) -> list[str]:
    """Rows of the second table: how long the passes lasted, how many requests they completed, the throughput's
    min / median / max over the passes and the latency percentiles over the point's requests pooled."""
    rows = [f"Spread: {sizing_caption(points[0])}; min / median / max over the passes; latencies over all the "
            "passes' requests", "",
            "| mode | c | pass s (min-max) | requests / pass | tok/s min / med / max | TTFT p50 / p90 / p99 (s) "
            "| TTFT p99/p50 | TPOT p50 / p90 / p99 (ms) | E2E p50 / p90 / p99 (s) | client CPU (cores) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        s, a = p["spread"], p["pooled"]
        tp, dur, req = s["output_throughput"], s["duration"], s["requests"]
        rows.append(
            f"| {p['mode']} | {p['concurrency']} | {dur['min']:.1f}-{dur['max']:.1f} | "
            f"{req['median']:.0f} ({req['min']:.0f}-{req['max']:.0f}) | "
            f"{tp['min']:.1f} / {tp['median']:.1f} / {tp['max']:.1f} | "
            f"{a['ttft_median']:.3f} / {a['ttft_p90']:.3f} / {a['ttft_p99']:.3f} | {a['ttft_p99_over_median']:.2f} | "
            f"{1000 * a['tpot_median']:.1f} / {1000 * a['tpot_p90']:.1f} / {1000 * a['tpot_p99']:.1f} | "
            f"{a['e2e_median']:.2f} / {a['e2e_p90']:.2f} / {a['e2e_p99']:.2f} | {p['median']['client_cpu']:.2f} |")
    return rows


def table(points: list[dict]) -> str:
    rows = [f"Sampling: {sampling_caption(points[0])}", "",
            "| mode | c | tok/s | E2E mean (s) | E2E p95 (s) | E2E p99 (s) | TTFT mean (s) | TPOT (ms) | accept len |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        m = p["median"]
        rows.append(f"| {p['mode']} | {p['concurrency']} | {m['output_throughput']:.1f} | {m['e2e_mean']:.2f} | "
                    f"{m['e2e_p95']:.2f} | {m['e2e_p99']:.2f} | {m['ttft_mean']:.3f} | {1000 * m['tpot_mean']:.1f} | "
                    f"{m['mean_acceptance_length']:.2f} |")
    by_key = {(p["mode"], p["concurrency"]): p["median"]["output_throughput"] for p in points}
    ratios = [f"c={c}: {by_key[('dscale', c)] / by_key[('dflash', c)]:.2f}x" for (mode, c) in by_key
              if mode == "dflash" and ("dscale", c) in by_key]
    if ratios:
        rows.append("\nDScale / DFlash throughput: " + ", ".join(ratios))
    if all("spread" in p for p in points):
        rows += ["", *spread_table(points)]
    return "\n".join(rows)


def write_csv(points: list[dict], path: Path) -> None:
    """One row per point: the original columns (medians over the passes), then the sizing, the spread
    (NAME_min, NAME_max) and the pooled percentiles (pooled_NAME)."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["mode", "concurrency", "repetitions", *SAMPLING, *METRICS, *SIZING,
                         *(f"{k}_{end}" for k in SPREAD for end in ("min", "max")), *(f"pooled_{k}" for k in POOLED)])
        for p in points:
            writer.writerow([p["mode"], p["concurrency"], len(p["passes"]), *(p[k] for k in SAMPLING),
                             *(p["median"][k] for k in METRICS), *(p[k] for k in SIZING),
                             *(p["spread"][k][end] for k in SPREAD for end in ("min", "max")),
                             *(p["pooled"][k] for k in POOLED)])


def write_requests_csv(points: list[dict], records: list[list[list[dict]]], path: Path) -> None:
    """One row per measured request: its point, pass (from 1), index in the pass, id, seed, start (s after the
    pass's first request started), TTFT, TPOT (empty for one token), E2E (s) and completion tokens."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(REQUEST_COLUMNS)
        for point, point_records in zip(points, records):
            for i, pass_records in enumerate(point_records):
                t0 = min(r["start"] for r in pass_records)
                for r in pass_records:
                    lat = request_latencies(r)
                    writer.writerow([point["mode"], point["concurrency"], i + 1, r["index"], r["id"], r["seed"],
                                     repr(r["start"] - t0), repr(lat["ttft"]),
                                     "" if math.isnan(lat["tpot"]) else repr(lat["tpot"]), repr(lat["e2e"]),
                                     r["tokens"]])


def plot(points: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(p["mode"] for p in points):
        own = sorted((p for p in points if p["mode"] == mode), key=lambda p: p["concurrency"])
        cs = [p["concurrency"] for p in own]
        line = ax_tp.plot(cs, [p["median"]["output_throughput"] for p in own], marker="o", label=mode)[0]
        ax_lat.plot(cs, [p["median"]["e2e_mean"] for p in own], marker="o", color=line.get_color(), label=f"{mode} mean")
        ax_lat.plot(cs, [p["median"]["e2e_p95"] for p in own], marker=".", ls="--", color=line.get_color(),
                    label=f"{mode} p95")
    levels = sorted({p["concurrency"] for p in points})
    for ax, ylabel in ((ax_tp, "output tokens / s"), (ax_lat, "E2E latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (closed-loop clients)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def run(config: BenchConfig, command: str | None = None) -> dict:
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    warmup, measured = manifest(config)
    more = request_stream(config)
    points: list[dict] = []
    records: list[list[list[dict]]] = []  # per point, per pass: the request records (bench_requests.csv)
    sized = (f" and >= {config.min_duration_s} s (at most {config.request_cap})" if config.min_duration_s else "")

    def sweep(url: str, mode: str, clients: Clients) -> None:
        model, _ = server_identity(url)
        for c in config.concurrency_list:
            print(f"[dscale-bench] {mode} c={c}: {config.warmup} warmup + {config.repetitions} x "
                  f"{len(measured)} requests{sized}", flush=True)
            point = measure_point(config, url, model, c, warmup, measured, clients)
            records.append(point.pop("records"))
            points.append({"mode": mode, **config.sampling, **config.sizing, **point})

    with Clients(config.client_processes) as clients:
        if config.launch:
            for mode in config.mode_list:
                with LaunchedServer(config, mode, out / f"server-{mode}.log") as server:
                    sweep(server.url, mode, clients)
        else:
            sweep(config.url, server_identity(config.url)[1], clients)
    longest = max(len(pass_records) for point in records for pass_records in point)  # requests k < longest sent
    report = {
        "command": command,
        "config": dataclasses.asdict(config),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version()},
        "manifest": {"warmup": [r["id"] for r in warmup], "measured": [r["id"] for r in measured],
                     "extra": [more(k)["id"] for k in range(len(measured), longest)]},
        "sizing": config.sizing,
        "points": points,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    write_csv(points, out / "bench.csv")
    write_requests_csv(points, records, out / "bench_requests.csv")
    png = Path(config.plot) if config.plot else out / "bench.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    requests = f"{config.num_requests}{'+' if config.min_duration_s else ''} requests"
    plot(points, png, f"dscale-bench: {requests} x {config.max_tokens} tokens, median of {config.repetitions} "
                      f"({config.device}; {sizing_caption(config.sizing)})\n{sampling_caption(config.sampling)}")
    return report


def main(argv: list[str] | None = None) -> None:
    config = parse_config(BenchConfig, "dscale-bench", argv, __doc__.splitlines()[0])
    try:
        report = run(config, " ".join(["dscale-bench", *(sys.argv[1:] if argv is None else argv)]))
    except (RuntimeError, ValueError, httpx.HTTPError, aiohttp.ClientError, TimeoutError) as exc:
        sys.exit(f"dscale-bench: {exc}")
    print(table(report["points"]))
    print(f"\nwrote {config.output}/bench.json, {config.output}/bench.csv, {config.output}/bench_requests.csv, "
          f"{config.plot or config.output + '/bench.png'}")


if __name__ == "__main__":
    main()
