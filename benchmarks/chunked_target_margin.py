"""Chunked prefill + prefix caching vs unchunked decoding of the demo pair: near-tie or bug? (issue 24, point 1)

The scenario of tests/test_runner.py::test_chunked_prefill_and_prefix_caching_keep_greedy_output_on_cuda: 18
prompts sharing long prefixes (3 distinct ones, each 6 times), greedy, 32 tokens, fp32, 4 running requests. The
oracle is target-only decoding without prefix caching or chunks; every variant (mode x chunk size x caching x
overlap schedule) is compared with it request by request, and every decoding with a transformers fp32 greedy
decoding of the same prompt token ids. At each request's first differing token the script recomputes, with
transformers over the shared prefix, the target's logits in fp32 and fp64 and prints

- the top-2 margin there (top-1 minus top-2 logit), and
- the gap between the two tokens the two decodings chose (fp64): a gap far above fp32 rounding (which is about
  1e-5 on these logits; `--tie-margin`, default 1e-2) cannot come from a reduction order: it is a bug.

It also counts "short" decode launches: a decode step launched for a request whose cache pages cannot hold the
positions that step writes (num_computed .. num_computed + block - 1); their K/V goes to whatever page id the
runner's block-table row holds there (the scratch page, or a stale page of another request), and the next step
reads the position back from a freshly allocated page. Any nonzero count is the bug.

    python benchmarks/chunked_target_margin.py --device cuda --out runs/chunked_margin.json
    python benchmarks/chunked_target_margin.py --device cpu --prompts 6 --chunks 48 --variants test  # CPU check
    python benchmarks/chunked_target_margin.py --device cpu --interpret --prompts 4 --max-tokens 4 ...  # Triton

`--interpret` (CPU) runs the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1, DSCALE_ATTENTION /
DSCALE_FUSED / DSCALE_FEATURES = triton), set before anything imports triton; slow: use few prompts and tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # name -> (prefix_caching, chunked, overlap_schedule)
    "test": (True, True, True),  # the GPU test's configuration
    "nocache": (False, True, True),  # chunks alone
    "cache_unchunked": (True, False, True),  # prefix caching alone
    "overlap_off": (True, True, False),  # chunks + caching, every step committed before the next
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", nargs="+", default=["target", "dflash"], choices=["target", "dflash", "dscale"])
    p.add_argument("--chunks", nargs="+", type=int, default=[48, 64])
    p.add_argument("--variants", nargs="+", default=["test", "nocache", "overlap_off"], choices=sorted(VARIANTS))
    p.add_argument("--prompts", type=int, default=18, help="the first N of the test's 18 prompts (or more)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-running", type=int, default=4)
    p.add_argument("--graphs", choices=["on", "off", "both"], default=None,
                   help="step graphs (CUDA only): default 'on' on CUDA (as the test), 'off' elsewhere")
    p.add_argument("--tie-margin", type=float, default=1e-2,
                   help="fp64 logit gap between the two chosen tokens below which a difference counts as a near-tie")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers greedy decodings (margins still computed)")
    p.add_argument("--interpret", action="store_true", help="CPU: the Triton kernels in Triton's interpreter")
    p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.graphs is None:
        args.graphs = "on" if args.device.startswith("cuda") else "off"
    return args


def scenario_prompts(n: int) -> list[str]:
    """The test's prompts: base[i % 3] * 3 + base[3 + i % 3] over the first 6 stdlib prompts."""
    from dscale_runtime.demo.prompts import stdlib_prompts

    base = [p["prompt"] for p in stdlib_prompts()[:6]]
    return [base[i % 3] * 3 + base[3 + i % 3] for i in range(n)]


class ShortPages:
    """Wraps `Engine._decode` of one engine: records every request whose pages cannot hold the positions the
    launched step writes. Host-side only (no device read), so captured steps stay as they are."""

    def __init__(self, engine) -> None:
        self.events: list[dict] = []
        self.engine = engine
        original = engine._decode

        @functools.wraps(original)
        def checked(requests):
            self.check(requests)
            return original(requests)

        engine._decode = checked

    def check(self, requests) -> None:
        e = self.engine
        size, width = e.config.page_size, e.block_size
        for r in requests:
            # NOTE: a request ahead of the host by exactly its first token (drawn on the device after its prefill,
            # not committed yet) starts at num_computed too; requests further ahead are not checked.
            if r.ahead == 0 or (r.ahead == 1 and not r.output_token_ids):
                need = r.num_computed + width
                if len(r.pages) * size < need:
                    self.events.append({"request": r.request_id, "positions": [r.num_computed, need - 1],
                                        "pages": len(r.pages), "slots": len(r.pages) * size,
                                        "prompt_len": len(r.prompt_token_ids),
                                        "committed_outputs": len(r.output_token_ids)})


