"""The decode step on the GPU, timed through the engine's own step runner: DFlash vs DScale at Qwen3-8B / 4B
shapes (issues 8 and 15).

Random bf16 weights made on the device (our model classes, no checkpoints), paged KV caches filled with random
values (~`--context` tokens per request on scattered pages), and a `StepRunner` over them built with the
engine's constructor (`dscale_runtime/runner.py`). N synthetic requests (random anchors) fill a bucket's
buffers; what is timed is what the engine runs: `StepRunner.run` (fill, the step of `runner.get(size, kind)`,
captured on CUDA, and the one host read), CUDA-event medians. DScale's budget is the engine's:
M_live = budget_rows(N, W, ratio), a bucket's fixed height budget_rows(B, W, ratio). Kernel paths are
`KernelChoice`s given to the models with `use_kernels` (served: `KernelChoice.resolve`, as the loader does).

Per shape and N, in a bucket of exactly N:
- step: the complete step per variant. DFlash greedy: eager with reference attention, captured with reference
  attention / the 128-row tile / the served kernels (`dflash_best`: the fastest captured); DScale greedy:
  +DVL (r = 0.5, reference attention, eager), +tiles (served kernels, eager), +graphs (captured), then the
  captured step at every other `--ratios`; target-only (W = 1) greedy and sampled; DFlash and DScale with every
  row sampled at T = 1 ("sampled"), with odd rows sampled, even rows greedy ("mixed", marked at <= 1.05 x
  greedy) and the same with top_p 0.8 on the sampled rows ("mixed_top_p", the filtered kind); `--sampled-rule` picks the speculative rows' rule (default: sampled drafts, the engine's auto rule
  at T = 1);
- decision: `BucketStep.decide` eager vs captured, replay == eager, no host synchronisation in either, and its
  parts one by one;
- verify: `BucketStep.verify` (target over the M rows incl. the LM head, acceptance, drafter injection) at full
  width and at r = 0.5, per attention path, eager vs captured, against the roofline floor;
- draft: `BucketStep.draft` per attention path, eager vs captured;
- profile (only when named): device time by kernel name in the captured DFlash and DScale steps.
Per shape, over N = 1 .. `--max-n` (only when named):
- buckets: the captured greedy DFlash and DScale steps padded into `default_buckets(max_n)` and in a bucket of
  exactly N, with the capture time and graph-pool memory of each `StepRunner.prepare`.

    python benchmarks/gpu_step.py --shapes qwen3-8b --out $OUT/gpu_step.json          # H200, ~4 min
    python benchmarks/gpu_step.py --shapes qwen3-8b --sections buckets --out $OUT/buckets.json   # ~3 min
    python benchmarks/gpu_step.py --device cpu --tiny --out /tmp/s.json   # same code, tiny, eager, CPU
    python benchmarks/gpu_step.py project --step-times gpu_step.json --traces traces/demo \\
        --predictor artifacts/demo.pt --out projection.json            # projected throughput (CPU side)

Every section is guarded: a failure is recorded under `errors` and the run goes on; results are written
after every section, and sections past `--time-budget` seconds are skipped (recorded as such).
NOTE: one file over 400 lines: every section shares the bench, the timing and the output, and the CLI runs
on the GPU image, which lacks jsonargparse (hence argparse).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dscale_runtime.dvl.allocate import allocate
from dscale_runtime.dvl.features import FeatureSpec, context_features, hidden_projection
from dscale_runtime.dvl.predictor import AcceptancePredictor, seed_lengths
from dscale_runtime.graphs import GraphedCall, collect_garbage, cuda_times
from dscale_runtime.kernels import KernelChoice
from dscale_runtime.kv_cache import PagedKVCache
from dscale_runtime.models.config import DFlashConfig, Qwen3Config
from dscale_runtime.models.dflash import DFlashDraftModel
from dscale_runtime.models.qwen3 import Qwen3ForCausalLM
from dscale_runtime.runner import RULE_GREEDY, RULE_SAMPLED, RULE_TOP1, StepKind, StepRunner, default_buckets
from dscale_runtime.sampling import split_seed

BLOCK = 16
RATIOS = (0.5, 0.625, 0.75, 1.0)


@dataclass(frozen=True)
class ModelShape:
    """A target + drafter pair's shape (random weights of it are benchmarked)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    draft_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int


SHAPES = {
    "qwen3-8b": ModelShape(4096, 12288, 36, 32, 8, 128, 151936, False, 5, (1, 9, 17, 25, 33), 151669),
    "qwen3-4b": ModelShape(2560, 9728, 36, 32, 8, 128, 151936, True, 5, (1, 9, 17, 25, 33), 151669),
    # The shipped demo pair's shape (artifacts/demo): launch-bound steps, a 4,096-token vocabulary.
    "demo": ModelShape(384, 1024, 8, 6, 2, 64, 4096, True, 3, (1, 3, 5), 1),
    # CPU smoke shape: a 5-token vocabulary makes random drafts match the target often enough to test acceptance.
    "tiny": ModelShape(64, 128, 4, 4, 2, 16, 5, False, 2, (1, 3), 4),
}


# ----------------------------------------------------------------------------------------------- models
def qwen3_config(shape: ModelShape, layers: int) -> Qwen3Config:
    return Qwen3Config(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                       vocab_size=shape.vocab, tie_word_embeddings=shape.tied, rope_theta=1_000_000.0)


def random_init(module: torch.nn.Module, device, dtype, std: float, gen: torch.Generator) -> torch.nn.Module:
    """Materialise a meta-device module on `device` in `dtype`: norms 1, every other weight N(0, std)."""
    module = module.to(dtype).to_empty(device=device).requires_grad_(False)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return module


def build_models(shape: ModelShape, device, dtype, kernels: KernelChoice, seed: int = 0):
    """Target and drafter with random weights through `kernels`, laid out as the engine loads them (fused
    projections on CUDA)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    std = 0.02 if shape.hidden >= 1024 else 0.2
    with torch.device("meta"):
        target = Qwen3ForCausalLM(qwen3_config(shape, shape.layers), kernels)
        dcfg = DFlashConfig(qwen3_config(shape, shape.draft_layers), BLOCK, shape.mask_token_id,
                            shape.target_layer_ids, shape.layers)
        drafter = DFlashDraftModel(dcfg, kernels)
    target = random_init(target, device, dtype, std, gen).eval()
    drafter = random_init(drafter, device, dtype, std, gen).eval()
    if shape.tied:  # NOTE: materialising a meta module unties shared parameters; tie them again
        target.lm_head.weight = target.model.embed_tokens.weight
    if torch.device(device).type == "cuda":
        target.fuse_projections()
        drafter.fuse_projections()
    drafter.head_weight(target.lm_head.weight)  # NOTE: as the engine does, before any capture
    return target, drafter


def random_predictor(spec: FeatureSpec, device, seed: int = 0) -> AcceptancePredictor:
    """A predictor of the artifact's shape (224, 128 hidden units) with seeded random weights."""
    torch.manual_seed(seed)
    return AcceptancePredictor(spec, (224, 128)).to(device).eval().requires_grad_(False)


def fit_normalisation(predictor: AcceptancePredictor, features: torch.Tensor) -> None:
    """Standardise by these features so random weights give spread-out scores (ragged verify lengths)."""
    with torch.no_grad():
        predictor.norm_mean.copy_(features.float().mean(0))
        std = features.float().std(0, correction=0) if features.shape[0] > 1 else torch.ones_like(features[0])
        predictor.norm_std.copy_(torch.nan_to_num(std, nan=1.0).clamp_min(1e-3))


