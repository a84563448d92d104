"""Tensor-parallel runs over `torch.distributed`: the process group from torchrun's environment, the target and
drafter loaded as this rank's shards, an engine over them, and a small torchrun generation command.

SPMD: every rank builds the same `Engine` over its shards and is given the same requests in the same order;
each model forward returns the whole vocabulary's logits on every rank (`models/parallel.py`), so the drafts,
the DVL decision, sampling (counter-based draws), acceptance and the scheduler's host work are replicated
and agree on every rank without further communication. The only collectives are inside the models (two
`all_reduce` per layer, one per embedding lookup, one gather per LM head), NCCL on CUDA (captured with the
runner's step graphs, every rank capturing the same graphs in the same order) and gloo on the CPU.

Launch (one process per GPU; every rank prints nothing but rank 0):
    torchrun --nproc-per-node 2 -m dscale_runtime.distributed --device cuda --mode dflash --prompt "def f(x):"
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dscale_runtime.config import MODES, EngineConfig, SamplingParams
from dscale_runtime.models.dflash import DFlashDraftModel
from dscale_runtime.models.loader import load_drafter, load_target, resolve_dtype
from dscale_runtime.models.parallel import TensorParallel
from dscale_runtime.models.qwen3 import Qwen3ForCausalLM

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_tensor_parallel(device: str = "cpu", tensor_parallel_size: int | None = None) -> TensorParallel:
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
    unless one is already initialised: NCCL with this process on cuda:LOCAL_RANK for a CUDA `device`, gloo
    on the CPU. The whole world is the tensor-parallel group (`tensor_parallel_size`, when given, must be its
    size). Returns this rank's `TensorParallel`, its communicator already created (before any graph capture)."""
    kind = torch.device(device)
    if kind.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallelism runs on 'cuda' (NCCL) or 'cpu' (gloo), not device '{device}'")
    backend = "nccl" if kind.type == "cuda" else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if kind.type == "cuda":
        if kind.index is not None and kind.index != local_rank:
            raise ValueError(f"device '{device}': under tensor parallelism pass device 'cuda'; each rank takes "
                             f"cuda:LOCAL_RANK (this one cuda:{local_rank})")
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but this host has {torch.cuda.device_count()} CUDA device(s): "
                               "start at most that many processes per node (torchrun --nproc-per-node)")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        missing = [name for name in TORCHRUN_ENV if name not in os.environ]
        if missing:
            raise RuntimeError(f"tensor parallelism needs torchrun's environment ({', '.join(missing)} unset): "
                               "launch with `torchrun --nproc-per-node N ...`")
        dist.init_process_group(backend)
    elif dist.get_backend() != backend:
        raise RuntimeError(f"the process group runs {dist.get_backend()}, device '{device}' needs {backend}")
    tp = TensorParallel.of()
    if tensor_parallel_size is not None and tensor_parallel_size != tp.size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}, but {tp.size} processes were started "
                         f"(torchrun --nproc-per-node {tensor_parallel_size})")
    # NOTE: NCCL creates its communicator on the first collective, which a CUDA-graph capture cannot record.
    tp.all_reduce(torch.zeros(1, device=device))
    return tp


def close_tensor_parallel() -> None:
    """Leave the process group (at the end of a run)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def load_tp_models(
    target_path: str | Path,
    drafter_path: str | Path | None,
    dtype: str | torch.dtype,
    device: str,
    tp: TensorParallel,
    draft_dtype: str | torch.dtype | None = None,
) -> tuple[Qwen3ForCausalLM, DFlashDraftModel | None]:
    """This rank's shards of the target and (when `drafter_path` is given) the drafter, each rank reading only
    its slices of the split weights, on `device` in `dtype` (the drafter in `draft_dtype`, default `dtype`);
    on CUDA with fused projections, as `Engine.from_pretrained` builds them. Ready for
    `Engine(target, drafter, config, tokenizer, eos_ids, ...)`: the KV caches it sizes from the models'
    configs hold this rank's heads."""
    dtype = resolve_dtype(dtype)
    target = load_target(target_path, dtype, device, tp=tp)
    drafter = None
    if drafter_path is not None:
        drafter = load_drafter(drafter_path, target.config, resolve_dtype(draft_dtype or dtype), device, tp=tp)
    if torch.device(device).type == "cuda":
        target.fuse_projections()
        if drafter is not None:
            drafter.fuse_projections()
    return target, drafter