def build(mode: str, device: str, graphs: bool, max_running: int, caching: bool, chunk: int, overlap: bool):
    from dscale_runtime.config import EngineConfig
    from dscale_runtime.demo.prompts import DEMO_DIR
    from dscale_runtime.engine import Engine

    cfg = EngineConfig(mode=mode, device=device, dtype="float32", max_model_len=1024, step_graphs=graphs,
                       max_running_requests=max_running, prefix_caching=caching, chunked_prefill_tokens=chunk,
                       overlap_schedule=overlap, dscale_policy="always", target_fallback=False)
    return Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter" if mode != "target" else None,
                                  DEMO_DIR.parent / "demo.pt" if mode == "dscale" else None, config=cfg)


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((k for k, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))


class Reference:
    """The demo target in transformers, fp32 and fp64, on the device: greedy decodings and logits at a prefix."""

    def __init__(self, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from dscale_runtime.demo.prompts import DEMO_DIR

        self.torch = torch
        self.device = device
        self.models = {name: AutoModelForCausalLM.from_pretrained(DEMO_DIR / "target", dtype=dtype).to(device).eval()
                       for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64))}

    def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
        """fp32 greedy decoding with transformers' own KV cache (no EOS stop: the engine ignores EOS too)."""
        torch = self.torch
        model = self.models["fp32"]
        with torch.no_grad():
            out = model(torch.tensor([ids], device=self.device), use_cache=True)
            tokens = []
            for _ in range(max_tokens):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                if len(tokens) == max_tokens:
                    break
                out = model(torch.tensor([[token]], device=self.device), past_key_values=out.past_key_values,
                            use_cache=True)
        return tokens

    def at(self, ids: list[int], a: int | None, b: int | None) -> dict:
        """Top-2 (fp32, fp64) after `ids`, and logit[a] - logit[b] (the two decodings' choices) in both."""
        torch = self.torch
        row = {}
        with torch.no_grad():
            for name, model in self.models.items():
                logits = model(torch.tensor([ids], device=self.device)).logits[0, -1].double()
                top = logits.topk(2)
                row[f"{name}_top2"] = top.indices.tolist()
                row[f"{name}_top2_margin"] = float(top.values[0] - top.values[1])
                if a is not None and b is not None:
                    row[f"{name}_gap"] = float(logits[a] - logits[b])
        return row


def compare(name: str, got: list[list[int]], want: list[list[int]], prompt_ids: list[list[int]], ref: Reference,
            tie: float, against: str) -> list[dict]:
    rows = []
    for i, (g, w) in enumerate(zip(got, want)):
        j = first_difference(g, w)
        if j is None:
            continue
        a = w[j] if j < len(w) else None
        b = g[j] if j < len(g) else None
        row = {"variant": name, "against": against, "request": i, "prompt_len": len(prompt_ids[i]),
               "first_difference": j, f"{against}_token": a, "got_token": b}
        row.update(ref.at(prompt_ids[i] + w[:j], a, b))
        gap = abs(row.get("fp64_gap", float("inf")))
        row["verdict"] = "near-tie" if gap < tie else "BUG (not a near-tie)"
        rows.append(row)
    return rows