FILTER_TOP_P = 0.8  # 'mixed_top_p': the filtered kind of issue 25 (odd rows at T = 1, top_p 0.8)


def step_kind(mode: str, sampling: str = "greedy", rule: int = RULE_SAMPLED) -> StepKind:
    """The kind `Engine._step_kind` picks for a batch: greedy, or some rows sampled by `rule` (top_p only in
    'mixed_top_p')."""
    if sampling == "greedy":
        return StepKind(mode)
    return StepKind(mode, sampled=True, filtered=sampling == "mixed_top_p",
                    draft_sampling=mode != "target" and rule == RULE_SAMPLED)


@dataclass
class Batch:
    """One step's inputs of n synthetic requests, as `StepRunner.run` takes them."""

    anchors: list[int]
    ctx: list[int]
    pages: list[list[int]]
    sampling: list[tuple]  # (seed_lo, seed_hi, top_k, rule, temperature, top_p) per request
    context: np.ndarray  # [n, num_context] batch context features

    def run(self, runner: StepRunner, kind: StepKind):
        return runner.run(self.anchors, self.ctx, self.pages, self.sampling, kind, self.context)


class Bench:
    """One shape's models, caches, page layout (room for `max_n` requests of `context` + W tokens) and runners."""

    def __init__(self, shape: ModelShape, device, dtype, max_n: int, context: int, page_size: int = 16,
                 seed: int = 0, sampled_rule: int = RULE_SAMPLED) -> None:
        self.shape, self.device, self.dtype, self.page_size = shape, torch.device(device), dtype, page_size
        self.served = KernelChoice.resolve(self.device, dtype)
        self.target, self.drafter = build_models(shape, device, dtype, self.served, seed)
        gen = torch.Generator().manual_seed(seed)
        self.ctx = (context - torch.randint(0, 17, (max_n,), generator=gen)).clamp_min(1).tolist()  # "~context"
        self.max_pages = -(-(context + BLOCK) // page_size)
        num_pages = max_n * self.max_pages + 1
        order = torch.randperm(num_pages - 1, generator=gen) + 1  # scattered pages; page 0 = scratch
        self.tables = order.view(max_n, self.max_pages).tolist()
        self.target_cache = PagedKVCache(shape.layers, num_pages, page_size, shape.kv_heads, shape.head_dim, dtype,
                                         device)
        self.drafter_cache = PagedKVCache(shape.draft_layers, num_pages, page_size, shape.kv_heads, shape.head_dim,
                                          dtype, device)
        dgen = torch.Generator(device=device).manual_seed(seed + 1)
        for cache in (self.target_cache, self.drafter_cache):
            cache.k.normal_(0.0, 1.0, generator=dgen)
            cache.v.normal_(0.0, 1.0, generator=dgen)
        self.spec = FeatureSpec(num_positions=BLOCK - 1)
        self.projection = hidden_projection(self.spec, shape.hidden).to(device)
        self.predictor = random_predictor(self.spec, device, seed)
        self.anchors = torch.randint(0, shape.vocab, (max_n,), generator=gen).tolist()
        self.sampled_rule = sampled_rule

    def use_kernels(self, kernels: KernelChoice) -> None:
        """Both models through `kernels` from now on (steps captured before keep what they captured)."""
        self.target.use_kernels(kernels)
        self.drafter.use_kernels(kernels)

    def kernels(self, attention: str | None) -> KernelChoice:
        """The served choice, or with reference attention ('ref') or the 128-row tile forced ('tile128')."""
        if attention is None:
            return self.served
        if attention == "ref":
            return dataclasses.replace(self.served, attention="ref", attention_tile=None)
        assert attention.startswith("tile")
        return dataclasses.replace(self.served, attention="triton", attention_tile=int(attention[4:]))

    def runner(self, mode: str, ratio: float = 0.5, graphs: bool = False, buckets: list[int] | None = None,
               predictor: AcceptancePredictor | None = None, measured: bool = False,
               ring: bool | None = None) -> StepRunner:
        """The engine's runner over these models and caches (DScale always decides: full_width_max_batch 0,
        unless `measured`: the engine's default policy, timed per bucket at this bench's context). `ring`: keep
        the v3 features' token ring (default: as the engine, in DScale runners only)."""
        speculative = mode != "target"
        buckets = buckets or [len(self.ctx)]
        return StepRunner(
            self.target, self.drafter if speculative else None, self.target_cache.layers,
            self.drafter_cache.layers if speculative else None, mode=mode, block_size=BLOCK,
            max_batch=max(buckets), max_pages=self.max_pages, page_size=self.page_size, budget_ratio=ratio,
            full_width_max_batch=0, feature_spec=self.spec, predictor=predictor or self.predictor,
            projection=self.projection, buckets=buckets, use_graphs=graphs, device=self.device,
            measured_policy=measured, policy_context=int(statistics.median(self.ctx)),
            token_ring=mode == "dscale" if ring is None else ring)

    def batch(self, n: int, sampling: str = "greedy") -> Batch:
        """The first n requests; 'sampled': every row at T = 1, 'mixed': odd rows at T = 1, even rows greedy,
        'mixed_top_p': odd rows at T = 1 with top_p 0.8, even rows greedy."""
        rows = []
        for i in range(n):
            sampled = sampling == "sampled" or (sampling in ("mixed", "mixed_top_p") and i % 2 == 1)
            rule = RULE_GREEDY if not sampled else self.sampled_rule
            top_p = FILTER_TOP_P if sampled and sampling == "mixed_top_p" else 1.0
            rows.append((*split_seed(1000 + i), -1, rule, 1.0, top_p))
        context = context_features(self.spec, n, self.ctx[:n], [100] * n, [[7, 2, 5, 3]] * n, "cpu").numpy()
        return Batch(self.anchors[:n], self.ctx[:n], self.tables[:n], rows, context)

    def target_batch(self, batch: Batch) -> Batch:
        """The same batch for target-only decoding (its sampled rows take the top-1 rule)."""
        rows = [(*s[:3], RULE_TOP1 if s[3] != RULE_GREEDY else RULE_GREEDY, *s[4:]) for s in batch.sampling]
        return dataclasses.replace(batch, sampling=rows)

    def linear_params(self) -> int:
        """Parameters read by a verify forward: every target layer and the LM head (not the embedding table)."""
        layers = sum(p.numel() for p in self.target.model.layers.parameters())
        return layers + self.target.lm_head.weight.numel() + self.target.model.norm.weight.numel()


# ----------------------------------------------------------------------------------------------- timing
def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def release(device) -> None:
    """Free what dropped runners held (a step and its graph form a reference cycle: collect first) once they hold
    a tenth of the GPU's memory: a full collection costs ~0.2 s in a large process (the GPU suite's)."""
    if torch.device(device).type != "cuda":
        return
    if torch.cuda.memory_reserved(device) > 0.1 * torch.cuda.get_device_properties(device).total_memory:
        collect_garbage(device)


def time_call(fn, device, reps: int, warmup: int) -> dict:
    """Median / p10 / p90 milliseconds of `fn()` over `reps` calls (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if torch.device(device).type == "cuda":
        times = cuda_times(fn, reps)
    else:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    q = lambda p: times[min(len(times) - 1, int(p * len(times)))]  # noqa: E731
    return {"ms": round(statistics.median(times), 4), "p10_ms": round(q(0.1), 4), "p90_ms": round(q(0.9), 4),
            "reps": reps}


def ceilings(device, quick: bool) -> dict:
    """Measured bf16 matmul rate (TFLOP/s) and device copy bandwidth (TB/s, bytes read + written)."""
    dev = torch.device(device)
    n = 256 if quick else 8192
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    mm = time_call(lambda: a @ b, dev, 10 if quick else 30, 2 if quick else 5)
    numel = (1 << 16) if quick else (1 << 30)  # 2 GiB of bf16 on the GPU
    src = torch.empty(numel, device=dev, dtype=dtype).normal_()
    dst = torch.empty_like(src)
    cp = time_call(lambda: dst.copy_(src), dev, 10 if quick else 30, 2 if quick else 5)
    return {"matmul_tflops": float(f"{2 * n**3 / (mm['ms'] * 1e-3) / 1e12:.4g}"), "matmul_n": n,
            "copy_tbps": float(f"{2 * src.numel() * src.element_size() / (cp['ms'] * 1e-3) / 1e12:.4g}"),
            "copy_bytes": 2 * src.numel() * src.element_size()}


def roofline(bench: Bench, ctx: torch.Tensor, lens: torch.Tensor, ceil: dict) -> dict:
    """Floor of one verify forward over sum(lens) rows: max(FLOPs / rate, bytes / bandwidth)."""
    s = bench.shape
    lens, ctx = lens.cpu().double(), ctx.cpu().double()
    m = float(lens.sum())
    params = bench.linear_params()
    # attention: QK^T and PV, 2 x 2 x H x D per visible key; row s of a request sees ctx + s + 1 keys
    keys = float((lens * ctx + lens * (lens + 1) / 2).sum())
    flops = 2 * params * m + 4 * s.heads * s.head_dim * keys * s.layers
    elem = 2  # bf16
    kv_read = float(((ctx + lens) * (lens > 0)).sum()) * s.layers * s.kv_heads * s.head_dim * 2 * elem
    logits = m * s.vocab * elem * 2  # logits in the model's dtype written, then read by the argmax
    weight_bytes = params * elem
    bytes_ = weight_bytes + kv_read + logits
    t_compute = flops / (ceil["matmul_tflops"] * 1e12) * 1e3
    t_memory = bytes_ / (ceil["copy_tbps"] * 1e12) * 1e3
    return {"rows": int(m), "gflop": round(flops / 1e9, 1), "weight_gb": round(weight_bytes / 1e9, 3),
            "kv_read_gb": round(kv_read / 1e9, 3), "logits_gb": round(logits / 1e9, 3),
            "compute_ms": round(t_compute, 4), "memory_ms": round(t_memory, 4),
            "floor_ms": round(max(t_compute, t_memory), 4)}


# ----------------------------------------------------------------------------------------------- sections
class Run:
    """Results, errors, the time budget and the output file of one invocation."""

    def __init__(self, args) -> None:
        self.args = args
        self.t0 = time.perf_counter()
        self.result = {"config": vars(args).copy(), "ceilings": None, "shapes": {}, "errors": [], "skipped": [],
                       "env": {"torch": torch.__version__, "device": self._device_name()}}

    def _device_name(self) -> str:
        if torch.device(self.args.device).type == "cuda" and torch.cuda.is_available():
            return torch.cuda.get_device_name()
        return "cpu"

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self, where: str) -> bool:
        if self.elapsed() <= self.args.time_budget:
            return False
        self.result["skipped"].append(where)
        self.log(f"SKIP {where} (time budget {self.args.time_budget}s)")
        return True

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)

    def error(self, where: str, exc: Exception) -> None:
        self.result["errors"].append({"where": where, "error": f"{type(exc).__name__}: {exc}",
                                      "trace": traceback.format_exc(limit=6)})
        self.log(f"FAIL {where}: {type(exc).__name__}: {str(exc)[:300]}")

    def save(self) -> None:
        if not self.args.out:
            return
        out = Path(self.args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        os.replace(tmp, out)

    def section(self, where: str, fn):
        """Run fn(); on failure record the error and go on. Skipped past the time budget."""
        if self.over_budget(where):
            return None
        t = time.perf_counter()
        try:
            out = fn()
            self.log(f"done {where} ({time.perf_counter() - t:.1f}s)")
            return out
        except Exception as exc:  # noqa: BLE001 - report and continue with the next section
            self.error(where, exc)
            return None
        finally:
            release(self.args.device)
            self.save()


@dataclass(frozen=True)
class Variant:
    """One timed step: its kind, budget, kernel path and whether it is captured."""

    name: str
    mode: str  # 'target', 'dflash' or 'dscale'
    ratio: float = 1.0  # DScale's budget ratio
    attention: str | None = None  # None: the served kernels; 'ref': reference attention; 'tile128': forced tile
    graphs: bool = True
    sampling: str = "greedy"  # 'greedy', 'sampled' (every row at T = 1), 'mixed' (odd rows at T = 1), 'mixed_top_p'
    # (odd rows at T = 1 and top_p 0.8)


def step_variants(ratios: list[float], cuda: bool) -> list[Variant]:
    """The step section's variants: on the CPU every one eager through the portable path (the Triton
    interpreter is far too slow for a benchmark), on CUDA the ablations and the captured steps."""
    others = [r for r in ratios if r != 0.5]
    if not cuda:
        return ([Variant("dflash eager ref", "dflash", attention="ref", graphs=False),
                 Variant("dscale +DVL", "dscale", 0.5, "ref", graphs=False)]
                + [Variant(f"dscale eager r{r}", "dscale", r, graphs=False) for r in others]
                + [Variant("target eager", "target", graphs=False),
                   Variant("target eager sampled", "target", graphs=False, sampling="sampled")]
                + [Variant(f"{m} eager {s}", m, 0.5 if m == "dscale" else 1.0, graphs=False, sampling=s)
                   for m in ("dflash", "dscale") for s in ("sampled", "mixed", "mixed_top_p")])
    return ([Variant("dflash eager ref", "dflash", attention="ref", graphs=False),
             Variant("dflash graph ref", "dflash", attention="ref"),
             Variant("dflash graph tile128", "dflash", attention="tile128"),
             Variant("dflash graph", "dflash"),
             Variant("dscale +DVL", "dscale", 0.5, "ref", graphs=False),
             Variant("dscale +tiles", "dscale", 0.5, graphs=False),
             Variant("dscale +graphs", "dscale", 0.5)]
            + [Variant(f"dscale graph r{r}", "dscale", r) for r in others]
            + [Variant("target graph", "target"), Variant("target graph sampled", "target", sampling="sampled"),
               Variant("target graph mixed_top_p", "target", sampling="mixed_top_p")]
            + [Variant(f"{m} graph {s}", m, 0.5 if m == "dscale" else 1.0, sampling=s)
               for m in ("dflash", "dscale") for s in ("sampled", "mixed", "mixed_top_p")])


def time_variant(run: Run, bench: Bench, n: int, v: Variant) -> dict:
    """One variant's complete step, `StepRunner.run` in a bucket of exactly n (the first call builds it)."""
    args = run.args
    kernels = bench.kernels(v.attention)
    bench.use_kernels(kernels)
    runner = bench.runner(v.mode, v.ratio, v.graphs, [n])
    batch = bench.batch(n, v.sampling)
    if v.mode == "target":
        batch = bench.target_batch(batch)
    kind = step_kind(v.mode, v.sampling, bench.sampled_rule)
    t = time.perf_counter()
    batch.run(runner, kind)
    sync(args.device)
    build_s = time.perf_counter() - t
    timing = time_call(lambda: batch.run(runner, kind), args.device, args.reps, args.warmup)
    result = batch.run(runner, kind)
    attention = kernels.attention + (str(kernels.attention_tile) if kernels.attention_tile else "")
    return {**timing, "mode": v.mode, "ratio": v.ratio, "rows": result.num_rows,
            "bucket_rows": runner.get(n, kind).num_rows, "attention": attention, "served": kernels == bench.served,
            "graphs": v.graphs, "sampling": v.sampling, "build_s": round(build_s, 3),
            "mean_accepted": round(statistics.fmean(result.accepted), 3)}


