"""How fast `dscale-bench`'s client itself is: its closed loop against a server that costs nothing (issue 24).

A stand-in OpenAI server in its own process streams every request's answer as `--events` SSE chunks, one per
shared tick of `--tick-ms` (a decode step serving every request at once), then the usage chunk. An ideal client
would see TTFT = one tick and e2e = events x tick at every concurrency; what it sees above that is the client's own
lag, which every served figure of `dscale-bench` carries. Run it before reading a TTFT tail as the server's.

    python benchmarks/bench_client_ceiling.py --concurrency 8 32 --events 22 --tick-ms 2
    python benchmarks/bench_client_ceiling.py --concurrency 32 --tick-ms 1 --client-processes 1 4   # the ceiling
        # of 1 and of 4 client processes (`dscale-bench --client-processes`), the busiest one's CPU beside it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COUNTERS = ("dscale_generation_tokens_total", "dscale_request_steps_total", "dscale_accepted_drafts_total",
            "dscale_verify_rows_total", "dscale_decode_steps_total")


def serve(port: int, events: int, tick_s: float) -> None:
    """The stand-in server (raw asyncio HTTP/1.1, keep-alive, chunked SSE)."""
    state = {"tick": None}

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick_s)
            tick, state["tick"] = state["tick"], asyncio.Event()
            tick.set()

    def sse(payload: dict) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    def plain(body: bytes, kind: bytes = b"application/json") -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (kind, len(body)) + body

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /v1/models"):
                    writer.write(plain(json.dumps({"data": [{"id": "stand-in", "mode": "dflash"}]}).encode()))
                    continue
                if head.startswith(b"GET /metrics"):
                    writer.write(plain("".join(f"{name} 1\n" for name in COUNTERS).encode(), b"text/plain"))
                    continue
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                for _ in range(events):
                    await state["tick"].wait()
                    chunk = sse({"id": "cmpl-0", "object": "text_completion", "model": "stand-in", "usage": None,
                                 "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}]})
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                chunk = sse({"id": "cmpl-0", "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": events,
                                                                       "total_tokens": 8 + events}}) + b"data: [DONE]\n\n"
                writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    async def main() -> None:
        state["tick"] = asyncio.Event()
        asyncio.ensure_future(ticker())
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--events", type=int, default=22, help="SSE text chunks per answer (64 tokens at ~3 a step)")
    parser.add_argument("--tick-ms", type=float, default=2.0, help="time between a request's chunks")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds each pass lasts at least")
    parser.add_argument("--client-processes", type=int, nargs="+", default=[1],
                        help="client process counts to measure in turn (dscale-bench --client-processes)")
    parser.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.events, args.tick_ms / 1000)

    from dscale_runtime.bench import BenchConfig, Clients, closed_loop, latency_figures, manifest

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--events", str(args.events),
                               "--tick-ms", str(args.tick_ms)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        config = BenchConfig(url=url, num_requests=64, warmup=8, min_duration_s=args.duration, max_requests=100_000)
        warmup, measured = manifest(config)
        ideal_e2e = args.events * args.tick_ms
        print(f"ideal: TTFT ~{args.tick_ms:.1f} ms, e2e ~{ideal_e2e:.0f} ms, c / e2e requests/s")
        for processes in args.client_processes:
            with Clients(processes) as clients:
                for c in args.concurrency:
                    asyncio.run(closed_loop(url, "stand-in", warmup, c, 60))
                    records, cpu = clients.run_pass(config, url, "stand-in", c, measured)
                    duration = max(r["end"] for r in records) - min(r["start"] for r in records)
                    figures = latency_figures(records)  # dscale-bench's own percentiles
                    print(f"processes={processes} c={c}: {len(records) / duration:.0f} requests/s (ideal "
                          f"{1000 * c / ideal_e2e:.0f}), {len(records) * (args.events + 1) / duration:.0f} SSE "
                          f"events/s, TTFT median {1000 * figures['ttft_median']:.1f} ms p99 "
                          f"{1000 * figures['ttft_p99']:.1f} ms, e2e median {1000 * figures['e2e_median']:.1f} ms, "
                          f"busiest client {cpu:.2f} core", flush=True)
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
