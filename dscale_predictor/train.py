"""`dscale-train --target demo`: fit the acceptance predictor on traces, evaluate it, export it.

Reads the `train:` section of `configs/<target>.yaml`, command-line overrides on top, and saves the
resolved config beside the outputs in `<run_dir>/`: Lightning CSV logs (curves), the best checkpoint and the
last one (written every epoch), `report.json`, PNG plots; then `artifacts/<export_name>.pt` and `.onnx`.

Resume: an interrupted run (killed, out of time) leaves `<run_dir>/checkpoints/last.ckpt`; rerunning the same
command continues from it (Lightning's `ckpt_path`: weights, optimiser, scheduler, early-stopping and checkpoint
state, the epoch) and ends with the report an uninterrupted run gives. A run dir whose checkpoint came from a
different training setup is refused; a finished run is evaluated and exported again from its best checkpoint.

Several devices or nodes: `--devices N --strategy ddp [--num-nodes M]` (Lightning starts one process per device
from this same command, or runs inside torchrun's / SLURM's processes). `batch_size` stays the records per
optimiser step: each of the N x M processes takes batch_size / (N x M) of every batch (data.GlobalBatches), so
the steps, and the results, are those of one device up to float summation order. Rank 0 alone writes the
config, the report and the artifacts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from dscale_runtime.dvl.calibration import conditional_scores, fit_knots
from dscale_runtime.dvl.features import FeatureSpec, hidden_projection
from dscale_runtime.dvl.predictor import AcceptancePredictor, pair_identity
from dscale_runtime.models.config import load_drafter_config, load_target_config
from dscale_predictor.data import TraceDataModule, TraceError, Traces
from dscale_predictor.evaluate import add_uncalibrated, calibration, evaluate
from dscale_predictor.export import export_onnx, export_pt
from dscale_predictor.model import PredictorModule

# Lightning strategies whose workers are spawned from inside this Python process: after fit it holds the weights
# but not the loop state (epochs run) the report needs.
SPAWNING_STRATEGIES = ("ddp_spawn", "ddp_fork", "ddp_notebook")
# Fields that do not change the trained weights: a run may be resumed with other values of these.
NOT_TRAINING = ("run_dir", "export_name", "artifacts_dir", "cohort_sizes", "budget_ratio", "budget_ratios",
                "accelerator", "devices", "strategy", "num_nodes", "target_path", "drafter_path", "calibrate")
FINISHED = "finished.json"  # in <run_dir>/checkpoints: the run's fit ended (its epochs)


@dataclass(frozen=True)
class TrainConfig:
    """Predictor training, evaluation and export."""

    traces: str = "traces/demo"
    """Trace folder written by dscale-collect."""
    run_dir: str = "runs/demo"
    """Where logs, checkpoints, report.json, plots and the resolved config go."""
    export_name: str = "demo"
    """Artifacts are written as <artifacts_dir>/<export_name>.pt and .onnx."""
    artifacts_dir: str = "artifacts"
    """Folder of the exported artifacts."""
    hidden_sizes: list[int] = field(default_factory=lambda: [224, 128])
    """MLP widths (the default gives ~114K parameters)."""
    position_weights: list[float] | None = None
    """Weight of each draft position's BCE term (W - 1 non-negative values; None: equal), e.g. to stress the
    positions a tight budget cuts at. The weighted mean replaces the plain mean over positions."""
    lr: float = 5e-4
    """AdamW peak learning rate (cosine decay over max_epochs)."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    batch_size: int = 1024
    """Records per optimiser step, on any number of devices (each of D devices takes batch_size / D of it)."""
    max_epochs: int = 30
    """Upper bound on epochs (early stopping on val_loss usually ends sooner)."""
    patience: int = 4
    """Epochs without val_loss improvement before stopping."""
    seed: int = 0
    """Seed of the split, initialisation and shuffling."""
    val_fraction: float = 0.1
    """Share of each dataset's prompts in the validation split."""
    test_fraction: float = 0.1
    """Share of each dataset's prompts in the test split."""
    cohort_sizes: list[int] = field(default_factory=lambda: [8, 16, 32])
    """Cohort sizes N for retention at budget `ratio x W x N`."""
    budget_ratio: float = 0.5
    """Verification budget of the headline retention (0.5 = 8N for W = 16): the report's `retention`."""
    budget_ratios: list[float] = field(default_factory=lambda: [0.5, 0.25])
    """Every budget the report evaluates (`retention_by_budget`, with the bound), `budget_ratio` included."""
    temperatures: list[float] | None = None
    """Train and evaluate on the records at these temperatures only (a predictor for one band); None: all."""
    feature_version: str | None = None
    """Feature layout of the predictor: None the traces' own; 'dscale-features-v1' from v2 traces drops the
    sampling columns (a predictor that does not see the request's temperature)."""
    accelerator: str = "auto"
    """Lightning accelerator (cpu, gpu, auto)."""
    devices: int | str = 1
    """Lightning devices per node: a count, 'auto', or GPU indices ('0,1'); more than one trains with DDP."""
    strategy: str = "auto"
    """Lightning strategy: 'auto' or 'ddp' (one process per device, started by Lightning from this command or by
    torchrun / SLURM); strategies that spawn workers from inside Python (ddp_spawn, ddp_fork, ddp_notebook) are
    refused: the report needs the loop state of the process that trained."""
    num_nodes: int = 1
    """Lightning nodes (machines) of the run, each with `devices` processes."""
    calibrate: bool = True
    """Fit the artifact's calibration map per temperature on the validation split (the live map's form, one per
    temperature there; a request takes its nearest temperature's map); False exports the uncalibrated scores."""
    target_path: str | None = None
    """Target folder for the artifact's identity (None: the one recorded in the trace manifest)."""
    drafter_path: str | None = None
    """Drafter folder for the artifact's identity (None: the one recorded in the trace manifest)."""

    def __post_init__(self) -> None:
        if self.strategy.startswith(SPAWNING_STRATEGIES):
            raise ValueError(f"strategy '{self.strategy}' is not supported: use --strategy ddp (Lightning starts one "
                             "process per device from this command) or launch dscale-train with torchrun")
        if self.num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {self.num_nodes}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not all(0 < r <= 1 for r in [self.budget_ratio, *self.budget_ratios]):
            raise ValueError(f"budget_ratio / budget_ratios must lie in (0, 1], got {self.budget_ratio} / "
                             f"{self.budget_ratios}")

    @property
    def eval_ratios(self) -> tuple[float, ...]:
        """The evaluated budgets, the headline one first."""
        return tuple(dict.fromkeys([self.budget_ratio, *self.budget_ratios]))