def pick(step: dict, mode: str, sampling: str = "greedy", ratio: float | None = None,
         served: bool | None = None) -> dict | None:
    """The fastest record of a mode, sampling and ratio, among the captured ones when any was captured."""
    found = [(k, r) for k, r in step.items() if k != "dflash_best" and r.get("mode") == mode
             and r.get("sampling") == sampling and (ratio is None or r.get("ratio") == ratio)
             and (served is None or r.get("served") == served)]
    if any(r["graphs"] for _, r in found):
        found = [(k, r) for k, r in found if r["graphs"]]
    if not found:
        return None
    name, best = min(found, key=lambda kr: kr[1]["ms"])
    return {**best, "variant": name}


def step_section(run: Run, bench: Bench, n: int, cuda: bool) -> dict:
    """The complete decode step per variant (`StepRunner.run`: fill, replay, host read)."""
    out = {}
    variants = step_variants(run.args.ratios, cuda)
    if run.args.step_set == "sampling":  # the served steps each sampled kind is compared with, and those kinds
        variants = [v for v in variants if v.attention is None and v.graphs == cuda
                    and v.ratio == (0.5 if v.mode == "dscale" else 1.0)]
    for v in variants:
        if run.over_budget(f"step {v.name} N={n}"):
            continue
        try:
            out[v.name] = time_variant(run, bench, n, v)
            run.log(f"  step N={n} {v.name:24s} {out[v.name]['ms']:9.3f} ms (M={out[v.name]['rows']})")
        except Exception as exc:  # noqa: BLE001
            run.error(f"step {v.name} N={n}", exc)
        release(run.args.device)
    bench.use_kernels(bench.served)
    best = pick(out, "dflash")
    if best:
        out["dflash_best"] = best
    return out


