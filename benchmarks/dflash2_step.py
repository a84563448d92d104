"""The DFlash 2 decode step beside DFlash 1 on the GPU, through the engine's step runner (issue 26, acceptance 5).

One process, random bf16 weights at a `gpu_step.py` shape (Qwen3-8B by default): the target and the caches of
`gpu_step.Bench`, its DFlash 1 drafter, and a DFlash 2 drafter of the same shape in z-lab's `DFlash2DraftModel`
layout (`--conv-kernel-size`, `--conv-group-size`, `--selector-rank`: 256 is a 78 MB bf16 codebook at Qwen3's
vocabulary, `--selector-top-k`), random weights too. Per N (`--ns`, default 8 16 32), in a bucket of exactly N,
captured on CUDA (eager elsewhere):
- check: for DFlash 2 greedy and sampled (T = 1, sampled drafts), the captured step's results (accepted counts,
  successors, verify lengths, block tokens) equal the eager step's over the same inputs; a mismatch is an error;
- timing: DFlash 1 and DFlash 2 steps, DScale over each (budget `--ratio`), greedy and all rows sampled; the
  ratios `dflash2 / dflash1` (acceptance 5: <= 1.05 at N = 8, 16, 32) and `dscale/dflash` of each drafter;
- profile (`--profile`): where DFlash 2's extra time goes, each piece alone at the bench's shape, captured as a
  CUDA graph (eager elsewhere), CUDA-event medians: each drafter's whole draft part (`BucketStep.draft`, greedy
  and sampled), the shared LM head, DFlash 1's argmax against the selector's top-k (torch.topk and the Triton
  top-k), the selector walk (torch's all-transitions form and the one-launch Triton walk, greedy and sampled),
  one convolution's dynamic-tap projection and one Triton convolution (a step runs 2 and 4 per draft layer),
  and a line "extra" summing what DFlash 2 adds; at the largest N, the captured DFlash 1 and DFlash 2 steps'
  device time by kernel name (torch.profiler), the kernels whose time differs most between them.

    python benchmarks/dflash2_step.py --out $OUT/dflash2_step.json              # H200, ~3 min
    python benchmarks/dflash2_step.py --ns 8 32 --reps 10 --profile --out $OUT/dflash2_step.json
    python benchmarks/dflash2_step.py --device cpu --tiny --out /tmp/d2.json    # same code, tiny, eager, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_step import BLOCK, SHAPES, Bench, benchmark_settings, qwen3_config, random_init, release, step_kind, \
    sync, time_call  # noqa: E402
from dscale_runtime.graphs import GraphedCall  # noqa: E402
from dscale_runtime.kernels import triton_available  # noqa: E402
from dscale_runtime.models.config import DFlash2Config, DFlashConfig  # noqa: E402
from dscale_runtime.models.dflash2 import DFlash2DraftModel, block_convolve, candidate_topk  # noqa: E402


def build_dflash2(bench: Bench, args, seed: int = 7) -> DFlash2DraftModel:
    """A DFlash 2 drafter of the bench's shape, random weights, laid out as the engine loads it."""
    shape, device = bench.shape, bench.device
    sel = DFlash2Config(args.conv_kernel_size, args.conv_group_size, args.selector_rank, args.selector_top_k)
    cfg = DFlashConfig(qwen3_config(shape, shape.draft_layers), BLOCK, shape.mask_token_id, shape.target_layer_ids,
                       shape.layers, architecture="DFlash2DraftModel", dflash2=sel)
    with torch.device("meta"):
        drafter = DFlash2DraftModel(cfg, bench.served)
    gen = torch.Generator(device=device).manual_seed(seed)
    drafter = random_init(drafter, device, bench.dtype, 0.02 if shape.hidden >= 1024 else 0.2, gen).eval()
    with torch.no_grad():
        for layer in drafter.layers:  # NOTE: near-identity convolutions, as a trained drafter's start from
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 0] += 1.0
        drafter.candidate_selector.predecessor_codebook.normal_(0.0, 1.0, generator=gen)
        drafter.candidate_selector.successor_codebook.normal_(0.0, 1.0, generator=gen)
    if device.type == "cuda":
        drafter.fuse_projections()
    drafter.head_weight(bench.target.lm_head.weight)
    return drafter


