"""dscale-train: prompt-disjoint split, determinism, export (.pt for the runtime, .onnx for others)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml

from checkpoints import write_drafter, write_target
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.dvl.features import FeatureSpec, hidden_projection
from dscale_runtime.dvl.predictor import load_predictor, pair_identity
from dscale_runtime.engine import Engine
from dscale_runtime.models.config import load_drafter_config, load_target_config
from dscale_predictor.data import prompt_split, read_traces
from dscale_predictor.train import TrainConfig, train
from trace_collection.store import TraceStore


def write_synthetic_traces(folder, target, drafter, num_prompts=90, seed=0, temperatures=(0.0, 1.0)):
    """Traces in the dscale-collect format whose labels follow the drafts' top1-top2 gaps (plus noise) and, at
    T = 1, fall by two drafts a step: a predictor must read the temperature column to stay calibrated."""
    spec = FeatureSpec()
    rng = np.random.default_rng(seed)
    proj = hidden_projection(spec, 32)
    store = TraceStore(folder)
    manifest = store.open({
        "feature_spec": spec.to_dict(), "feature_width": spec.width, "feature_names": spec.names(),
        "hidden_projection_sha256": hashlib.sha256(proj.numpy().tobytes()).hexdigest(),
        "models": {}, "config": {"target": str(target), "drafter": str(drafter)}, "prompts": {}})
    chunk = 0
    for t in temperatures:
        for c in (8, 16):
            cols = {k: [] for k in ("prompt_id", "dataset", "concurrency", "request_id", "step", "batch_id",
                                    "num_live", "context_len", "accepted", "features", "temperature",
                                    "sampling_rule")}
            for step in range(40):
                live = rng.choice(num_prompts, size=c, replace=False)
                for p in live:
                    quality = rng.normal(p % 7 - 3, 1.0)  # prompts differ in how well they are drafted
                    f = rng.normal(0, 1, spec.width).astype(np.float32)
                    gaps = np.clip(quality + 2 - 0.4 * np.arange(15) + rng.normal(0, 0.5, 15), 0, None)
                    f[[j * spec.per_position + 1 for j in range(15)]] = gaps
                    f[spec.temperature_column : spec.temperature_column + spec.num_sampling] = [t, float(t > 0)]
                    cols["prompt_id"].append(f"{'ab'[p % 2]}/{p}")
                    cols["dataset"].append("ab"[p % 2])
                    cols["concurrency"].append(c)
                    cols["request_id"].append(f"c{c}-t{t}-p{p}")
                    cols["step"].append(step)
                    cols["batch_id"].append(f"c{c}-t{t}-k0-s{step}")
                    cols["num_live"].append(c)
                    cols["context_len"].append(100 + step)
                    cols["accepted"].append(int(np.clip(np.round(2 * quality + 5 - 2 * t + rng.normal(0, 1)), 0, 15)))
                    cols["features"].append(f.tolist())
                    cols["temperature"].append(t)
                    cols["sampling_rule"].append("sampled" if t > 0 else "greedy")
            store.write_shard(c, chunk, cols, spec.width, t)
    store.update_counts(manifest)
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target, drafter = write_target(root / "target", tokenizer=True), write_drafter(root / "drafter")
    traces = write_synthetic_traces(root / "traces", target, drafter)
    cfg = TrainConfig(traces=str(traces), run_dir=str(root / "run1"), artifacts_dir=str(root / "artifacts"),
                      export_name="tiny", max_epochs=6, batch_size=256, lr=2e-3, weight_decay=0.01,
                      accelerator="cpu")
    report = train(cfg)
    return root, cfg, report


def test_configs_have_a_train_section():
    for name in ("demo", "qwen3-8b", "qwen3-4b"):
        TrainConfig(**yaml.safe_load(open(f"configs/{name}.yaml"))["train"])


def test_split_is_prompt_disjoint_stratified_and_deterministic(setup):
    root, cfg, _ = setup
    traces = read_traces(cfg.traces)
    split = prompt_split(traces.prompt_id, traces.dataset, (0.8, 0.1, 0.1), seed=0)
    owners = {}
    for pid, s in zip(traces.prompt_id.tolist(), split.tolist()):
        assert owners.setdefault(pid, s) == s, f"prompt {pid} in two splits"
    for name in ("a", "b"):
        assert set(split[traces.dataset == name].tolist()) == {0, 1, 2}
    assert np.array_equal(split, prompt_split(traces.prompt_id, traces.dataset, (0.8, 0.1, 0.1), seed=0))
    assert not np.array_equal(split, prompt_split(traces.prompt_id, traces.dataset, (0.8, 0.1, 0.1), seed=1))


def test_report_has_metrics_and_baselines(setup):
    root, cfg, report = setup
    assert 100_000 <= report["parameters"] <= 125_000
    assert json.loads((root / "run1" / "report.json").read_text())["r2_accepted"] == report["r2_accepted"]
    assert (root / "run1" / "evaluation.png").stat().st_size > 1000
    assert (root / "run1" / "config.json").is_file() and list((root / "run1" / "logs").rglob("metrics.csv"))
    assert len(report["per_position"]["auroc"]) == 15
    assert report["r2_accepted"] > 0.3, "labels follow the features: the predictor must find that"
    for n in ("8", "16"):
        row = report["retention"][n]
        assert set(row) == {"predictor", "mean_gap_heuristic", "online_logistic", "fixed_width_8", "oracle"}
        assert row["predictor"]["mean_verify_len"] == pytest.approx(8.0)
        assert row["predictor"]["retention"] > row["fixed_width_8"]["retention"]
    assert report["retention"]["32"]["predictor"]["cohorts"] >= 1
    # The bound at every budget and cohort size: no method keeps more, and it spends the same rows.
    assert list(report["retention_by_budget"]) == ["0.5", "0.25"] and report["budget_ratios"] == [0.5, 0.25]
    assert report["retention_by_budget"]["0.5"] == report["retention"]
    for ratio, table in report["retention_by_budget"].items():
        for n, row in table.items():
            bound = row["oracle"]
            assert bound["mean_verify_len"] == pytest.approx(float(ratio) * 16) and bound["of_bound"] == 1.0
            width = round(float(ratio) * 16)
            assert row[f"fixed_width_{width}"]["mean_verify_len"] == width
            for name, figures in row.items():
                assert figures["retention"] <= bound["retention"], (ratio, n, name)
                assert figures["of_bound"] == pytest.approx(figures["retention"] / bound["retention"], abs=1e-4)
            assert row["predictor"]["cohorts"] == bound["cohorts"]
    # Per temperature: calibration and retention of each temperature's records.
    temps = report["by_temperature"]
    assert set(temps) == {"0.0", "1.0"} and temps["1.0"]["sampling_rules"] == ["sampled"]
    assert sum(t["records"] for t in temps.values()) == report["test_records"]
    assert temps["1.0"]["mean_accepted"] < temps["0.0"]["mean_accepted"] - 1
    for t in temps.values():
        assert len(t["ece"]) == 15 and abs(t["mean_predicted"] - t["mean_accepted"]) < 1.0
        assert set(t["retention_by_budget"]) == {"0.5", "0.25"}
        assert len(t["uncalibrated"]["ece"]) == 15  # the scores before the artifact's calibration, beside
    # The calibration is fitted on the validation split, one map per temperature there.
    cal = report["calibration"]
    assert cal["temperatures"] == [0.0, 1.0] and cal["fitted_on"] == "val"
    assert all(v["records"] > 0 and len(v["ece"]) == 3 for v in cal["val"].values())


@pytest.mark.parametrize("n,width,ratio", [(3, 5, 0.5), (4, 4, 0.25), (3, 6, 0.75), (5, 3, 0.4)])
def test_oracle_lengths_are_the_budgeted_optimum(n, width, ratio):
    """The bound against brute force: every verify-length vector in [1, W]^n that spends the budget exactly."""
    import itertools

    from dscale_runtime.dvl.allocate import budget_rows
    from dscale_predictor.evaluate import oracle_lengths

    rng = np.random.default_rng(n * 100 + width)
    budget = budget_rows(n, width, ratio)
    for _ in range(25):
        y = rng.integers(0, width, size=n)  # accepted drafts 0..W-1
        best = max(np.minimum(y, np.array(k) - 1).sum() for k in itertools.product(range(1, width + 1), repeat=n)
                   if sum(k) == budget)
        k = oracle_lengths(y, budget, width)
        assert k.sum() == budget and k.min() >= 1 and k.max() <= width
        assert np.minimum(y, k - 1).sum() == best == min(y.sum(), budget - n)


def test_same_seed_same_metrics(setup):
    root, cfg, report = setup
    again = train(replace(cfg, run_dir=str(root / "run2"), export_name="tiny2"))
    strip = lambda r: {k: v for k, v in r.items() if k != "train_seconds"}  # noqa: E731
    assert strip(again) == strip(report)


def test_killed_run_resumes_to_the_uninterrupted_report(setup):
    """An exception in the middle of epoch 3 of 6 (a kill between checkpoints), then the same command: it resumes from
    last.ckpt and ends with the uninterrupted run's report; a rerun of the finished run gives it again, and a run
    dir of another setup is refused."""
    from lightning.pytorch.callbacks import Callback

    from dscale_predictor.data import TraceError

    class Killed(RuntimeError):
        pass

    class KillAfter(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.current_epoch == 2 and batch_idx == 1:
                raise Killed("killed in the middle of epoch 3")

    root, cfg, report = setup
    cfg3 = replace(cfg, run_dir=str(root / "run3"), export_name="tiny3")
    with pytest.raises(Killed):
        train(cfg3, callbacks=(KillAfter(),))
    checkpoints = root / "run3" / "checkpoints"
    assert (checkpoints / "last.ckpt").is_file() and not (checkpoints / "finished.json").exists()
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["epoch"] == 1  # epochs 1-2 done, 3 lost
    strip = lambda r: {k: v for k, v in r.items() if k != "train_seconds"}  # noqa: E731
    resumed = train(cfg3)
    assert strip(resumed) == strip(report)
    assert strip(train(cfg3)) == strip(report)  # finished: evaluated again from its best checkpoint
    with pytest.raises(TraceError, match="lr=0.002.*another --run_dir"):
        train(replace(cfg3, lr=1e-3))


def test_onnx_equals_pytorch(setup):
    import onnxruntime as ort

    root, cfg, _ = setup
    art = root / "artifacts"
    model, _ = load_predictor(art / "tiny.pt")
    assert model.calibration_temperatures == (0.0, 1.0)  # the graph carries the temperature bands' maps too
    session = ort.InferenceSession(str(art / "tiny.onnx"))
    x = torch.randn(1000, model.spec.width) * 3
    got = session.run(["scores"], {"features": x.numpy()})[0]
    want = model.scores(x).detach().numpy()
    assert np.abs(got - want).max() <= 1e-5


def test_artifact_runs_in_the_engine_losslessly(setup):
    root, _, _ = setup
    identity = pair_identity(load_target_config(root / "target"), load_drafter_config(root / "drafter"))
    load_predictor(root / "artifacts" / "tiny.pt", identity)  # identity check passes for its own pair
    prompts = [[5, 6, 7, 8], [9] * 20, [1, 2]]
    params = SamplingParams(temperature=0, max_tokens=20)
    want = Engine.from_pretrained(root / "target", config=EngineConfig(mode="target")).generate(prompts, params)
    engine = Engine.from_pretrained(root / "target", root / "drafter", predictor=root / "artifacts" / "tiny.pt",
                                    config=EngineConfig(mode="dscale", max_running_requests=3))
    got = engine.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def _train_cli(monkeypatch, argv: list[str]) -> TrainConfig:
    """dscale-train's main() with `argv`; returns the config it would train with."""
    import dscale_predictor.train as module

    seen = []
    monkeypatch.setattr(module, "train", seen.append)
    module.main(argv)
    return seen[0]