def train(cfg: TrainConfig, callbacks: tuple = ()) -> dict | None:
    """Train, evaluate and export; returns the report (None on the other ranks of a multi-device run).

    Lightning's `deterministic=True` turns on torch's deterministic algorithms and sets CUBLAS_WORKSPACE_CONFIG
    for the whole process; both are put back when training ends, so a caller's process (a notebook, the tests,
    a collection followed by training) keeps the settings it had."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:
        return _train(cfg, callbacks)
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        if saved[2] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[2]


def _resume_point(cfg: TrainConfig, run_dir: Path) -> tuple[Path | None, dict | None]:
    """(last checkpoint to resume from, the finished run's record); refuses a run dir of another setup."""
    last, done = run_dir / "checkpoints" / "last.ckpt", run_dir / "checkpoints" / FINISHED
    if not last.is_file():
        return None, None
    saved = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").is_file() else {}
    now = json.loads(json.dumps(asdict(cfg)))
    for key, value in now.items():
        if key not in NOT_TRAINING and saved.get(key) != value:
            raise TraceError(f"{run_dir}: holds a checkpoint of a run with {key}={saved.get(key)!r}, this run has "
                             f"{value!r}; pass another --run_dir (or delete {run_dir / 'checkpoints'} to start over)")
    return last, json.loads(done.read_text()) if done.is_file() else None


def _train(cfg: TrainConfig, callbacks: tuple = ()) -> dict | None:
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    resume, finished = _resume_point(cfg, run_dir)
    dm = TraceDataModule(cfg.traces, (1 - cfg.val_fraction - cfg.test_fraction, cfg.val_fraction,
                                      cfg.test_fraction), cfg.seed, cfg.batch_size, cfg.temperatures,
                         cfg.feature_version)
    dm.setup()
    manifest = dm.splits["train"].manifest
    spec = dm.spec
    identity, projection = _identity(cfg, manifest, spec)
    module = PredictorModule(spec.to_dict(), tuple(cfg.hidden_sizes), cfg.lr, cfg.weight_decay, dm.mean, dm.std,
                             cfg.position_weights)
    params = sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    # NOTE: save_last: last.ckpt after every epoch's validation, the point an interrupted run resumes from.
    checkpoint = ModelCheckpoint(dirpath=run_dir / "checkpoints", monitor="val_loss", mode="min", save_top_k=1,
                                 save_last=True)
    # NOTE: use_distributed_sampler=False: the data module cuts every batch across the ranks itself (GlobalBatches);
    # Lightning's DistributedSampler would give each rank other records, in another order, than one device sees.
    trainer = L.Trainer(max_epochs=cfg.max_epochs, accelerator=cfg.accelerator, devices=cfg.devices,
                        strategy=cfg.strategy, num_nodes=cfg.num_nodes, use_distributed_sampler=False,
                        deterministic=True, logger=CSVLogger(run_dir, name="logs", version=""),
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[checkpoint, EarlyStopping("val_loss", patience=cfg.patience, mode="min"),
                                   *callbacks])
    if trainer.is_global_zero:
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        how = ("finished: evaluating its best checkpoint" if finished else f"resuming from {resume}" if resume
               else "new run")
        print(f"dscale-train: predictor with {params:,} trainable parameters; records train/val/test = "
              f"{len(dm.splits['train'])}/{len(dm.splits['val'])}/{len(dm.splits['test'])}; "
              f"{trainer.world_size} process(es), {cfg.batch_size} records per step; {how}", flush=True)
    start = time.time()
    if finished is None:
        trainer.fit(module, datamodule=dm, ckpt_path=resume)
        finished = {"epochs": trainer.current_epoch, "best": Path(checkpoint.best_model_path).name}
        if trainer.is_global_zero:
            (run_dir / "checkpoints" / FINISHED).write_text(json.dumps(finished) + "\n")
    seconds = time.time() - start
    if not trainer.is_global_zero:
        return None  # the other ranks of a DDP run: rank 0 evaluates and exports
    best_path = run_dir / "checkpoints" / finished["best"]
    best = PredictorModule.load_from_checkpoint(best_path, map_location="cpu", weights_only=False)
    model = best.model.cpu().eval()
    test, val = dm.splits["test"], dm.splits["val"]
    fitted, val_scores = fit_calibration(model, val) if cfg.calibrate else (None, None)
    with torch.no_grad():
        test_x = torch.from_numpy(test.features)
        raw = torch.sigmoid(model(test_x)).numpy()
        scores = model.scores(test_x).numpy()
        if val_scores is None:
            val_scores = model.scores(torch.from_numpy(val.features)).numpy()
    w = spec.num_positions + 1
    report = evaluate(scores, raw, test, dm.splits["train"], spec, tuple(cfg.cohort_sizes), cfg.eval_ratios, w)
    if fitted is not None:
        add_uncalibrated(report, np.minimum.accumulate(raw, axis=1), test, spec.num_positions)
        report["calibration"] = fitted
    from sklearn.metrics import r2_score

    report.update({"val_r2_accepted": round(float(r2_score(val.accepted, val_scores.sum(1))), 4),
                   "parameters": params, "train_seconds": round(seconds, 1), "epochs": finished["epochs"],
                   "records": {k: len(v) for k, v in dm.splits.items()},
                   "prompts": {k: len(set(v.prompt_id.tolist())) for k, v in dm.splits.items()},
                   "feature_spec": spec.to_dict(), "traces": cfg.traces, "temperatures": cfg.temperatures,
                   "budget_ratios": list(cfg.eval_ratios)})
    (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    _plots(report, run_dir)
    out = Path(cfg.artifacts_dir)
    names = {"traces": cfg.traces, "target": identity.pop("target_path"), "drafter": identity.pop("drafter_path")}
    export_pt(model, out / f"{cfg.export_name}.pt", identity, projection, _headline(report), names)
    export_onnx(model, out / f"{cfg.export_name}.onnx")
    print(json.dumps(_headline(report), indent=2))
    return report


def fit_calibration(model: AcceptancePredictor, val: Traces) -> tuple[dict, np.ndarray]:
    """Fit and set `model`'s calibration on the validation split: one map per temperature there (one map over
    every record when the features carry no temperature); returns what the report shows of it and the split's
    calibrated scores."""
    with torch.no_grad():
        raw = model.uncalibrated_scores(torch.from_numpy(val.features)).numpy()
    conditionals = conditional_scores(torch.from_numpy(raw)).double().numpy()
    temps = sorted(set(val.temperature.tolist())) if model.spec.temperature_column is not None else [0.0]
    bands = [np.flatnonzero(val.temperature == t) for t in temps] if len(temps) > 1 else [np.arange(len(val))]
    knots = np.stack([fit_knots(conditionals[rows], val.accepted[rows]) for rows in bands])
    model.set_calibration(temps, torch.from_numpy(knots))
    with torch.no_grad():
        mapped = model.scores(torch.from_numpy(val.features)).numpy()
    p = model.spec.num_positions
    return {"temperatures": temps, "fitted_on": "val",
            "val": {str(t): {"records": int(len(rows)),
                             "ece_uncalibrated": calibration(raw[rows], val.subset(rows), p)["ece"][:3],
                             "ece": calibration(mapped[rows], val.subset(rows), p)["ece"][:3]}
                    for t, rows in zip(temps, bands)}}, mapped


def _identity(cfg: TrainConfig, manifest: dict, spec: FeatureSpec) -> tuple[dict, torch.Tensor]:
    target = cfg.target_path or manifest["config"]["target"]
    drafter = cfg.drafter_path or manifest["config"]["drafter"]
    for name, path in (("target", target), ("drafter", drafter)):
        if not (Path(path) / "config.json").is_file():
            raise TraceError(f"{path}: the {name} recorded in the traces is not here; pass --{name}_path FOLDER "
                             "(only its config.json is read, for the artifact's identity)")
    tcfg, dcfg = load_target_config(target), load_drafter_config(drafter)
    projection = hidden_projection(spec, dcfg.layers.hidden_size)
    import hashlib

    if hashlib.sha256(projection.numpy().tobytes()).hexdigest() != manifest["hidden_projection_sha256"]:
        raise TraceError("the traces were collected with another hidden-state projection than this spec gives")
    identity = pair_identity(tcfg, dcfg)
    recorded = manifest.get("models", {}).get("drafter", {})
    identity["drafter_weights"] = {k: v for k, v in recorded.items() if k.endswith(".safetensors")}
    identity["target_path"], identity["drafter_path"] = str(target), str(drafter)
    return identity, projection


def _headline(report: dict) -> dict:
    ret = report["retention"]
    return {"r2_accepted": report["r2_accepted"], "spearman_mean_gap_vs_accepted":
            report["spearman_mean_gap_vs_accepted"], "auroc": report["per_position"]["auroc"],
            "retention_after_8N": {n: {m: (v or {}).get("retention") for m, v in row.items()} for n, row in ret.items()},
            "retention_raw": {n: (row["predictor"] or {}).get("retention_raw") for n, row in ret.items()},
            "retention_by_budget": {r: {n: {m: (v or {}).get("retention") for m, v in row.items()}
                                        for n, row in table.items()} for r, table in report["retention_by_budget"].items()},
            "ece_by_temperature": {t: e["ece"][:3] for t, e in report["by_temperature"].items()}}


def _plots(report: dict, run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = np.arange(1, len(report["per_position"]["auroc"]) + 1)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    auroc = [a if a is not None else np.nan for a in report["per_position"]["auroc"]]
    axes[0].bar(pos, auroc)
    axes[0].set(title="per-position AUROC", xlabel="draft position j", ylim=(0.5, 1.0))
    axes[1].plot(pos, report["per_position"]["brier"], marker="o", label="Brier")
    axes[1].plot(pos, report["per_position"]["ece"], marker="s", label="ECE")
    axes[1].set(title="calibration", xlabel="draft position j")
    axes[1].legend()
    sizes = list(report["retention"])
    methods = ["oracle", "predictor", "online_logistic", "mean_gap_heuristic"]
    methods += [m for m in report["retention"][sizes[0]] if m.startswith("fixed_width")]
    for i, m in enumerate(methods):
        vals = [(report["retention"][n].get(m) or {}).get("retention", np.nan) for n in sizes]
        axes[2].bar(np.arange(len(sizes)) + i * 0.16, vals, width=0.16, label=m)
    ratio = report["budget_ratios"][0]
    axes[2].set(title=f"retention at budget {ratio} x W x N (Algorithm 1; oracle = bound)",
                xticks=np.arange(len(sizes)) + 0.3,
                xticklabels=[f"N={n}" for n in sizes], ylim=(0, 1))
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(run_dir / "evaluation.png", dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """`dscale-train --target demo [--max-epochs 10] ...` (reads configs/<target>.yaml's `train:` section)."""
    from dscale_runtime.cli import pre_parse, section_parser

    argv = sys.argv[1:] if argv is None else argv
    known = pre_parse(argv, ("--target", None), ("--configs_dir", "configs"))
    path = Path(known.configs_dir) / f"{known.target}.yaml" if known.target else None
    parser = section_parser("dscale-train", __doc__, TrainConfig, "train", str(path) if path else None, extra=(
        ("--target", {"type": str, "help": "configs/<target>.yaml to read (e.g. demo, qwen3-8b)"}),
        ("--configs_dir", {"type": str, "default": "configs", "help": "folder of the target configs"})))
    args = parser.parse_args(argv)
    try:
        config = TrainConfig(**{k: v for k, v in vars(args).items() if k not in ("target", "configs_dir")})
    except ValueError as exc:
        parser.error(str(exc))
    train(config)


if __name__ == "__main__":
    main()