def eager_step(bench: Bench, n: int, ratio: float = 0.5, mode: str = "dscale"):
    """An eager runner's step of n requests with its buffers filled, and its draft outputs."""
    runner = bench.runner(mode, ratio, graphs=False, buckets=[n], ring=True)  # NOTE: its features are read
    kind = StepKind(mode)
    bench.batch(n).run(runner, kind)  # NOTE: fills the bucket's buffers (and runs the step once)
    step = runner.get(n, kind)
    return step, step.draft()


def decision_tensors(decision) -> tuple[torch.Tensor, ...]:
    meta = decision.meta
    return (decision.verify_lens, decision.verify_offsets, decision.token_ids, meta.positions, meta.slot_mapping,
            meta.row_req, meta.row_local, meta.kv_lens, meta.query_starts, meta.query_lens, decision.features)


def decision_section(run: Run, bench: Bench, n: int, cuda: bool) -> dict:
    """`BucketStep.decide` alone: eager vs captured timing, replay == eager, no host sync in either."""
    args = run.args
    bench.use_kernels(bench.served)
    step, (block, logits, hidden, _) = eager_step(bench, n)
    fn = lambda: decision_tensors(step.decide(block, logits, hidden))  # noqa: E731
    out = {"rows": step.num_rows, "eager": time_call(fn, args.device, args.reps, args.warmup)}
    eager = fn()
    out["verify_lens"] = eager[0].tolist()
    if cuda:
        graph = GraphedCall(fn, True)
        out["graph"] = time_call(graph, args.device, args.reps, args.warmup)
        out["replay_equals_eager"] = all(torch.equal(a, b) for a, b in zip(graph(), eager))
        out["sync_free"] = {}
        for label, call in (("eager", fn), ("replay", graph)):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                call()
                out["sync_free"][label] = True
            except RuntimeError as exc:
                out["sync_free"][label] = f"host sync: {str(exc)[:200]}"
            finally:
                torch.cuda.set_sync_debug_mode(0)
        del graph
    run.log(f"  decision N={n}: eager {out['eager']['ms']:.3f} ms, graph {out.get('graph', {}).get('ms')} ms, "
            f"replay==eager {out.get('replay_equals_eager')}, sync-free {out.get('sync_free')}")
    try:
        out["parts"] = decision_parts(run, bench, step, block, logits, hidden, cuda)
    except Exception as exc:  # noqa: BLE001
        run.error(f"decision parts N={n}", exc)
    return out


def decision_parts(run: Run, bench: Bench, step, block, logits, hidden, cuda: bool) -> dict:
    """Where the decision's time goes, each part timed alone (captured on CUDA): the confidence features
    through the reference and (where it runs) the fused kernel, the whole feature vector, the predictor and
    seeds, Algorithm 1, flat-pack with its metadata (the functions `BucketStep.decide` calls)."""
    from dscale_runtime.dvl.features import confidence_features, confidence_features_ref
    from dscale_runtime.dvl.pack import flat_pack, packed_metadata

    args, spec, buf = run.args, bench.spec, step.buf
    features = step.acceptance_features(block, logits, hidden)
    scores = bench.predictor.scores(features)
    seeds = seed_lengths(scores, BLOCK)
    live = buf.live > 0
    lens = allocate(scores, seeds, live, buf.budget)
    parts = {
        "confidence ref": lambda: confidence_features_ref(logits, spec.num_ranks),
        "confidence triton": lambda: confidence_features(logits, spec.num_ranks, backend="triton"),
        "features (served)": lambda: step.acceptance_features(block, logits, hidden, bench.served.features),
        "predictor + seeds": lambda: seed_lengths(bench.predictor.scores(features), BLOCK),
        "allocate": lambda: allocate(scores, seeds, live, buf.budget),
        "pack + metadata": lambda: packed_metadata(flat_pack(lens, block, buf.ctx, buf.block_tables, step.num_rows,
                                                             buf.page_size), buf.ctx, buf.block_tables,
                                                   buf.max_kv, BLOCK).kv_lens,
    }
    out = {}
    for name, fn in parts.items():
        if name == "confidence triton" and not cuda:
            continue
        try:
            call = GraphedCall(fn, True) if cuda else fn
            out[name] = time_call(call, args.device, args.reps, args.warmup)["ms"]
        except Exception as exc:  # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    run.log("    parts: " + ", ".join(f"{k} {v if isinstance(v, str) else f'{v:.3f} ms'}" for k, v in out.items()))
    return out


def attention_paths(bench: Bench, cuda: bool, tile128: bool = True) -> list[tuple[str, str | None]]:
    """(label, `Bench.kernels` argument) of the attention paths a part is timed through."""
    if not cuda:
        return [("ref", "ref")]
    return [("ref", "ref")] + ([("triton128", "tile128")] if tile128 else []) + [("served", None)]


