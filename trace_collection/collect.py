"""`dscale-collect`: full-width DFlash over prompt sets at several concurrencies, logging every request-step.

For each concurrency c, the prompts are cut into fixed chunks; each chunk is decoded by the engine with
`max_running_requests = c` (requests join as others finish), and its records (features from the shared
feature module, the accepted draft count as the label, ids) become one Parquet shard, written atomically.
A rerun of the same command skips the shards that exist, so a crash loses at most the chunk in flight and
duplicates nothing; decoding is deterministic, so the resumed dataset equals an uninterrupted one.

Several workers (`--num-workers N` on this node, or torchrun on a cluster: trace_collection/workers.py) share one
trace folder: rank 0 checks or creates the manifest and lists the unfinished chunks, worker r decodes items
r, r + N, ... of that list and writes their shards, and rank 0 writes the final counts once all are done. A chunk's
records do not depend on which worker decoded it or what it decoded before, so any number of workers, and any
mix of interrupted runs, gives the records of one uninterrupted worker.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field


from trace_collection.sources import DatasetSpec, format_prompt, load_prompts
from trace_collection.store import TraceFolderError, TraceStore, model_files, write_json_atomic
from trace_collection.workers import Workers, env_rank, launch_local, launched, worker_group

# Fields that do not change the records: where they go, how progress is shown, how many workers decode them.
NOT_IDENTITY = ("output", "progress", "log_records", "num_workers")
# How long a worker waits to see rank 0's new manifest.json (a network filesystem may show a new file late).
SHARED_FOLDER_WAIT_S = 60.0


@dataclass(frozen=True)
class CollectConfig:
    """A trace collection: models, prompt sources, concurrencies and decoding limits."""

    target: str = "artifacts/demo/target"
    """Target checkpoint folder (Qwen3, Hugging Face layout)."""
    drafter: str = "artifacts/demo/drafter"
    """DFlash drafter checkpoint folder (z-lab layout)."""
    output: str = "traces/demo"
    """Trace folder (created; rerunning the same command resumes it)."""
    datasets: list[DatasetSpec] = field(default_factory=lambda: [DatasetSpec("demo-stdlib")])
    """Prompt sources (see trace_collection.sources.DatasetSpec)."""
    max_prompts: int | None = None
    """Prompts per dataset (the first ones of each); None takes all."""
    concurrency: list[int] = field(default_factory=lambda: [8, 16, 32])
    """Concurrency levels (max running requests); every prompt is decoded once at each level."""
    max_new_tokens: int = 128
    """Generated tokens per request (at most)."""
    temperature: float = 0.0
    """0 is greedy (the paper's setting); > 0 samples with per-request seeds derived from `seed`."""
    temperatures: list[float] = field(default_factory=list)
    """Several temperatures into one trace set: every prompt is decoded at each (and every concurrency); empty
    takes `temperature` alone. Each record carries its temperature and sampling rule."""
    sampling_rule: str = "auto"
    """The engine's acceptance rule for sampled requests (EngineConfig.sampling_rule: auto, top1, sampled); collect
    with the rule the server will use: the accepted counts depend on it."""
    seed: int = 0
    """Seed of the sampling streams and of the engine."""
    chunk_prompts: int = 64
    """Prompts per shard (the unit of resume)."""
    chat_template: str = "auto"
    """'auto' (apply the tokenizer's chat template, thinking disabled, when it has one), 'on' or 'off'."""
    device: str = "cpu"
    """Torch device."""
    dtype: str = "auto"
    """Model dtype ('auto': bf16 on CUDA, fp32 on CPU)."""
    max_model_len: int = 4096
    """Longest prompt + output; longer prompts are skipped with a warning."""
    progress: bool = True
    """Show a progress bar."""
    log_records: bool = True
    """Write records (False only measures the cost of logging: nothing is written)."""
    num_workers: int = 1
    """Workers on this node, launched through torchrun (`--standalone --nproc-per-node N`); with `device: cuda`
    worker i decodes on cuda:i. Leave at 1 under an outside torchrun launch (a cluster): its workers read
    RANK / WORLD_SIZE / LOCAL_RANK. Not part of the collection's identity: the records are the same."""

    def __post_init__(self) -> None:
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"concurrency must be a non-empty list of positive levels, got {self.concurrency}")
        if self.chunk_prompts < 1:
            raise ValueError(f"chunk_prompts must be >= 1, got {self.chunk_prompts}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if any(not t >= 0 for t in [self.temperature, *self.temperatures]):
            raise ValueError(f"temperature / temperatures must be >= 0, got {self.temperature} / {self.temperatures}")
        if len(set(self.temperatures)) != len(self.temperatures):
            raise ValueError(f"temperatures must be distinct, got {self.temperatures}")
        if self.chat_template not in ("auto", "on", "off"):
            raise ValueError(f"chat_template must be auto, on or off, got '{self.chat_template}'")
        specs = [d if isinstance(d, DatasetSpec) else DatasetSpec(**d) for d in self.datasets]
        object.__setattr__(self, "datasets", specs)

    @property
    def temperature_list(self) -> list[float]:
        return list(self.temperatures) or [self.temperature]


def _prompt_digest(prompts: list[dict]) -> str:
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(json.dumps([p["id"], p["prompt"]]).encode())
    return digest.hexdigest()


def collect(cfg: CollectConfig) -> dict:
    """Run (or resume) a collection, as one worker of a launch when started by one; returns the final manifest."""
    with worker_group(cfg.num_workers) as workers:
        return _collect(cfg, workers)


def _collect(cfg: CollectConfig, workers: Workers) -> dict:
    from dscale_runtime.config import EngineConfig, SamplingParams
    from dscale_runtime.dvl.features import drafter_feature_spec, hidden_projection
    from dscale_runtime.engine import Engine

    prompts = []
    for spec in cfg.datasets:
        prompts += load_prompts(spec)[: cfg.max_prompts]
    # NOTE: no prefix cache: a cached prefix prefills only the prompt's tail, in another GEMM shape, so a shard's
    # records (bf16 features) would depend on which shards its worker ran before it, i.e. on --num-workers.
    engine_cfg = EngineConfig(mode="dflash", max_running_requests=max(cfg.concurrency),
                              device=workers.device(cfg.device), dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                              seed=cfg.seed, sampling_rule=cfg.sampling_rule, prefix_caching=False)
    engine = Engine.from_pretrained(cfg.target, cfg.drafter, config=engine_cfg, trace_features=True)
    spec = drafter_feature_spec(engine.drafter.config)  # NOTE: DFlash 1 or DFlash 2 features, W - 1 positions
    store = TraceStore(cfg.output)
    tokenizer = engine.tokenizer
    texts = [format_prompt(tokenizer, p["prompt"], cfg.chat_template) if tokenizer else p["prompt"] for p in prompts]
    token_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    keep = [i for i, ids in enumerate(token_ids) if len(ids) + 1 < cfg.max_model_len]
    if len(keep) < len(prompts) and workers.rank == 0:
        print(f"dscale-collect: skipping {len(prompts) - len(keep)} prompts longer than max_model_len "
              f"{cfg.max_model_len}", file=sys.stderr)
    chunks = [keep[i : i + cfg.chunk_prompts] for i in range(0, len(keep), cfg.chunk_prompts)]
    # NOTE: chunk-major, so an interrupted collection holds every temperature and concurrency of its first chunks.
    work = [(t, c, k) for k in range(len(chunks)) for c in cfg.concurrency for t in cfg.temperature_list]
    # NOTE: rank 0 alone opens the folder and lists what is left, before any worker writes: a list made by each
    # worker could see shards another had already written and so share the plan differently.
    manifest = plan = None
    if workers.rank == 0:
        try:
            identity = _identity(cfg, spec, hidden_projection(spec, engine.drafter.config.layers.hidden_size), prompts)
            manifest = store.open(identity) if cfg.log_records else identity
            plan = ("ok", [(t, c, k) for t, c, k in work if not (cfg.log_records and store.has_shard(c, k, t))])
        except TraceFolderError as exc:
            plan = ("error", str(exc))
    status, todo = workers.broadcast(plan)
    if status == "error":
        workers.barrier()  # every worker has the message: all stop with it, none waits for a peer that left
        raise TraceFolderError(todo)
    if cfg.log_records and not _appears(store.manifest_path, SHARED_FOLDER_WAIT_S):
        raise TraceFolderError(f"{store.manifest_path}: worker {workers.rank} does not see the manifest rank 0 wrote; "
                               "--output must be one folder that every node of the launch sees (a shared filesystem)")
    mine = workers.share(todo)
    bar = _progress(cfg, sum(len(chunks[k]) for _, _, k in mine), len(work) - len(todo), workers)
    stats = {"steps": 0, "tokens": 0, "accepted": 0, "request_steps": 0, "start": time.time()}
    for t, c, k in mine:
        rows = _run_chunk(engine, cfg, t, c, k, chunks[k], prompts, token_ids, stats, bar, SamplingParams)
        if cfg.log_records:
            store.write_shard(c, k, rows, spec.width, t)
            if workers.rank == 0:  # NOTE: only rank 0 writes manifest.json; it counts every worker's shards so far
                manifest = store.update_counts(manifest)
    if bar is not None:
        bar.close()
    figures = {"rank": workers.rank, "shards": len(mine), "decode_steps": stats["steps"],
               "generated_tokens": stats["tokens"], "request_steps": stats["request_steps"]}
    by_worker = workers.gather(figures)
    if workers.rank == 0:
        manifest = store.update_counts(manifest) if cfg.log_records else manifest
        manifest.setdefault("counts", {})
        manifest["run"] = {"seconds": round(time.time() - stats["start"], 2), "workers": workers.world,
                           **{key: sum(f[key] for f in by_worker)
                              for key in ("decode_steps", "generated_tokens", "request_steps")}}
        if workers.world > 1:
            manifest["run"]["by_worker"] = by_worker
        if cfg.log_records:
            write_json_atomic(store.manifest_path, manifest)
    return workers.broadcast(manifest)


def _appears(path, seconds: float) -> bool:
    deadline = time.time() + seconds
    while not path.is_file():
        if time.time() > deadline:
            return False
        time.sleep(0.5)
    return True


def _identity(cfg: CollectConfig, spec, projection, prompts: list[dict]) -> dict:
    """What a trace folder must agree on with the run that extends it (manifest keys)."""
    return {
        "feature_spec": spec.to_dict(),
        "feature_width": spec.width,
        "feature_names": spec.names(),
        "hidden_projection_sha256": hashlib.sha256(projection.numpy().tobytes()).hexdigest(),
        "models": {"target": model_files(cfg.target), "drafter": model_files(cfg.drafter)},
        "config": {k: v for k, v in json.loads(json.dumps(asdict(cfg))).items() if k not in NOT_IDENTITY},
        "prompts": {"count": len(prompts), "sha256": _prompt_digest(prompts)},
    }


def _run_chunk(engine, cfg: CollectConfig, temperature: float, concurrency: int, chunk_index: int, chunk: list[int],
               prompts: list[dict], token_ids: list[list[int]], stats: dict, bar, SamplingParams) -> dict:
    """Decode one chunk at one temperature and concurrency; returns its records as Parquet columns."""
    from trace_collection.store import SAMPLING_RULE_NAMES

    engine.scheduler.max_running = concurrency
    engine._generator.manual_seed(cfg.seed * 1_000_003 + concurrency * 10_007 + chunk[0])
    columns: dict[str, list] = {k: [] for k in ("prompt_id", "dataset", "concurrency", "request_id", "step",
                                                "batch_id", "num_live", "context_len", "accepted", "features",
                                                "temperature", "sampling_rule")}
    # NOTE: ids name the temperature only in a set of several, so one-temperature ids stay those of format 1.
    tag = f"-t{round(temperature * 1000)}" if len(cfg.temperature_list) > 1 else ""
    rule_of: dict[str, str] = {}
    owner: dict[str, int] = {}
    chunk_steps = [0]

    def observe(trace) -> None:
        batch_id = f"c{concurrency}{tag}-k{chunk_index}-s{chunk_steps[0]}"
        chunk_steps[0] += 1
        feats = trace.features.tolist()
        for j, rid in enumerate(trace.request_ids):
            p = prompts[owner[rid]]
            columns["prompt_id"].append(p["id"])
            columns["dataset"].append(p["dataset"])
            columns["concurrency"].append(concurrency)
            columns["request_id"].append(rid)
            columns["step"].append(trace.decode_steps[j])
            columns["batch_id"].append(batch_id)
            columns["num_live"].append(trace.num_live)
            columns["context_len"].append(trace.context_lens[j])
            columns["accepted"].append(trace.accepted_lens[j])
            columns["features"].append(feats[j])
            columns["temperature"].append(temperature)
            columns["sampling_rule"].append(rule_of[rid])

    # NOTE: without an observer the engine computes no features: log_records=False measures bare decoding.
    if cfg.log_records:
        engine.step_observers.append(observe)
    try:
        for i in chunk:
            rid = f"c{concurrency}{tag}-p{i}"
            owner[rid] = i
            params = SamplingParams(temperature=temperature, max_tokens=cfg.max_new_tokens,
                                    seed=cfg.seed * 1_000_003 + i if temperature > 0 else None)
            rule_of[rid] = SAMPLING_RULE_NAMES[engine._rule(params)]
            engine.add_request(token_ids[i], params, request_id=rid)
        while engine.has_unfinished():
            before = (engine.counters.steps, engine.counters.request_steps, engine.counters.accepted_drafts)
            finished = engine.step()
            stats["steps"] += engine.counters.steps - before[0]
            stats["request_steps"] += engine.counters.request_steps - before[1]
            stats["accepted"] += engine.counters.accepted_drafts - before[2]
            for out in finished:
                stats["tokens"] += len(out.token_ids)
                if bar is not None:
                    bar.update(1)
                    elapsed = max(time.time() - stats["start"], 1e-9)
                    bar.set_postfix(steps_s=f"{stats['steps'] / elapsed:.1f}", tok_s=f"{stats['tokens'] / elapsed:.0f}",
                                    acc_len=f"{1 + stats['accepted'] / max(stats['request_steps'], 1):.2f}")
    finally:
        if cfg.log_records:
            engine.step_observers.remove(observe)
    return columns


def _progress(cfg: CollectConfig, total: int, done_shards: int, workers: Workers):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    desc = (f"worker {workers.rank}: " if workers.world > 1 else "") + "prompts"
    desc += f" (resumed: {done_shards} shards already written)" if done_shards else ""
    return tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr, position=workers.local_rank)


