"""How a served engine's live step choice moves with its traffic (issue 25): one `dscale-serve` with the flags given,
driven by `dscale-bench --url` through sampling points and concurrencies in turn, its /metrics scraped every
`--every-s` seconds while each pass runs. Per pass: output tok/s and the timeline of the live choice's inputs
(`dscale_live_accept_length`, `dscale_live_step_ms`, `dscale_live_host_ms`, the steps run by kind, the step each
bucket runs now), so a choice that settles on the slower step shows which estimate led it there.

    python benchmarks/serve_live_choice.py --server-flags="--mode dscale --target-fallback true" \
        --points greedy:0 t1:1 greedy:0 --concurrency 1 8 --duration 3 --device cuda --out live.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

WATCHED = ("dscale_live_accept_length", "dscale_live_step_ms", "dscale_live_host_ms", "dscale_live_wall_ms", "dscale_decode_steps_by_step",
           "dscale_step_policy")


def parse_metrics(text: str) -> dict[str, float]:
    """The watched families' samples of a Prometheus text page (prometheus_client's parser), `name{labels}` ->
    value, the model's label left out."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(WATCHED) and not sample.name.startswith("dscale_step_policy_ms"):
                labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items() if k not in ("model", "model_name"))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def scrape(url: str, every_s: float, stop: threading.Event, into: list) -> None:
    start = time.perf_counter()
    with httpx.Client(timeout=5) as client:
        while not stop.is_set():
            try:
                into.append((round(time.perf_counter() - start, 3), parse_metrics(client.get(f"{url}/metrics").text)))
            except httpx.HTTPError as exc:
                into.append((round(time.perf_counter() - start, 3), {"error": str(exc)}))
            stop.wait(every_s)


def wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before answering /health")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not answer /health in {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-flags", default="--mode dscale --target-fallback true")
    parser.add_argument("--points", nargs="+", default=["greedy:0", "t1:1", "greedy:0"],
                        help="name:temperature[/top_p], run in this order")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per pass (dscale-bench --min-duration-s)")
    parser.add_argument("--every-s", type=float, default=0.25)
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-running-requests", type=int, default=32)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    work = Path(tempfile.mkdtemp(prefix="live_choice_"))
    log = (work / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "dscale_runtime.server.main", *shlex.split(args.server_flags),
                               "--device", args.device, "--port", str(port), "--max-running-requests",
                               str(args.max_running_requests)], stdout=log, stderr=subprocess.STDOUT)
    result = {"server_flags": args.server_flags, "device": args.device, "passes": []}
    try:
        wait_up(url, server)
        result["startup"] = parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text)
        for point in args.points:
            name, _, sampling = point.partition(":")
            temperature, _, top_p = sampling.partition("/")
            for c in args.concurrency:
                timeline: list = []
                stop = threading.Event()
                watcher = threading.Thread(target=scrape, args=(url, args.every_s, stop, timeline), daemon=True)
                watcher.start()
                out = work / f"{name}_{c}_{len(result['passes'])}"
                cmd = [sys.executable, "-m", "dscale_runtime.bench", "--url", url, "--concurrency", str(c),
                       "--num-requests", "32", "--warmup", "8", "--repetitions", "1", "--min-duration-s",
                       str(args.duration), "--temperature", temperature, "--top-p", top_p or "1",
                       "--client-processes", str(min(args.client_processes, c)), "--output", str(out)]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                stop.set()
                watcher.join()
                bench = json.loads((out / "bench.json").read_text())
                tok_s = bench["points"][0]["median"]["output_throughput"]
                last = timeline[-1][1] if timeline else {}
                print(f"[live] {name} c={c}: {tok_s:.0f} tok/s; at the end: "
                      + ", ".join(f"{k}={v:.3g}" for k, v in sorted(last.items()) if "bucket=\"1\"" in k or
                                  "steps_by" in k or "accept" in k), flush=True)
                result["passes"].append({"point": name, "temperature": float(temperature),
                                         "top_p": float(top_p or 1), "concurrency": c, "tok_s": tok_s,
                                         "timeline": timeline})
                args.out.write_text(json.dumps(result, indent=1))
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        result["server_log_tail"] = (work / "server.log").read_text()[-4000:]
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