def verify_section(run: Run, bench: Bench, n: int, cuda: bool) -> dict:
    """`BucketStep.verify` over the M rows (LM head on all rows, acceptance, injection): DFlash 16N vs DScale's
    packed budget_rows(N, 16, 0.5), per attention path, eager vs captured, against the roofline floor."""
    args, out = run.args, {}
    for label, mode, ratio in (("dflash", "dflash", 1.0), ("dscale", "dscale", 0.5)):
        bench.use_kernels(bench.served)
        step, (block, logits, hidden, q) = eager_step(bench, n, ratio, mode)
        decision = step.decide(block, logits, hidden)

        def fn():
            decision.meta.rope.clear()  # NOTE: RoPE tables are part of the step: recompute them every call
            return step.verify(block, q, decision)

        ceil = run.result["ceilings"]
        usable = ceil and ceil["matmul_tflops"] > 0 and ceil["copy_tbps"] > 0
        entry = {"rows": step.num_rows,
                 "roofline": roofline(bench, step.buf.ctx, decision.verify_lens, ceil) if usable else None}
        for key, attention in attention_paths(bench, cuda):
            try:
                bench.use_kernels(bench.kernels(attention))
                entry[f"{key} eager"] = time_call(fn, args.device, args.reps, args.warmup)
                if cuda:
                    eager = fn().clone()
                    graph = GraphedCall(fn, True)
                    entry[f"{key} graph"] = time_call(graph, args.device, args.reps, args.warmup)
                    entry[f"{key} graph"]["replay_equals_eager"] = bool(torch.equal(graph(), eager))
                    del graph, eager
            except Exception as exc:  # noqa: BLE001
                run.error(f"verify {label} {key} N={n}", exc)
            release(args.device)
        floor = (entry["roofline"] or {}).get("floor_ms")
        timed = [v["ms"] for v in entry.values() if isinstance(v, dict) and "ms" in v]
        if floor and timed:
            entry["best_ms"] = min(timed)
            entry["best_over_floor"] = round(min(timed) / floor, 3)
        out[label] = entry
        run.log(f"  verify N={n} {label} M={step.num_rows}: " + ", ".join(
            f"{k} {v['ms']:.3f}" for k, v in entry.items() if isinstance(v, dict) and "ms" in v)
            + (f" | floor {floor:.3f} ms" if floor else ""))
    bench.use_kernels(bench.served)
    return out


def draft_section(run: Run, bench: Bench, n: int, cuda: bool) -> dict:
    """`BucketStep.draft`: the drafter over N x 16 block rows (non-causal over context + block) and the LM
    head on 15 positions, per attention path."""
    args, out = run.args, {}
    step, _ = eager_step(bench, n, 1.0, "dflash")
    for key, attention in attention_paths(bench, cuda, tile128=False):
        bench.use_kernels(bench.kernels(attention))
        out[f"{key} eager"] = time_call(step.draft, args.device, args.reps, args.warmup)
        if cuda:
            graph = GraphedCall(step.draft, True)
            out[f"{key} graph"] = time_call(graph, args.device, args.reps, args.warmup)
            del graph
    bench.use_kernels(bench.served)
    run.log(f"  draft N={n}: " + ", ".join(f"{k} {v['ms']:.3f}" for k, v in out.items()))
    return out