@pytest.mark.parametrize("name", ["demo", "qwen3-8b", "qwen3-4b"])
def test_cli_reads_each_config_and_takes_dashed_flags(monkeypatch, name):
    from pathlib import Path

    configs = str(Path(__file__).resolve().parents[1] / "configs")
    section = TrainConfig(**yaml.safe_load((Path(configs) / f"{name}.yaml").read_text())["train"])
    assert _train_cli(monkeypatch, ["--target", name, "--configs-dir", configs]) == section
    dashed = _train_cli(monkeypatch, ["--target", name, "--configs-dir", configs, "--max-epochs", "2",
                                      "--hidden-sizes", "[8, 4]", "--run-dir", "runs/x", "--val-fraction", "0.2"])
    underscored = _train_cli(monkeypatch, ["--target", name, "--configs_dir", configs, "--max_epochs", "2",
                                           "--hidden_sizes", "[8, 4]", "--run_dir", "runs/x", "--val_fraction", "0.2"])
    assert dashed == underscored == replace(section, max_epochs=2, hidden_sizes=[8, 4], run_dir="runs/x",
                                            val_fraction=0.2)


def test_cli_errors_and_help(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        _train_cli(monkeypatch, ["--target", "no-such-target"])
    assert "no such config file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _train_cli(monkeypatch, ["--max-epochz", "2"])
    with pytest.raises(SystemExit):
        _train_cli(monkeypatch, ["--help"])
    text = capsys.readouterr().out
    assert "--max-epochs" in text and "--configs-dir" in text and "--max_epochs" not in text


def test_position_weights_weigh_the_positions_bce():
    """`position_weights`: equal weights give the DESIGN 3.2 loss; weight on one position alone gives that position's
    BCE (plus the count term); a wrong number of weights, a negative one or a zero sum is refused by name."""
    import torch.nn.functional as F

    from dscale_predictor.model import MSE_WEIGHT, PredictorModule, position_labels, record_losses

    gen = torch.Generator().manual_seed(0)
    logits, accepted = torch.randn(6, 15, generator=gen), torch.tensor([0, 1, 3, 7, 15, 2])
    plain = record_losses(logits, accepted)
    assert torch.allclose(record_losses(logits, accepted, torch.full((15,), 2.0)), plain)
    one = torch.zeros(15)
    one[2] = 1.0
    bce = F.binary_cross_entropy_with_logits(logits[:, 2], position_labels(accepted, 15)[:, 2], reduction="none")
    count = MSE_WEIGHT * (torch.sigmoid(logits).sum(-1) - accepted.float()) ** 2
    assert torch.allclose(record_losses(logits, accepted, one), bce + count)
    spec = FeatureSpec().to_dict()
    assert PredictorModule(spec, (8,), position_weights=[1.0] * 15).position_weights.shape == (15,)
    for bad in ([1.0] * 14, [-1.0] + [1.0] * 14, [0.0] * 15):
        with pytest.raises(ValueError, match="position_weights"):
            PredictorModule(spec, (8,), position_weights=bad)


def test_feature_version_selects_a_prefix_of_the_same_drafter_family():
    """`--feature-version`: v2 from v3 traces keeps the leading columns (of either family); a version of the other
    drafter family (DFlash 1 logits vs DFlash 2 selector scores: same column names, other meaning) is refused, as
    is one whose layout is not a prefix of the traces'."""
    from dscale_predictor.data import TraceError, Traces, select_traces

    for family in ("dscale-features", "dscale-features-dflash2"):
        spec = FeatureSpec(version=f"{family}-v3")
        n = 4
        traces = Traces(np.arange(n * spec.width, dtype=np.float32).reshape(n, -1), np.zeros(n, dtype=np.int64),
                        np.array(["p"] * n, dtype=object), np.array(["d"] * n, dtype=object),
                        np.array(["b"] * n, dtype=object), np.full(n, 8), {})
        assert select_traces(traces, spec, None, None) == (traces, spec)
        got, want = select_traces(traces, spec, None, f"{family}-v2")
        assert want.version == f"{family}-v2" and want.num_agreement == 0
        assert np.array_equal(got.features, traces.features[:, : want.width])
        other = "dscale-features-v2" if "dflash2" in family else "dscale-features-dflash2-v2"
        with pytest.raises(TraceError, match="another drafter's signals"):
            select_traces(traces, spec, None, other)
        with pytest.raises(TraceError, match="not a prefix"):
            select_traces(traces, FeatureSpec(version=f"{family}-v2"), None, f"{family}-v3")
