"""Data-parallel serving on one GPU (issue 18 acceptance 2): two `dscale-serve` replicas sharing the GPU behind
sglang-router serve the demo pair with the same greedy outputs as one replica; closed-loop throughput of both.

    python benchmarks/dp_gpu_check.py --prompts 64 --max-tokens 64 --concurrency 16 --out dp.json

Each layout (one replica, two replicas behind the router) is a `DataParallelServer` / `dscale-serve` process
tree on free local ports; `--concurrency` clients send every prompt once (greedy, fp32 by default so that
batch composition cannot flip a near-tie); answers are compared prompt by prompt.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from dscale_runtime.demo.prompts import stdlib_prompts
from dscale_runtime.server.config import ServeConfig
from dscale_runtime.server.data_parallel import DataParallelServer


def complete_all(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[list, float]:
    def one(prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=300)
        answer.raise_for_status()
        return answer.json()["choices"][0]["text"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        texts = list(pool.map(one, prompts))
    return texts, time.perf_counter() - start


def requests_received(url: str) -> float:
    """dscale_requests_received_total of one replica (its own /metrics), warm-up included."""
    text = httpx.get(url + "/metrics", timeout=10).text
    family = next(f for f in text_string_to_metric_families(text) if f.name == "dscale_requests_received")
    return family.samples[0].value


def serve(replicas: int, args, prompts: list[str]) -> dict:
    config = ServeConfig(port=0, device=args.device, dtype=args.dtype, mode=args.mode, data_parallel_size=replicas,
                         data_parallel_gpus="0,0" if replicas == 2 and args.device == "cuda" else None,
                         max_running_requests=args.concurrency, max_model_len=1024, log_level="warning",
                         **({"router": True} if replicas > 1 else {}))
    log = open(args.log_dir / f"replicas_{replicas}.log", "w")
    with log, DataParallelServer(config, output=log) as server:
        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        complete_all(server.url, model, prompts[: args.concurrency], args.max_tokens, args.concurrency)  # warm-up
        texts, seconds = complete_all(server.url, model, prompts, args.max_tokens, args.concurrency)
        spread = [requests_received(r.url) for r in server.replicas]
    return {"replicas": replicas, "seconds": round(seconds, 3), "texts": texts,
            "requests_per_s": round(len(prompts) / seconds, 2), "requests_per_replica": spread}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--mode", default="dscale")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--log-dir", type=Path, default=Path("runs/dp_gpu"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    prompts = [p["prompt"] for p in stdlib_prompts()[: args.prompts]]
    one, two = serve(1, args, prompts), serve(2, args, prompts)
    equal = sum(a == b for a, b in zip(one.pop("texts"), two.pop("texts")))
    result = {"date": datetime.date.today().isoformat(), "mode": args.mode, "dtype": args.dtype,
              "prompts": len(prompts), "max_tokens": args.max_tokens, "concurrency": args.concurrency,
              "one_replica": one, "two_replicas": two, "outputs_equal": equal,
              "throughput_ratio": round(one["seconds"] / two["seconds"], 3)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