def kernel_table(fn, device, reps: int, top: int = 20) -> dict:
    """Device time of `reps` calls of `fn()` by kernel name (CPU time by op on the CPU), per call: the total, the
    launches, the `top` kernels (ms, calls) and every kernel's ms (`all`, for diffs between two steps)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        sync(device)
    attr = "device_time_total" if cuda else "self_cpu_time_total"
    kernels = sorted(((e.key, getattr(e, attr, 0) / 1e3 / reps, e.count // reps)
                      for e in prof.key_averages()), key=lambda k: -k[1])
    kernels = [k for k in kernels if k[1] > 0]
    return {"total_ms": round(sum(k[1] for k in kernels), 3), "launches": sum(k[2] for k in kernels),
            "top": [{"kernel": k[:120], "ms": round(ms, 4), "calls": c} for k, ms, c in kernels[:top]],
            "all": {k[:120]: [round(ms, 4), c] for k, ms, c in kernels}}


def profile_section(run: Run, bench: Bench, n: int, cuda: bool) -> dict:
    """Where a captured step's device time goes: torch.profiler over a few steps of each mode (DScale at budget
    0.5, served kernels), greedy and with every row sampled at T = 1 (`--profile-sampling`), kernels summed by
    name (the top 20 per step, in ms per step) and the number of kernel launches per step."""
    args, out, reps = run.args, {}, 5
    bench.use_kernels(bench.served)
    for mode in args.profile_modes:
        for sampling in args.profile_sampling:
            name = f"{mode} {sampling}"
            runner, batch = bench.runner(mode, 0.5, cuda, [n]), bench.batch(n, sampling)
            if mode == "target":
                batch = bench.target_batch(batch)
            kind = step_kind(mode, sampling, bench.sampled_rule)
            for _ in range(3):
                batch.run(runner, kind)
            sync(args.device)
            out[name] = kernel_table(lambda: batch.run(runner, kind), args.device, reps)
            run.log(f"  profile N={n} {name}: {out[name]['total_ms']:.3f} ms of kernels, "
                    f"{out[name]['launches']} launches per step")
            for k in out[name]["top"][:12]:
                run.log(f"    {k['ms']:8.4f} ms  x{k['calls']:<4d} {k['kernel'][:100]}")
            del runner
            release(args.device)
    return out


def memory_mib(cuda: bool) -> dict:
    if not cuda:
        return {"allocated_mib": 0.0, "reserved_mib": 0.0}
    torch.cuda.synchronize()
    return {"allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
            "reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1)}


def buckets_section(run: Run, bench: Bench, cuda: bool) -> dict:
    """The captured greedy DFlash and DScale (r = 0.5) steps at every N = 1 .. max_n, padded into the default
    buckets and in a bucket of exactly N: step time per N, and what each `prepare` cost (capture seconds,
    graph-pool memory: allocated / reserved before and after)."""
    args, max_n = run.args, run.args.max_n
    bench.use_kernels(bench.served)
    layouts = {"padded": default_buckets(max_n), "unpadded": list(range(1, max_n + 1))}
    out = {"max_n": max_n, "default_buckets": layouts["padded"], "ratio": 0.5}
    for mode in ("dflash", "dscale"):
        entry = out[mode] = {}
        for layout, buckets in layouts.items():
            if run.over_budget(f"buckets {mode} {layout}"):
                continue
            try:
                runner, kind = bench.runner(mode, 0.5, cuda, buckets), StepKind(mode)
                release(args.device)
                before = memory_mib(cuda)
                t = time.perf_counter()
                runner.prepare([kind])
                sync(args.device)
                prepare_s = time.perf_counter() - t
                after = memory_mib(cuda)
                per_n = {}
                for n in range(1, max_n + 1):
                    batch = bench.batch(n)
                    timing = time_call(lambda: batch.run(runner, kind), args.device, args.bucket_reps, 1)
                    per_n[str(n)] = {"bucket": runner.bucket(n), "ms": timing["ms"], "p10_ms": timing["p10_ms"],
                                     "p90_ms": timing["p90_ms"]}
                entry[layout] = {
                    "buckets": buckets, "steps": len(runner.steps), "prepare_s": round(prepare_s, 2),
                    "memory_before": before, "memory_after": after,
                    "pool_mib": {k.replace("_mib", ""): round(after[k] - before[k], 1) for k in before}, "N": per_n}
                run.log(f"  buckets {mode} {layout}: {len(runner.steps)} steps prepared in {prepare_s:.1f} s, "
                        f"+{entry[layout]['pool_mib']['reserved']} MiB reserved")
                runner = None  # NOTE: its graphs go back to the allocator in `release`
            except Exception as exc:  # noqa: BLE001
                run.error(f"buckets {mode} {layout}", exc)
            release(args.device)
            run.save()
        if "padded" in entry and "unpadded" in entry:
            cost = {n: round(entry["padded"]["N"][n]["ms"] / entry["unpadded"]["N"][n]["ms"], 4)
                    for n in entry["padded"]["N"]}
            entry["padding_cost"] = cost
            entry["padding_cost_summary"] = {"mean": round(statistics.fmean(cost.values()), 4),
                                             "max": max(cost.values()), "worst_n": int(max(cost, key=cost.get))}
            entry["bucket_sets"] = bucket_sets(entry["unpadded"]["N"], max_n)
    if not run.over_budget("buckets policy") and "padded" in out.get("dflash", {}):
        try:  # the engine's default DScale policy (measured per bucket at start-up) against padded DFlash
            runner = bench.runner("dscale", 0.5, cuda, default_buckets(max_n), measured=True)
            t = time.perf_counter()
            runner.prepare([StepKind("dscale")])
            per_n = {}
            for n in range(1, max_n + 1):
                batch, kind = bench.batch(n), StepKind(runner.mode_for(n))
                timing = time_call(lambda: batch.run(runner, kind), args.device, args.bucket_reps, 1)
                per_n[str(n)] = {"mode": kind.mode, "ms": timing["ms"],
                                 "vs_dflash": round(timing["ms"] / out["dflash"]["padded"]["N"][str(n)]["ms"], 4)}
            worst = max(per_n, key=lambda n: per_n[n]["vs_dflash"])
            out["policy"] = {"prepare_s": round(time.perf_counter() - t, 2), "bucket_modes": runner.bucket_modes,
                             "policy_ms": runner.policy_ms, "N": per_n,
                             "max_vs_dflash": per_n[worst]["vs_dflash"], "worst_n": int(worst)}
            run.log(f"  buckets policy: modes {runner.bucket_modes}; worst policy/DFlash "
                    f"{per_n[worst]['vs_dflash']} at N={worst}")
            runner = None
        except Exception as exc:  # noqa: BLE001
            run.error("buckets policy", exc)
        release(args.device)
        run.save()
    return out


def bucket_sets(unpadded: dict, max_n: int) -> dict:
    """Candidate bucket sets judged on the measured step time of every N in a bucket of exactly N: the mean and
    worst of t(bucket(N)) / t(N) over N = 1 .. max_n, and the number of graphs each set captures per kind."""
    def capped(sizes):
        return sorted({b for b in sizes if b < max_n} | {max_n})
    sets = {"powers of two": capped([2 ** i for i in range(max_n.bit_length() + 1)]),
            "1, 2, 4, 8, multiples of 8": capped([1, 2, 4] + list(range(8, max_n + 1, 8))),
            "1..8, multiples of 8": capped(list(range(1, 9)) + list(range(8, max_n + 1, 8))),
            "1, 2, 4, multiples of 4 (default to 64)": default_buckets(max_n),
            "1, 2, 4, 8, multiples of 16": capped([1, 2, 4, 8] + list(range(16, max_n + 1, 16)))}
    out = {}
    for name, sizes in sets.items():
        cost = [unpadded[str(next(b for b in sizes if b >= n))]["ms"] / unpadded[str(n)]["ms"]
                for n in range(1, max_n + 1)]
        out[name] = {"buckets": sizes, "graphs": len(sizes), "mean": round(statistics.fmean(cost), 4),
                     "max": round(max(cost), 4)}
    return out


TARGET_SHAPE = "qwen3-8b"  # issue 8's marks are set at this shape; others report the same figures, unmarked
MARKS = {8: ("decision_fraction", 0.03), 16: ("dscale_over_dflash", 0.85), 32: ("dscale_over_dflash", 0.70)}
MIXED_LIMIT = 1.05  # issue 15: a half-sampled batch within 5% of the greedy step


def derived(entry: dict, n: int, shape: str = TARGET_SHAPE) -> dict:
    """The acceptance figures: decision share of the DScale step, DScale / DFlash step ratios, and each
    sampled or mixed step over its greedy step (served kernels)."""
    step, out = entry.get("step") or {}, {}
    dscale, base = pick(step, "dscale", ratio=0.5), step.get("dflash_best")
    decision = entry.get("decision") or {}
    dec_ms = (decision.get("graph") or decision.get("eager") or {}).get("ms")
    if dscale and dec_ms is not None:
        out["decision_fraction"] = round(dec_ms / dscale["ms"], 4)
    if base:
        by_ratio = {r: pick(step, "dscale", ratio=r) for r in sorted({v.get("ratio") for v in step.values()
                                                                      if v.get("mode") == "dscale"})}
        out["dscale_over_dflash_by_ratio"] = {str(r): round(v["ms"] / base["ms"], 4) for r, v in by_ratio.items() if v}
        if dscale:
            out["dscale_over_dflash"] = round(dscale["ms"] / base["ms"], 4)
        if "dflash graph tile128" in step and dscale:
            out["dscale_over_dflash_tile128"] = round(dscale["ms"] / step["dflash graph tile128"]["ms"], 4)
    target = pick(step, "target")
    if target:
        out["over_target"] = {m: round(r["ms"] / target["ms"], 4)
                              for m, r in (("dflash", base), ("dscale", dscale)) if r}
    for sampling in ("sampled", "mixed", "mixed_top_p"):
        ratios = {}
        for mode in ("target", "dflash", "dscale"):
            greedy = pick(step, mode, ratio=0.5 if mode == "dscale" else None, served=True)
            other = pick(step, mode, sampling, served=True)
            if greedy and other:
                ratios[mode] = round(other["ms"] / greedy["ms"], 4)
        if ratios:
            out[f"{sampling}_over_greedy"] = ratios
    pairs = {m: (pick(step, m, "mixed", served=True), pick(step, m, "sampled", served=True))
             for m in ("dflash", "dscale")}
    mixed = {m: round(a["ms"] / b["ms"], 4) for m, (a, b) in pairs.items() if a and b}
    if mixed:
        out["mixed_over_sampled"] = mixed
    marks = []
    if shape == TARGET_SHAPE and n in MARKS and MARKS[n][0] in out:
        key, limit = MARKS[n]
        marks.append({"metric": key, "limit": limit, "pass": out[key] <= limit})
    for mode, ratio in (out.get("mixed_over_greedy") or {}).items() if shape == TARGET_SHAPE else ():
        marks.append({"metric": f"mixed_over_greedy.{mode}", "limit": MIXED_LIMIT, "pass": ratio <= MIXED_LIMIT})
    if marks:
        out["marks"] = marks
    return out


def run_benchmark(args) -> dict:
    run = Run(args)
    cuda = torch.device(args.device).type == "cuda"
    run.log(f"device {run.result['env']['device']}, shapes {args.shapes}, N {args.ns}, sections {args.sections}")
    run.result["ceilings"] = run.section("ceilings", lambda: ceilings(args.device, quick=not cuda))
    run.log(f"ceilings {run.result['ceilings']}")
    dtype = torch.bfloat16 if cuda else torch.float32
    per_n = [s for s in ("step", "decision", "verify", "draft", "profile") if s in args.sections]
    max_n = max(max(args.ns) if per_n else 1, args.max_n if "buckets" in args.sections else 1)
    rule = {"sampled": RULE_SAMPLED, "top1": RULE_TOP1}[args.sampled_rule]
    sections = {"step": step_section, "decision": decision_section, "verify": verify_section,
                "draft": draft_section, "profile": profile_section}
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        bench = run.section(f"{shape_name} init", lambda: Bench(shape, args.device, dtype, max_n, args.context,
                                                                sampled_rule=rule))
        if bench is None:
            continue
        res = run.result["shapes"][shape_name] = {"shape": asdict(shape), "linear_params": bench.linear_params(),
                                                  "context": args.context, "kernels": asdict(bench.served), "N": {}}
        with torch.no_grad():
            for n in args.ns if per_n else ():
                entry = res["N"][str(n)] = {}
                # NOTE: fit the random predictor's normalisation on this batch first (ragged verify lengths)
                run.section(f"{shape_name} N={n} normalise", lambda: normalise(bench, n))
                for name in per_n:
                    entry[name] = run.section(f"{shape_name} N={n} {name}",
                                              lambda: sections[name](run, bench, n, cuda))
                entry["derived"] = derived(entry, n, shape_name)
                run.save()
            if "buckets" in args.sections:
                run.section(f"{shape_name} normalise", lambda: normalise(bench, max_n))
                res["buckets"] = run.section(f"{shape_name} buckets", lambda: buckets_section(run, bench, cuda))
        bench = None  # NOTE: free this shape's weights and caches before the next one
        release(args.device)
    run.result["total_s"] = round(run.elapsed(), 1)
    run.save()
    print(format_table(run.result), flush=True)
    run.log(f"total {run.result['total_s']} s; results in {args.out}")
    return run.result


def normalise(bench: Bench, n: int) -> None:
    step, (block, logits, hidden, _) = eager_step(bench, n, 1.0, "dflash")
    fit_normalisation(bench.predictor, step.acceptance_features(block, logits, hidden))


def format_table(result: dict) -> str:
    lines = [f"ceilings: {result.get('ceilings')}"]
    for shape, res in result["shapes"].items():
        if res["N"]:
            lines += [f"\n{shape}  (step ms; verify ms vs roofline floor)",
                      ("| N | dflash eager ref | dflash tile128 | dflash best | +DVL | +tiles | +graphs "
                       "| dscale/dflash | decision % | target | mixed/greedy dflash, dscale | mixed_top_p/greedy "
                       "| verify 16N best/floor "
                       "| verify 8N best/floor |"),
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for n, e in res["N"].items():
            st = e.get("step") or {}
            ms = lambda k: f"{st[k]['ms']:.2f}" if k in st else "-"  # noqa: E731
            d = e.get("derived") or {}
            v = e.get("verify") or {}
            vf = lambda k: (f"{v[k]['best_ms']:.2f}/{v[k]['roofline']['floor_ms']:.2f}"  # noqa: E731
                            if k in v and "best_ms" in v[k] else "-")
            frac = f"{100 * d['decision_fraction']:.1f}" if "decision_fraction" in d else "-"
            target = pick(st, "target")
            mixed = d.get("mixed_over_greedy") or {}
            top_p = d.get("mixed_top_p_over_greedy") or {}
            lines.append(f"| {n} | {ms('dflash eager ref')} | {ms('dflash graph tile128')} | {ms('dflash_best')} | "
                         f"{ms('dscale +DVL')} | {ms('dscale +tiles')} | {ms('dscale +graphs')} | "
                         f"{d.get('dscale_over_dflash', '-')} | {frac} | "
                         f"{target['ms'] if target else '-'} | {mixed.get('dflash', '-')}, {mixed.get('dscale', '-')} "
                         f"| {top_p.get('dflash', '-')}, {top_p.get('dscale', '-')} | {vf('dflash')} | {vf('dscale')} |")
            for mark in d.get("marks", []):
                lines.append(f"  mark N={n}: {mark['metric']} <= {mark['limit']}: {'PASS' if mark['pass'] else 'FAIL'}")
        b = res.get("buckets")
        if b:
            lines += [f"\n{shape} buckets (step ms, bucket in brackets; padded / unpadded)",
                      "| N | dflash padded | dflash unpadded | dscale padded | dscale unpadded |",
                      "|---|---|---|---|---|"]

            def cell(mode: str, layout: str, n: str) -> str:
                rec = b.get(mode, {}).get(layout, {}).get("N", {}).get(n)
                return f"{rec['ms']:.2f} [{rec['bucket']}]" if rec else "-"

            for n in map(str, range(1, b["max_n"] + 1)):
                lines.append(f"| {n} | {cell('dflash', 'padded', n)} | {cell('dflash', 'unpadded', n)} | "
                             f"{cell('dscale', 'padded', n)} | {cell('dscale', 'unpadded', n)} |")
            for mode in ("dflash", "dscale"):
                if "padding_cost_summary" in b.get(mode, {}):
                    lines.append(f"{mode} padded / unpadded: {b[mode]['padding_cost_summary']}")
                for layout, rec in b.get(mode, {}).items():
                    if layout in ("padded", "unpadded"):
                        lines.append(f"{mode} {layout}: {rec['steps']} steps, prepare {rec['prepare_s']} s, "
                                     f"pool {rec['pool_mib']} MiB")
    if result["errors"]:
        lines.append(f"\n{len(result['errors'])} error(s): " + "; ".join(e["where"] for e in result["errors"]))
    if result["skipped"]:
        lines.append(f"skipped (time budget): {len(result['skipped'])}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- projection
def cohorts(concurrency: np.ndarray, n: int, max_cohorts: int) -> list[np.ndarray]:
    """Index arrays of n consecutive records of one concurrency level (evenly thinned to max_cohorts)."""
    found = []
    for c in sorted(set(concurrency.tolist())):
        rows = np.flatnonzero(concurrency == c)
        found += [rows[s : s + n] for s in range(0, len(rows) - n + 1, n)]
    if len(found) > max_cohorts:
        keep = np.linspace(0, len(found) - 1, max_cohorts).round().astype(int)
        found = [found[i] for i in keep]
    return found


def project(step_times: dict, accepted: np.ndarray, concurrency: np.ndarray, scores: np.ndarray,
            shapes: list[str] | None = None, max_cohorts: int = 2000) -> dict:
    """Tokens per step and projected throughput per N: DFlash 1 + mean(y); DScale 1 + mean(min(y, k - 1)) with k
    from the predictor's scores and Algorithm 1 at the timed M_live; throughput = N x tokens/step / step time.
    DScale's time at a ratio is its fastest greedy step (captured, when any was)."""
    out = {}
    for shape, res in step_times["shapes"].items():
        if shapes and shape not in shapes:
            continue
        table = out[shape] = {}
        for n_key, entry in res["N"].items():
            n, step = int(n_key), (entry.get("step") or {})
            base = step.get("dflash_best")
            groups = cohorts(concurrency, n, max_cohorts)
            if not base or not groups:
                table[n_key] = {"note": "no DFlash step time" if not base else f"no cohort of {n} records"}
                continue
            picked = np.concatenate(groups)
            y = accepted[picked]
            dflash_tps = 1 + float(y.mean())
            row = {"cohorts": len(groups), "dflash": {"step_ms": base["ms"], "tokens_per_step": round(dflash_tps, 4),
                                                      "tok_s": round(n * dflash_tps / base["ms"] * 1e3, 1)},
                   "dscale": {}}
            for ratio in sorted({r["ratio"] for r in step.values() if r.get("mode") == "dscale"}):
                rec = pick(step, "dscale", ratio=ratio)
                if rec is None:
                    continue
                kept = 0
                for g in groups:
                    s = torch.from_numpy(scores[g]).float()
                    k = allocate(s, seed_lengths(s, BLOCK), torch.ones(n, dtype=torch.bool), rec["rows"]).numpy()
                    kept += int(np.minimum(accepted[g], k - 1).sum())
                tps = 1 + kept / len(picked)
                row["dscale"][str(ratio)] = {
                    "variant": rec["variant"], "rows": rec["rows"], "step_ms": rec["ms"],
                    "tokens_per_step": round(tps, 4), "retention": round(kept / max(int(y.sum()), 1), 4),
                    "tok_s": round(n * tps / rec["ms"] * 1e3, 1)}
            if row["dscale"]:
                # NOTE: the policy may also run a bucket at full width without the decision (the same graph as
                # DFlash, `EngineConfig.full_width_max_batch`): where no ratio pays for the decision, DScale
                # then loses nothing.
                candidates = {**row["dscale"], "full": row["dflash"]}
                best = max(candidates, key=lambda r: candidates[r]["tok_s"])
                row["policy"] = {"ratio": best if best == "full" else float(best), "tok_s": candidates[best]["tok_s"],
                                 "gain_vs_dflash": round(candidates[best]["tok_s"] / row["dflash"]["tok_s"] - 1, 4)}
            table[n_key] = row
    return out