def step_result(bench: Bench, drafter, mode: str, n: int, sampling: str, graphs: bool, ratio: float):
    """One step's result tensor [n, 4 + W] on the host, and the runner (its first call builds the step)."""
    bench.drafter = drafter
    runner = bench.runner(mode, ratio, graphs, [n])
    batch, kind = bench.batch(n, sampling), step_kind(mode, sampling, bench.sampled_rule)
    out = batch.run(runner, kind)
    rows = [[a, s, k] + d for a, s, k, d in zip(out.accepted, out.successors, out.verify_lens, out.drafts)]
    return torch.tensor(rows), runner, batch, kind


def check_section(bench: Bench, drafter, n: int, ratio: float, result: dict) -> None:
    """Captured == eager for the DFlash 2 steps (same inputs, same caches: the steps write the same K/V)."""
    for mode in ("dflash", "dscale"):
        for sampling in ("greedy", "sampled"):
            eager = step_result(bench, drafter, mode, n, sampling, False, ratio)[0]
            captured = step_result(bench, drafter, mode, n, sampling, True, ratio)[0]
            key = f"captured_equals_eager {mode} {sampling} N={n}"
            result["checks"][key] = bool(torch.equal(eager, captured))
            if not result["checks"][key]:
                result["errors"].append(f"{key}: {(eager != captured).any(1).sum().item()} of {n} rows differ")
            release(bench.device)


def timing_section(bench: Bench, drafters: dict, n: int, args, result: dict) -> None:
    graphs = bench.device.type == "cuda"
    times = {}
    for name, drafter in drafters.items():
        for mode in ("dflash", "dscale"):
            for sampling in ("greedy", "sampled"):
                _, runner, batch, kind = step_result(bench, drafter, mode, n, sampling, graphs, args.ratio)
                timing = time_call(lambda: batch.run(runner, kind), bench.device, args.reps, args.warmup)
                times[f"{name} {mode} {sampling}"] = timing["ms"]
                print(f"  N={n:3d} {name} {mode:6s} {sampling:8s} {timing['ms']:9.3f} ms", flush=True)
                del runner
                release(bench.device)
    ratios = {}
    for sampling in ("greedy", "sampled"):
        one, two = times[f"dflash1 dflash {sampling}"], times[f"dflash2 dflash {sampling}"]
        ratios[f"dflash2/dflash1 {sampling}"] = two / one
        for name in drafters:
            ratios[f"{name} dscale/dflash {sampling}"] = (times[f"{name} dscale {sampling}"]
                                                          / times[f"{name} dflash {sampling}"])
    result["steps"][str(n)] = {"ms": times, "ratios": {k: round(v, 4) for k, v in ratios.items()},
                               "acceptance5_dflash2_within_1.05": ratios["dflash2/dflash1 greedy"] <= 1.05}