def fmt(row: dict) -> str:
    gap = row.get("fp64_gap")
    return (f"    request {row['request']:2d} (prompt {row['prompt_len']} tokens): first differs at token "
            f"{row['first_difference']}: {row['against']} {row[row['against'] + '_token']} vs {row['got_token']}; "
            f"top-2 margin fp32 {row['fp32_top2_margin']:.6f} fp64 {row['fp64_top2_margin']:.6f} "
            f"(top-2 {row['fp64_top2']}); fp64 gap {'n/a' if gap is None else f'{gap:.6f}'} -> {row['verdict']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.interpret:
        # NOTE: process entry point only: Triton reads TRITON_INTERPRET at import, KernelChoice these at build
        if "triton" in sys.modules:
            raise SystemExit("--interpret must be set before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        for var in ("DSCALE_ATTENTION", "DSCALE_FUSED", "DSCALE_FEATURES"):
            os.environ[var] = "triton"
    import torch

    from dscale_runtime.config import SamplingParams

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; use --device cpu")
    start = time.perf_counter()
    prompts = scenario_prompts(args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    graph_modes = {"on": [True], "off": [False], "both": [False, True]}[args.graphs]
    if not args.device.startswith("cuda"):
        graph_modes = [False]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "dscale_runtime"], capture_output=True,
                                    text=True, cwd=Path(__file__).parent).stdout.strip())
    except OSError:
        commit, dirty = "", False
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "commit": commit, "dscale_runtime_dirty": dirty,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "tf32": torch.backends.cuda.matmul.allow_tf32, "runs": {}, "differences": []}
    print(f"commit {commit}{' (dscale_runtime modified)' if dirty else ''}, device {report['device']}, "
          f"torch {torch.__version__}, matmul allow_tf32 {report['tf32']}", flush=True)

    ref = Reference(args.device)
    oracle = build("target", args.device, graph_modes[-1], args.max_running, False, 0, True)
    outputs = oracle.generate(prompts, params)
    want = [o.token_ids for o in outputs]
    prompt_ids = [list(o.prompt_token_ids) for o in outputs]
    report["kernels"] = repr(getattr(oracle.target, "kernels", None))
    print(f"oracle (target, unchunked, no caching): {len(want)} requests, prompt lengths "
          f"{sorted(set(len(p) for p in prompt_ids))}, kernels {report['kernels']} "
          f"({time.perf_counter() - start:.0f}s)", flush=True)
    hf = None
    if not args.no_hf:
        hf = [ref.greedy(ids, args.max_tokens) for ids in prompt_ids]
        rows = compare("oracle", want, hf, prompt_ids, ref, args.tie_margin, "transformers")
        print(f"oracle vs transformers fp32 greedy: {len(want) - len(rows)}/{len(want)} identical", flush=True)
        for row in rows:
            print(fmt(row))
        report["differences"] += rows
    del oracle

    for mode in args.modes:
        for variant in args.variants:
            caching, chunked, overlap = VARIANTS[variant]
            for chunk in (args.chunks if chunked else [0]):
                for graphs in graph_modes:
                    name = f"{mode} {variant} chunk={chunk} graphs={'on' if graphs else 'off'}"
                    engine = build(mode, args.device, graphs, args.max_running, caching, chunk, overlap)
                    short = ShortPages(engine)
                    got = [o.token_ids for o in engine.generate(prompts, params)]
                    rows = compare(name, got, want, prompt_ids, ref, args.tie_margin, "oracle")
                    if hf is not None:
                        rows += compare(name, got, hf, prompt_ids, ref, args.tie_margin, "transformers")
                    same = sum(g == w for g, w in zip(got, want))
                    stats = getattr(engine, "prefix_cache_stats", {}) if caching else {}
                    report["runs"][name] = {"identical_to_oracle": same, "requests": len(want),
                                            "identical_to_transformers": None if hf is None else
                                            sum(g == h for g, h in zip(got, hf)),
                                            "short_page_decodes": short.events, "prefix_cache": stats,
                                            "kernels": repr(getattr(engine.target, "kernels", None))}
                    print(f"{name}: {same}/{len(want)} identical to the oracle"
                          + ("" if hf is None else f", {report['runs'][name]['identical_to_transformers']}/"
                             f"{len(want)} to transformers")
                          + f"; short-page decode launches: {len(short.events)}"
                          + (f" (requests {sorted({int(e['request']) for e in short.events})})" if short.events else "")
                          + f" ({time.perf_counter() - start:.0f}s)", flush=True)
                    for row in rows:
                        print(fmt(row))
                    for event in short.events[:4]:
                        print(f"    short: {event}")
                    report["differences"] += rows
                    del engine
    bugs = [r for r in report["differences"] if r["verdict"].startswith("BUG")]
    shorts = sum(len(r["short_page_decodes"]) for r in report["runs"].values())
    report["summary"] = {"differences": len(report["differences"]), "not_near_ties": len(bugs),
                         "short_page_decodes": shorts, "seconds": round(time.perf_counter() - start, 1)}
    print(f"summary: {len(report['differences'])} differing (request, variant) pairs, {len(bugs)} of them not "
          f"near-ties (fp64 gap >= {args.tie_margin}); {shorts} short-page decode launches", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