def format_projection(proj: dict) -> str:
    lines = []
    for shape, table in proj.items():
        ratios = sorted({r for row in table.values() for r in row.get("dscale", {})}, key=float)
        lines += [f"\n{shape}: projected tokens/s (tokens per step)",
                  "| N | DFlash | " + " | ".join(f"DScale r={r}" for r in ratios) + " | policy | gain |",
                  "|---|---|" + "---|" * len(ratios) + "---|---|"]
        for n, row in table.items():
            if "dflash" not in row:
                lines.append(f"| {n} | {row.get('note')} |")
                continue
            cell = lambda d: f"{d['tok_s']:.0f} ({d['tokens_per_step']:.2f})"  # noqa: E731
            pol = row.get("policy", {})
            lines.append(f"| {n} | {cell(row['dflash'])} | " + " | ".join(
                cell(row["dscale"][r]) if r in row["dscale"] else "-" for r in ratios)
                + f" | r={pol.get('ratio', '-')} | {100 * pol.get('gain_vs_dflash', 0):+.1f}% |")
    return "\n".join(lines)


def project_main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="gpu_step.py project", description=project.__doc__)
    parser.add_argument("--step-times", required=True, help="JSON written by the GPU run (--out)")
    parser.add_argument("--traces", default="traces/demo", help="dscale-collect folder (manifest.json + shards/)")
    parser.add_argument("--predictor", default="artifacts/demo.pt", help="predictor artifact from dscale-train")
    parser.add_argument("--shapes", nargs="*", default=None, help="shapes of the step-times file to project")
    parser.add_argument("--max-cohorts", type=int, default=2000)
    parser.add_argument("--out", default=None, help="write the projection JSON here")
    args = parser.parse_args(argv)
    from dscale_predictor.data import read_traces
    from dscale_runtime.dvl.predictor import load_predictor

    try:
        step_times = json.loads(Path(args.step_times).read_text())
        traces = read_traces(args.traces)
        predictor, _ = load_predictor(args.predictor)
    except (OSError, ValueError) as exc:  # a missing or unusable input file: say which, no traceback
        raise SystemExit(f"gpu_step.py project: {exc}") from exc
    if traces.features.shape[1] != predictor.spec.width:
        raise SystemExit(f"gpu_step.py project: {args.traces} has features of width {traces.features.shape[1]}, "
                         f"the predictor {args.predictor} reads {predictor.spec.width}; collect traces with its "
                         "feature spec")
    with torch.no_grad():
        scores = predictor.scores(torch.from_numpy(traces.features)).numpy()
    proj = project(step_times, traces.accepted, traces.concurrency, scores, args.shapes, args.max_cohorts)
    result = {"step_times": str(args.step_times), "traces": str(args.traces), "predictor": str(args.predictor),
              "records": len(traces), "mean_accepted": float(traces.accepted.mean()), "projection": proj}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(format_projection(proj), flush=True)
    return result