def profile_section(bench: Bench, drafters: dict, n: int, args, result: dict, kernels: bool) -> None:
    """Each piece of DFlash 2's drafting alone (see the module docstring), ms per call; `kernels`: also the
    captured steps' device time by kernel name."""
    cuda = bench.device.type == "cuda"
    fast = triton_available()
    if fast and not cuda:  # NOTE: on CPU the Triton pieces run only in the interpreter (TRITON_INTERPRET=1)
        from dscale_runtime.kernels.triton_fused import interpreted

        fast = interpreted()
    out = {}

    def timed(name: str, fn, calls: int = 1) -> None:
        call = GraphedCall(fn, cuda)
        ms = time_call(call, bench.device, args.reps, args.warmup)["ms"]
        out[name] = ms
        per_step = f" (x{calls} per step: {ms * calls:.3f} ms)" if calls > 1 else ""
        print(f"  profile N={n:3d} {name:34s} {ms:8.4f} ms{per_step}", flush=True)
        del call

    hidden = None
    for name, drafter in drafters.items():
        for sampling in ("greedy", "sampled"):
            bench.drafter = drafter
            runner = bench.runner("dflash", args.ratio, False, [n])
            kind = step_kind("dflash", sampling, bench.sampled_rule)
            bench.batch(n, sampling).run(runner, kind)  # NOTE: fills the bucket's buffers
            step = runner.get(n, kind)
            timed(f"draft {name} {sampling}", step.draft)
            if name == "dflash2":
                hidden = step.draft()[2].clone()  # [N, W-1, d]
            del runner, step
            release(bench.device)
    d2, target = drafters["dflash2"], bench.target
    sel = d2.candidate_selector
    k, w = sel.top_k, BLOCK
    timed("lm head [N*(W-1), V]", lambda: d2.head_logits(hidden, target))
    logits = d2.head_logits(hidden, target)
    timed("argmax (dflash1)", lambda: logits.argmax(dim=-1))
    timed(f"torch.topk({k})", lambda: logits.topk(k, dim=-1))
    if fast:
        timed(f"triton top-{k}", lambda: candidate_topk(logits, k, "triton"))
    unary, candidates = candidate_topk(logits, k, "ref")
    gen = torch.Generator(device=bench.device).manual_seed(3)
    anchors = torch.randint(0, bench.shape.vocab, (n,), device=bench.device, generator=gen)
    temperature = torch.ones(n, device=bench.device)
    draw = torch.ones(n, dtype=torch.bool, device=bench.device)
    uniforms = torch.rand(n, w - 1, generator=gen, device=bench.device, dtype=torch.float64)
    sampled = (temperature, draw, uniforms)
    with torch.no_grad():
        for backend in ("ref", "triton") if fast else ("ref",):
            label = "torch" if backend == "ref" else "triton"
            timed(f"walk {label} greedy", lambda: sel.walk(hidden, unary, candidates, anchors, backend=backend))
            timed(f"walk {label} sampled", lambda: sel.walk(hidden, unary, candidates, anchors, *sampled,
                                                            backend=backend))
        conv, layers = d2.layers[0].attention_conv, len(d2.layers)
        x = torch.randn(n * w, bench.shape.hidden, device=bench.device, generator=gen).to(bench.dtype)
        dynamic = conv.kernel_projection(x).view(n, w, 2, conv.kernel_size, conv.groups)[:, :, 0]
        timed("conv tap projection", lambda: conv.kernel_projection(x), 2 * layers)
        timed(f"conv {conv.kernels.fused}", lambda: block_convolve(x, dynamic, conv.base_kernel[0], conv.group_size,
                                                                  conv.kernels.fused), 4 * layers)
    walk = "triton" if fast else "torch"
    select = out.get(f"triton top-{k}", out[f"torch.topk({k})"]) - out["argmax (dflash1)"]
    convs = 2 * layers * out["conv tap projection"] + 4 * layers * out[f"conv {conv.kernels.fused}"]
    for sampling in ("greedy", "sampled"):
        out[f"extra {sampling}"] = round(select + out[f"walk {walk} {sampling}"] + convs, 4)
        print(f"  profile N={n:3d} extra {sampling}: top-k - argmax {select:.4f} + walk "
              f"{out[f'walk {walk} {sampling}']:.4f} + convolutions {convs:.4f} = {out[f'extra {sampling}']:.4f} ms "
              f"(draft dflash2 - dflash1: {out[f'draft dflash2 {sampling}'] - out[f'draft dflash1 {sampling}']:.4f})",
              flush=True)
    if kernels and cuda:
        out["kernels"] = kernel_diff(bench, drafters, n, args)
    result.setdefault("profile", {})[str(n)] = out
    del logits, hidden
    release(bench.device)


