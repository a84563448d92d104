"""The HTTP front end of `dscale-serve` under a GPU-like load, on any machine (issue 24, acceptance 4).

The real server app (`build_app`: uvicorn, the engine thread, SSE, the detokenizer) runs around a stand-in
engine that costs what a captured GPU engine's step costs the host: `--host-ms` of Python work holding the
GIL (the step's bookkeeping), then `--device-ms` waiting with the GIL released (the device step), then every
running request gains tokens (1 + a fixed pattern of accepted drafts, mean about --tokens-per-step). The
client is `dscale-bench --url` in its own process, as users run it. What comes out is the front end's own
latency: the stand-in admits at once and its first token comes one step later, so a TTFT far above a few
steps is the server's HTTP / streaming path or the client, not an engine.

    python benchmarks/serve_frontend.py --concurrency 1 8 32 --out runs/frontend

Also reports the server-side TTFT histogram (arrival at the handler to the first token at the engine thread)
beside the client's, so the two ends of the gap are visible.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dscale_runtime.config import EngineConfig, RequestOutput, RequestStats  # noqa: E402
from dscale_runtime.models.loader import load_tokenizer  # noqa: E402
from dscale_runtime.stats import EngineCounters  # noqa: E402

DEMO_TARGET = ROOT / "artifacts" / "demo" / "target"
HISTOGRAMS = ("dscale_time_to_first_token_seconds", "dscale_time_to_first_chunk_seconds")


@dataclass
class _Allocator:
    num_pages: int = 4097
    num_free: int = 4096
    page_size: int = 16


@dataclass
class _TargetConfig:
    vocab_size: int


@dataclass
class _Target:
    config: _TargetConfig


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)


class StandInEngine:
    """The engine surface the server uses, with a GPU engine's host/device time split per step."""

    ACCEPTED = (2, 0, 3, 1, 4, 2, 1, 3)  # accepted drafts per step, cycled (mean 2: about 3 tokens a step)

    def __init__(self, tokenizer, host_ms: float, device_ms: float, max_running: int, mode: str = "dflash"):
        self.tokenizer = tokenizer
        self.host_s = host_ms / 1000
        self.device_s = device_ms / 1000
        self.config = EngineConfig(mode=mode, max_running_requests=max_running, max_model_len=4096, device="cpu")
        self.block_size = 16
        self.allocator = _Allocator()
        self.target = _Target(_TargetConfig(len(tokenizer)))
        self.counters = EngineCounters()
        self.last_step = None
        self.requests: dict[str, _Request] = {}
        self._pattern = itertools.cycle(self.ACCEPTED)
        words = [tokenizer.encode(" " + w, add_special_tokens=False) for w in
                 ("def", "return", "value", "self", "list", "print", "index", "name", "result", "data")]
        self._vocab = [ids[0] for ids in words if len(ids) == 1] or [tokenizer.encode("a", add_special_tokens=False)[0]]

    # what the worker calls
    def add_request(self, prompt_token_ids, params, request_id) -> None:
        if len(self.requests) >= 4 * self.config.max_running_requests:
            raise ValueError("stand-in engine: too many requests")
        self.requests[request_id] = _Request(request_id, list(prompt_token_ids), params.max_tokens)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return min(len(self.requests), self.config.max_running_requests)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self.requests) - self.config.max_running_requests)

    def generated_token_ids(self, request_id: str, start: int = 0) -> list[int]:
        return self.requests[request_id].tokens[start:]

    def step(self) -> list[RequestOutput]:
        deadline = time.perf_counter() + self.host_s
        spin = 0
        while time.perf_counter() < deadline:  # host work: Python holding the GIL
            spin += 1
        time.sleep(self.device_s)  # the device step: the GIL is free
        self.counters.steps += 1
        finished = []
        for request in list(self.requests.values())[: self.config.max_running_requests]:
            accepted = next(self._pattern)
            for _ in range(accepted + 1):
                request.tokens.append(self._vocab[len(request.tokens) % len(self._vocab)])
            request.stats.num_steps += 1
            request.stats.accepted_lens.append(accepted)
            request.stats.verify_lens.append(16)
            self.counters.generated_tokens += accepted + 1
            self.counters.request_steps += 1
            self.counters.accepted_drafts += accepted
            self.counters.verify_rows += 16
            if len(request.tokens) >= request.max_tokens:
                del request.tokens[request.max_tokens:]
                del self.requests[request.request_id]
                finished.append(RequestOutput(request.request_id, request.prompt, request.tokens,
                                              self.tokenizer.decode(request.tokens, skip_special_tokens=True),
                                              "length", request.stats))
        return finished