# ----------------------------------------------------------------------------------------------- CLI
SECTIONS = ("step", "decision", "verify", "draft", "profile", "buckets")


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shape, few N and reps (CPU smoke run)")
    parser.add_argument("--shapes", nargs="+", default=None, choices=sorted(SHAPES))
    parser.add_argument("--ns", nargs="+", type=int, default=None, help="batch sizes N of the per-N sections")
    parser.add_argument("--sections", nargs="+", default=["step", "decision", "verify", "draft"], choices=SECTIONS,
                        help="profile (kernel time by name) and buckets (N = 1 .. --max-n) run only when named")
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--step-set", default="all", choices=["all", "sampling"],
                        help="step section: every variant, or only the served steps greedy and sampled ('sampling')")
    parser.add_argument("--sampled-rule", default="sampled", choices=["sampled", "top1"],
                        help="rule of the speculative steps' sampled rows (sampled: the engine's auto rule at T = 1)")
    parser.add_argument("--profile-modes", nargs="+", default=["dflash", "dscale"], choices=["target", "dflash", "dscale"])
    parser.add_argument("--profile-sampling", nargs="+", default=["greedy"], choices=["greedy", "sampled", "mixed", "mixed_top_p"])
    parser.add_argument("--context", type=int, default=None, help="committed tokens per request (~)")
    parser.add_argument("--max-n", type=int, default=None, help="buckets section: N = 1 .. max_n (default 64)")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--bucket-reps", type=int, default=None, help="buckets section: timed steps per N")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--time-budget", type=float, default=280.0, help="seconds; later sections are skipped")
    parser.add_argument("--out", default=None, help="results JSON (rewritten after every section)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.shapes = args.shapes or ["tiny"]
        args.ns = args.ns or [1, 3]
        args.context = args.context or 40
        args.max_n = args.max_n or 4
        args.reps = args.reps or 2
        args.bucket_reps = args.bucket_reps or 2
        args.warmup = args.warmup if args.warmup is not None else 1
    args.shapes = args.shapes or ["qwen3-8b", "qwen3-4b"]
    args.ns = args.ns or [1, 8, 16, 32, 64]
    args.context = args.context or 1024
    args.max_n = args.max_n or 64
    args.reps = args.reps or 20
    args.bucket_reps = args.bucket_reps or 10
    args.warmup = args.warmup if args.warmup is not None else 3
    if min(args.ns) < 1 or args.max_n < 1:
        raise SystemExit("--ns and --max-n must be >= 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; use --device cpu --tiny for the CPU smoke run")
    return args


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "project":
        return project_main(argv[1:])
    args = parse_args(argv)
    with benchmark_settings(args.device, args.tiny):
        return run_benchmark(args)


@contextlib.contextmanager
def benchmark_settings(device: str, tiny: bool):
    """The process-wide torch settings of a run, restored on exit (the tests call `main` in-process, and every
    later test must see the settings it started with): TF32 for fp32 matmuls on CUDA (the models run in bf16),
    one CPU thread for the tiny CPU run."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision(), torch.get_num_threads())
    try:
        if torch.device(device).type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        elif tiny:
            torch.set_num_threads(1)  # NOTE: tiny tensors: more threads only add waits (seconds on a busy machine)
        yield
    finally:
        torch.set_float32_matmul_precision(saved[1])
        torch.backends.cuda.matmul.allow_tf32 = saved[0]
        torch.set_num_threads(saved[2])


if __name__ == "__main__":
    main()