def kernel_diff(bench: Bench, drafters: dict, n: int, args, reps: int = 5) -> dict:
    """The captured DFlash steps (greedy) of both drafters under torch.profiler: ms per step by kernel name, the
    launches per step, and the 15 kernels whose time differs most (DFlash 2 - DFlash 1)."""
    from torch.profiler import ProfilerActivity, profile

    per = {}
    for name, drafter in drafters.items():
        _, runner, batch, kind = step_result(bench, drafter, "dflash", n, "greedy", True, args.ratio)
        for _ in range(3):
            batch.run(runner, kind)
        sync(bench.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                batch.run(runner, kind)
            sync(bench.device)
        per[name] = {e.key: (e.device_time_total / 1e3 / reps, e.count // reps) for e in prof.key_averages()
                     if e.device_time_total > 0}
        del runner
        release(bench.device)
    names = set(per["dflash1"]) | set(per["dflash2"])
    diff = sorted(((k, per["dflash2"].get(k, (0, 0))[0] - per["dflash1"].get(k, (0, 0))[0],
                    per["dflash1"].get(k, (0, 0))[1], per["dflash2"].get(k, (0, 0))[1]) for k in names),
                  key=lambda t: -abs(t[1]))
    out = {f"{name} total_ms": round(sum(v[0] for v in p.values()), 4) for name, p in per.items()}
    out.update({f"{name} launches": sum(v[1] for v in p.values()) for name, p in per.items()})
    out["top_differences"] = [{"kernel": k[:120], "ms": round(ms, 4), "calls dflash1": c1, "calls dflash2": c2}
                              for k, ms, c1, c2 in diff[:15]]
    print(f"  kernels N={n}: dflash1 {out['dflash1 total_ms']:.3f} ms / {out['dflash1 launches']} launches, "
          f"dflash2 {out['dflash2 total_ms']:.3f} ms / {out['dflash2 launches']} launches per step", flush=True)
    for row in out["top_differences"]:
        print(f"    {row['ms']:+8.4f} ms  x{row['calls dflash1']}->{row['calls dflash2']}  {row['kernel'][:90]}",
              flush=True)
    return out


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shape, eager, few reps (CPU smoke run)")
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--ns", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--ratio", type=float, default=0.5, help="DScale's budget ratio")
    parser.add_argument("--conv-kernel-size", type=int, default=4)
    parser.add_argument("--conv-group-size", type=int, default=128)
    parser.add_argument("--selector-rank", type=int, default=256)
    parser.add_argument("--selector-top-k", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="the profile section (module docstring) per N")
    parser.add_argument("--no-check", action="store_true", help="skip the captured == eager check")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape, args.ns, args.context, args.reps, args.warmup = "tiny", [1, 3], 40, 2, 1
        args.conv_group_size, args.selector_rank, args.selector_top_k = 16, 8, 4
    return args


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = {"config": vars(args).copy(), "checks": {}, "steps": {}, "errors": []}
    t0 = time.perf_counter()
    with benchmark_settings(args.device, args.tiny):
        dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        bench = Bench(SHAPES[args.shape], args.device, dtype, max(args.ns), args.context)
        drafters = {"dflash1": bench.drafter, "dflash2": build_dflash2(bench, args)}
        sync(bench.device)
        for n in args.ns:
            if bench.device.type == "cuda" and not args.no_check:  # NOTE: the CPU has no graphs: eager steps only
                check_section(bench, drafters["dflash2"], n, args.ratio, result)
            timing_section(bench, drafters, n, args, result)
            if args.profile:
                profile_section(bench, drafters, n, args, result, kernels=n == max(args.ns))
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"checks": result["checks"], "ratios": {n: s["ratios"] for n, s in result["steps"].items()},
                      "errors": result["errors"], "seconds": result["seconds"]}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