def engine_from_pretrained(target: str | Path, drafter: str | Path | None = None, predictor: str | Path | None = None,
                           config: EngineConfig | None = None, tp: TensorParallel | None = None, **kwargs):
    """`Engine.from_pretrained` over this rank's shards (`tp`: default `init_tensor_parallel(config.device)`, the
    whole world). Every rank calls it with the same arguments and then gives its engine the same requests in the
    same order."""
    from dscale_runtime.engine import Engine

    config = config or EngineConfig()
    tp = tp if tp is not None else init_tensor_parallel(config.device)
    config = dataclasses.replace(config, tensor_parallel_size=tp.size)
    return Engine.from_pretrained(target, drafter, predictor, config=config, **kwargs)


@dataclass(frozen=True)
class GenerateConfig:
    """`python -m dscale_runtime.distributed` under torchrun: greedy or sampled generation over the ranks."""

    target: str | None = None
    """Qwen3 target folder; default: the demo pair's target."""
    drafter: str | None = None
    """DFlash drafter folder (modes dflash and dscale); default: the demo pair's drafter."""
    predictor: str | None = None
    """Acceptance predictor artifact (mode dscale); default: artifacts/demo.pt."""
    mode: str = "dflash"
    """'dscale', 'dflash' or 'target'."""
    device: str = "cpu"
    """'cuda' (NCCL, each rank on cuda:LOCAL_RANK) or 'cpu' (gloo)."""
    dtype: str = "auto"
    """'float32', 'bfloat16', 'float16' or 'auto' (bf16 on CUDA, fp32 on CPU)."""
    prompt: str | None = None
    """One prompt; default: the first --num-prompts held-out stdlib prompts of the demo set."""
    num_prompts: int = 4
    """Demo prompts to generate from when --prompt is not given."""
    max_tokens: int = 64
    """Tokens to generate per prompt."""
    temperature: float = 0.0
    """0: greedy; above: sampled with per-request seeds 0, 1, ..."""
    max_running_requests: int = 8
    """Most requests decoded together."""
    max_model_len: int = 1024
    """Context limit (prompt + output tokens)."""
    step_graphs: bool | None = None
    """Capture the decode steps as CUDA graphs; default: on with a CUDA device."""
    output: str | None = None
    """JSON file rank 0 writes: per prompt the token ids, text and mean acceptance length."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {sorted(MODES)}, got '{self.mode}'")


def main(argv: list[str] | None = None) -> None:
    from dscale_runtime.demo.prompts import stdlib_prompts
    from dscale_runtime.server.config import DEMO_DRAFTER, DEMO_PREDICTOR, DEMO_TARGET
    from dscale_runtime.server.flags import parse_config

    cfg = parse_config(GenerateConfig, "python -m dscale_runtime.distributed", argv,
                       "Generate with the target (and drafter) split over the ranks torchrun started.")
    tp = init_tensor_parallel(cfg.device)
    try:
        on_cuda = torch.device(cfg.device).type == "cuda"
        config = EngineConfig(mode=cfg.mode, device=cfg.device, dtype=cfg.dtype,
                              max_running_requests=cfg.max_running_requests, max_model_len=cfg.max_model_len,
                              step_graphs=on_cuda if cfg.step_graphs is None else cfg.step_graphs)
        drafter = (cfg.drafter or DEMO_DRAFTER) if cfg.mode != "target" else None
        predictor = (cfg.predictor or DEMO_PREDICTOR) if cfg.mode == "dscale" else None
        engine = engine_from_pretrained(cfg.target or DEMO_TARGET, drafter, predictor, config, tp)
        prompts = [cfg.prompt] if cfg.prompt is not None else [p["prompt"] for p in stdlib_prompts()[:cfg.num_prompts]]
        params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=i)
                  for i in range(len(prompts))]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
        if tp.rank == 0:
            tokens = sum(len(o.token_ids) for o in outputs)
            for out in outputs:
                print(f"--- {out.request_id} (mean acceptance {out.stats.mean_acceptance_length:.2f})\n{out.text}")
            print(f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tokens/s), tensor parallel {tp.size}")
            if cfg.output:
                Path(cfg.output).write_text(json.dumps([
                    {"token_ids": o.token_ids, "text": o.text, "mean_acceptance_length": o.stats.mean_acceptance_length}
                    for o in outputs], indent=1))
    finally:
        close_tensor_parallel()


if __name__ == "__main__":
    from dscale_runtime.torchrun import run_worker

    run_worker(main)  # NOTE: every rank torchrun started ends there (dscale_runtime/torchrun.py)