def main(argv: list[str] | None = None) -> None:
    """`dscale-collect --config configs/demo.yaml [--max-prompts N] [--concurrency [8,16]] [--num-workers N] ...`"""
    from dscale_runtime.cli import pre_parse, section_parser

    argv = sys.argv[1:] if argv is None else argv
    config_path = pre_parse(argv, ("--config", None)).config
    parser = section_parser("dscale-collect", __doc__, CollectConfig, "collect", config_path,
                            extra=(("--config", {"type": str, "help": "configs/<target>.yaml (its `collect:` section)"}),))
    args = parser.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k != "config"}
    values["datasets"] = [d if isinstance(d, DatasetSpec) else DatasetSpec(**vars(d)) if hasattr(d, "__dict__")
                          else DatasetSpec(**d) for d in values["datasets"]]
    try:
        config = CollectConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
    if config.num_workers > 1 and not launched():
        launch_local(config.num_workers, argv)  # this same command in N workers; rank 0 prints the summary
        return
    manifest = collect(config)
    if env_rank() == 0:
        print(json.dumps({"output": values["output"], "counts": manifest.get("counts"), "run": manifest.get("run")}))


if __name__ == "__main__":
    from dscale_runtime.torchrun import run_worker

    run_worker(main)  # NOTE: the workers `--num-workers` launches run this module; each ends there (torchrun.py)