def stand_in(tokenizer_path: str, host_ms: float, device_ms: float, max_running: int, config=None) -> StandInEngine:
    """The stand-in engine (a module-level function: the engine process builds it from its pickle)."""
    return StandInEngine(load_tokenizer(Path(tokenizer_path)), host_ms, device_ms, max_running)


def server_histogram(url: str, name: str = "dscale_time_to_first_token_seconds") -> dict:
    """One of the server's histograms: cumulative counts by upper bound ('le')."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
    family = next(f for f in families if f.name == name)
    return {s.labels["le"]: s.value for s in family.samples if s.name == name + "_bucket"}


def shares(before: dict, after: dict, bounds=("0.01", "0.02", "0.04", "0.1", "0.5")) -> dict:
    """Share of the requests between two scrapes under each bound."""
    counts = {le: after[le] - before.get(le, 0.0) for le in after}
    total = counts.get("+Inf", 0.0)
    return {le: counts[le] / total for le in bounds if total and le in counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--host-ms", type=float, default=3.6, help="GIL-holding host work per step (ms)")
    parser.add_argument("--device-ms", type=float, default=1.5, help="GIL-free device wait per step (ms)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds each pass lasts at least")
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="the server process's thread switch interval (default: dscale-serve's --switch-interval-ms)")
    parser.add_argument("--engine-process", action="store_true",
                        help="the stand-in engine in a process of its own (dscale-serve --engine-process)")
    parser.add_argument("--out", default="runs/frontend")
    args = parser.parse_args()

    from dscale_runtime.server.config import ServeConfig
    from dscale_runtime.server.main import BackgroundServer

    if args.switch_interval_ms is None:
        args.switch_interval_ms = ServeConfig.switch_interval_ms  # the dataclass field's default
    sys.setswitchinterval(args.switch_interval_ms / 1000)  # as dscale-serve does at start-up
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = ServeConfig(port=0, served_model_name="stand-in", max_running_requests=max(args.concurrency),
                         switch_interval_ms=args.switch_interval_ms)
    factory = functools.partial(stand_in, str(DEMO_TARGET), args.host_ms, args.device_ms, max(args.concurrency))
    worker = None
    if args.engine_process:
        from dscale_runtime.server.engine_process import EngineProcessClient

        worker = EngineProcessClient(config, factory)
        engine = worker.start_process(load_tokenizer(DEMO_TARGET))
    else:
        engine = factory()
    results = {"args": vars(args), "points": []}
    with BackgroundServer(engine, config, worker) as server:
        for c in args.concurrency:
            before = [server_histogram(server.url, name) for name in HISTOGRAMS]
            bench_out = out / f"c{c}"
            cmd = [sys.executable, "-m", "dscale_runtime.bench", "--url", server.url, "--concurrency", str(c),
                   "--num-requests", str(max(16, 2 * c)), "--warmup", str(c), "--repetitions", str(args.repetitions),
                   "--min-duration-s", str(args.duration), "--max-tokens", str(args.max_tokens),
                   "--output", str(bench_out)]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            after = [server_histogram(server.url, name) for name in HISTOGRAMS]
            point = json.loads((bench_out / "bench.json").read_text())["points"][0]
            pooled = point["pooled"]
            sides = {name: shares(b, a) for name, b, a in zip(HISTOGRAMS, before, after)}
            row = {"concurrency": c, "output_throughput": point["median"]["output_throughput"], **pooled,
                   "server_shares_under_s": sides}
            results["points"].append(row)
            print(f"c={c}: {row['output_throughput']:.0f} tok/s, client TTFT median "
                  f"{1000 * pooled['ttft_median']:.1f} ms p99 {1000 * pooled['ttft_p99']:.1f} ms "
                  f"(p99/median {pooled['ttft_p99_over_median']:.2f}); server shares under s: "
                  + "; ".join(f"{name.split('_time_to_')[1]} " + ", ".join(f"{le}: {v:.3f}" for le, v in sh.items())
                              for name, sh in sides.items()), flush=True)
    (out / "frontend.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
