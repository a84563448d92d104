"""The DFlash 2 decode step beside DFlash 1 on the GPU, through the engine's step runner (issue 26, acceptance 5).

One process, random bf16 weights at a `gpu_step.py` shape (Qwen3-8B by default): the target and the caches of
`gpu_step.Bench`, its DFlash 1 drafter, and a DFlash 2 drafter of the same shape in z-lab's `DFlash2DraftModel`
layout (`--conv-kernel-size`, `--conv-group-size`, `--selector-rank`: 256 is a 78 MB bf16 codebook at Qwen3's
vocabulary, `--selector-top-k`), random weights too. Per N (`--ns`, default 8 16 32), in a bucket of exactly N,
captured on CUDA (eager elsewhere):
- check: for DFlash 2 greedy and sampled (T = 1, sampled drafts), the captured step's results (accepted counts,
  successors, verify lengths, block tokens) equal the eager step's over the same inputs; a mismatch is an error;
- timing: DFlash 1 and DFlash 2 steps, DScale over each (budget `--ratio`), greedy and all rows sampled, in
  `--rounds` interleaved rounds (medians, and the per-round ratios' range); the
  ratios `dflash2 / dflash1` (acceptance 5: <= 1.05 at N = 8, 16, 32) and `dscale/dflash` of each drafter;
  `--candidate-chunks C` adds DFlash 2 with its candidates' top-k over C vocabulary slices (`dflash2-cC`; 1: one
  torch.topk, the top-k before the sliced one became the default); `--conv-kernel tile` adds DFlash 2 with the
  per-block-tile convolution kernel (`dflash2-tile`) and times both convolution kernels alone; `--topk-kernel
  triton` adds DFlash 2 with the one-launch top-k after the slice maxima (`dflash2-topk`); `--decision-kernels`
  adds both steps with the step's Triton kernels (`KernelChoice.decision`: `dflash-k`, `dscale-k`: metadata,
  acceptance and result rows, state; DScale's agreement columns, conditionals, allocation and flat pack), checked
  against the reference steps, and the ratio `dscale-k/dflash-k`;
- `--profile`: both drafters' captured greedy DFlash steps by kernel (`gpu_step.kernel_table`), and the kernels
  whose time differs most between them.

    python benchmarks/dflash2_step.py --profile --out $OUT/dflash2_step.json   # H200, ~2 min
    python benchmarks/dflash2_step.py --device cpu --tiny --out /tmp/d2.json    # same code, tiny, eager, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_step import BLOCK, SHAPES, Bench, benchmark_settings, kernel_table, qwen3_config, random_init, release, \
    step_kind, sync, time_call  # noqa: E402
from dscale_runtime.models.config import DFlash2Config, DFlashConfig  # noqa: E402
from dscale_runtime.models.dflash2 import DFlash2DraftModel  # noqa: E402


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


CHUNKS: dict[str, int] = {}  # DFlash 2 drafter name -> its candidates' top-k slices (`candidate_chunks`)
CONV: dict[str, str] = {}  # DFlash 2 drafter name -> its convolution kernel (`triton_conv.CONV_KERNEL`)
TOPK: dict[str, str] = {}  # DFlash 2 drafter name -> its top-k after the slice maxima (`triton_conv.TOPK_KERNEL`)
MODES = ["dflash", "dscale"]  # + 'dflash-k', 'dscale-k' with --decision-kernels


def use_drafter(bench: Bench, drafter, name: str) -> None:
    """The bench's drafter for the next runner: `name`'s module with `name`'s top-k slices, top-k kernel and
    convolution kernel (read when its steps are built: a captured step keeps them)."""
    if name in CHUNKS:
        drafter.candidate_chunks = CHUNKS[name]
    if name in CONV:
        from dscale_runtime.kernels import triton_conv

        triton_conv.CONV_KERNEL = CONV[name]
    if name in TOPK:
        from dscale_runtime.kernels import triton_conv

        triton_conv.TOPK_KERNEL = TOPK[name]
    bench.drafter = drafter


def conv_section(bench: Bench, args, result: dict) -> None:
    """The convolution alone at the drafter's width, per N: both Triton kernels ('row', 'tile') on [N * W, d]
    block rows, their outputs compared bit for bit, each timed over 20 calls (a step's convolutions)."""
    from dscale_runtime.kernels.triton_conv import block_convolve_triton

    d, taps, group = bench.shape.hidden, args.conv_kernel_size, args.conv_group_size
    gen = torch.Generator(device=bench.device).manual_seed(3)
    section = result.setdefault("conv", {})
    for n in args.ns:
        x = torch.randn(n * BLOCK, d, device=bench.device, generator=gen).to(bench.dtype)
        dynamic = torch.randn(n, BLOCK, 2, taps, d // group, device=bench.device, generator=gen).to(bench.dtype)
        dynamic = dynamic[:, :, 0]
        base = torch.randn(taps, d, device=bench.device, generator=gen).to(bench.dtype)
        outs, ms = {}, {}
        for kernel in ("row", "tile"):
            outs[kernel] = block_convolve_triton(x, dynamic, base, group, kernel=kernel)
            ms[kernel] = time_call(lambda: [block_convolve_triton(x, dynamic, base, group, kernel=kernel)
                                            for _ in range(20)], bench.device, args.reps, args.warmup)["ms"]
        equal = bool(torch.equal(outs["row"], outs["tile"]))
        if not equal:
            result["errors"].append(f"conv N={n}: the tile kernel differs from the row kernel")
        section[str(n)] = {"ms_per_20": ms, "tile_over_row": round(ms["tile"] / ms["row"], 4), "equal": equal}
        print(f"  N={n:3d} 20 convolutions: row {ms['row']:.4f} ms, tile {ms['tile']:.4f} ms "
              f"({ms['tile'] / ms['row']:.3f}x), equal {equal}", flush=True)


def step_result(bench: Bench, drafter, mode: str, n: int, sampling: str, graphs: bool, ratio: float,
                name: str = ""):
    """One step's result tensor [n, 4 + W] on the host, and the runner (its first call builds the step). Modes
    'dflash-k', 'dscale-k': the step with the step's Triton kernels (`KernelChoice.decision`); beside them the plain
    modes take the torch reference (`decision='ref'`; without `--decision-kernels`, the served choice)."""
    use_drafter(bench, drafter, name)
    runner = bench.runner(mode.removesuffix("-k"), ratio, graphs, [n])
    if "dflash-k" in MODES:  # NOTE: beside the `-k` steps the plain ones are the torch reference's
        runner.decision_backend = "triton" if mode.endswith("-k") else "ref"
    mode = mode.removesuffix("-k")
    batch, kind = bench.batch(n, sampling), step_kind(mode, sampling, bench.sampled_rule)
    out = batch.run(runner, kind)
    rows = [[a, s, k] + d for a, s, k, d in zip(out.accepted, out.successors, out.verify_lens, out.drafts)]
    return torch.tensor(rows), runner, batch, kind


def check_section(bench: Bench, drafter, n: int, ratio: float, result: dict, name: str = "dflash2") -> None:
    """Captured == eager for the DFlash 2 steps (same inputs, same caches: the steps write the same K/V); with
    --decision-kernels, also each eager step with the step's Triton kernels == the reference step's."""
    suffix = "" if name == "dflash2" else f" {name}"
    eagers = {}
    for mode in MODES:
        for sampling in ("greedy", "sampled"):
            eager = eagers[mode, sampling] = step_result(bench, drafter, mode, n, sampling, False, ratio, name)[0]
            captured = step_result(bench, drafter, mode, n, sampling, True, ratio, name)[0]
            key = f"captured_equals_eager {mode} {sampling} N={n}" + suffix
            result["checks"][key] = bool(torch.equal(eager, captured))
            if not result["checks"][key]:
                result["errors"].append(f"{key}: {(eager != captured).any(1).sum().item()} of {n} rows differ")
            release(bench.device)
    for mode in [m for m in MODES if m.endswith("-k")]:
        for sampling in ("greedy", "sampled"):
            key = f"decision_kernels_equal_reference {mode} {sampling} N={n}" + suffix
            plain = mode.removesuffix("-k")
            result["checks"][key] = bool(torch.equal(eagers[plain, sampling], eagers[mode, sampling]))
            if not result["checks"][key]:
                result["errors"].append(key)


def timing_section(bench: Bench, drafters: dict, n: int, args, result: dict) -> None:
    """Every step of this N (both drafters, DFlash and DScale, greedy and sampled) built first, then timed in
    `--rounds` interleaved rounds (each round starts one step later), `--reps` calls each: drift of the machine
    falls on every step alike. Times: the median over the rounds; ratios: the median of the per-round ratios,
    with their range (`spread`)."""
    graphs = bench.device.type == "cuda"
    steps = {}
    for name, drafter in drafters.items():
        for mode in MODES:
            for sampling in ("greedy", "sampled"):
                _, runner, batch, kind = step_result(bench, drafter, mode, n, sampling, graphs, args.ratio, name)
                steps[f"{name} {mode} {sampling}"] = (runner, batch, kind)
    keys, rounds = list(steps), []
    for r in range(args.rounds):
        times = {}
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            runner, batch, kind = steps[key]
            times[key] = time_call(lambda: batch.run(runner, kind), bench.device, args.reps, args.warmup)["ms"]
        rounds.append(times)
    pairs = {}
    for sampling in ("greedy", "sampled"):
        for name in drafters:
            if name != "dflash1":
                pairs[f"{name}/dflash1 {sampling}"] = (f"{name} dflash {sampling}", f"dflash1 dflash {sampling}")
        for name in drafters:
            for mode in MODES[1:]:
                pairs[f"{name} {mode}/dflash {sampling}"] = (f"{name} {mode} {sampling}", f"{name} dflash {sampling}")
            if "dscale-k" in MODES:
                pairs[f"{name} dscale-k/dflash-k {sampling}"] = (f"{name} dscale-k {sampling}",
                                                                 f"{name} dflash-k {sampling}")
    median = lambda xs: float(statistics.median(xs))  # noqa: E731
    ms = {key: round(median([t[key] for t in rounds]), 4) for key in keys}
    ratios, spread = {}, {}
    for label, (a, b) in pairs.items():
        per_round = [t[a] / t[b] for t in rounds]
        ratios[label], spread[label] = round(median(per_round), 4), [round(min(per_round), 4),
                                                                      round(max(per_round), 4)]
    for key in keys:
        print(f"  N={n:3d} {key:28s} {ms[key]:9.3f} ms  (rounds {min(t[key] for t in rounds):.3f}-"
              f"{max(t[key] for t in rounds):.3f})", flush=True)
    for label in pairs:
        print(f"  N={n:3d} {label:32s} {ratios[label]:.4f}  [{spread[label][0]:.4f}-{spread[label][1]:.4f}]",
              flush=True)
    result["steps"][str(n)] = {"ms": ms, "ratios": ratios, "spread": spread, "rounds": rounds,
                               "acceptance5_dflash2_within_1.05": ratios["dflash2/dflash1 greedy"] <= 1.05}
    del steps
    release(bench.device)


def kernel_diff(a: dict, b: dict, top: int = 25) -> list[dict]:
    """Kernels whose time per step differs most from table `a` to table `b` (ms and calls, b - a)."""
    diff = sorted(((k, b.get(k, [0.0, 0])[0] - a.get(k, [0.0, 0])[0], b.get(k, [0, 0])[1] - a.get(k, [0, 0])[1])
                   for k in set(a) | set(b)), key=lambda d: -abs(d[1]))
    return [{"kernel": k, "ms": round(ms, 4), "calls": c} for k, ms, c in diff[:top]]


def profile_section(bench: Bench, drafters: dict, n: int, args, result: dict, reps: int = 5) -> None:
    """Where DFlash 2's extra step time goes: each drafter's greedy DFlash and DScale steps (captured on CUDA)
    profiled by kernel name (`gpu_step.kernel_table`); the kernels whose time per step differs most from DFlash 1's
    DFlash step to DFlash 2's, and from each drafter's DFlash step to its DScale step (what DScale adds or saves
    over each drafter)."""
    graphs = bench.device.type == "cuda"
    tables = {}
    modes = [m for m in ("dflash", "dscale", "dflash-k", "dscale-k") if m in MODES]
    for name, drafter in drafters.items():
        for mode in modes:
            _, runner, batch, kind = step_result(bench, drafter, mode, n, "greedy", graphs, args.ratio, name)
            for _ in range(3):
                batch.run(runner, kind)
            tables[f"{name} {mode}"] = kernel_table(lambda: batch.run(runner, kind), bench.device, reps)
            del runner
            release(bench.device)
    diffs = {"dflash2_minus_dflash1": kernel_diff(tables["dflash1 dflash"]["all"], tables["dflash2 dflash"]["all"])}
    for name in ("dflash1", "dflash2"):
        diffs[f"{name}_dscale_minus_dflash"] = kernel_diff(tables[f"{name} dflash"]["all"],
                                                           tables[f"{name} dscale"]["all"])
        for mode in [m for m in modes if m.endswith("-k")]:  # NOTE: what the step's kernels remove from each step
            plain = mode.removesuffix("-k")
            diffs[f"{name}_{mode}_minus_{plain}"] = kernel_diff(tables[f"{name} {plain}"]["all"],
                                                                tables[f"{name} {mode}"]["all"])
    result.setdefault("profile", {})[str(n)] = {
        **{name: {k: v for k, v in t.items() if k != "all"} for name, t in tables.items()}, **diffs}
    print(f"  N={n:3d} profile: " + ", ".join(f"{name} {t['total_ms']:.3f} ms in {t['launches']} launches"
                                              for name, t in tables.items()), flush=True)
    for key, rows in diffs.items():
        print(f"    {key}:", flush=True)
        for row in rows[:12]:
            print(f"    {row['ms']:+8.4f} ms {row['calls']:+4d} calls  {row['kernel'][:100]}", flush=True)


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
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved timing rounds per N (`--reps` calls per step each round)")
    parser.add_argument("--candidate-chunks", type=int, default=0,
                        help=">= 1: also time DFlash 2 with its candidates' top-k over this many vocabulary slices "
                             "(`dflash2-cC`; 1 = one torch.topk; the default is candidate_chunks(V, k): 1,187 at "
                             "Qwen3's vocabulary)")
    parser.add_argument("--topk-kernel", choices=("torch", "triton"), default="torch",
                        help="triton: also time DFlash 2 with the one-launch top-k after the slice maxima "
                             "(`dflash2-topk`)")
    parser.add_argument("--conv-kernel", choices=("row", "tile"), default="row",
                        help="tile: also time DFlash 2 with the per-block-tile convolution kernel (`dflash2-tile`) "
                             "and both kernels alone (CUDA)")
    parser.add_argument("--decision-kernels", action="store_true",
                        help="also time both steps with the step's Triton kernels (modes `dflash-k`, `dscale-k`; "
                             "KernelChoice.decision='triton'), checked against the reference steps")
    parser.add_argument("--profile", action="store_true",
                        help="also profile both drafters' greedy DFlash and DScale steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.shape, args.ns, args.context, args.reps, args.warmup, args.rounds = "tiny", [1, 3], 40, 2, 1, 2
        args.conv_group_size, args.selector_rank, args.selector_top_k = 16, 8, 4
    return args


def main(argv=None) -> dict:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = {"config": vars(args).copy(), "checks": {}, "steps": {}, "errors": []}
    t0 = time.perf_counter()
    with benchmark_settings(args.device, args.tiny):
        dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
        bench = Bench(SHAPES[args.shape], args.device, dtype, max(args.ns), args.context)
        MODES[:] = ["dflash", "dscale"] + (["dflash-k", "dscale-k"] if args.decision_kernels else [])
        drafters = {"dflash1": bench.drafter, "dflash2": build_dflash2(bench, args)}
        CHUNKS["dflash2"] = drafters["dflash2"].candidate_chunks  # NOTE: the drafter's default (`candidate_chunks`)
        if args.conv_kernel == "tile":  # NOTE: the same module, the other convolution kernel
            drafters["dflash2-tile"] = drafters["dflash2"]
            CONV["dflash2"], CONV["dflash2-tile"] = "row", "tile"
            if bench.device.type == "cuda":
                conv_section(bench, args, result)
        if args.topk_kernel == "triton":  # NOTE: the same module, the other top-k after the slice maxima
            drafters["dflash2-topk"] = drafters["dflash2"]
            TOPK["dflash2"], TOPK["dflash2-topk"] = "torch", "triton"
        if args.candidate_chunks > 0:  # NOTE: the same module, another top-k setting
            drafters[f"dflash2-c{args.candidate_chunks}"] = drafters["dflash2"]
            CHUNKS[f"dflash2-c{args.candidate_chunks}"] = args.candidate_chunks
        sync(bench.device)
        for n in args.ns:
            if bench.device.type == "cuda":  # NOTE: the CPU has no graphs: its steps are the eager ones
                for name, drafter in drafters.items():
                    if name != "dflash1":
                        check_section(bench, drafter, n, args.ratio, result, name)
            timing_section(bench, drafters, n, args, result)
            if args.profile:
                profile_section(bench, drafters, n, args, result)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({"checks": result["checks"], "ratios": {n: s["ratios"] for n, s in result["steps"].items()},
                      "errors": result["errors"]}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
