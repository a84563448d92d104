"""dscale-train with DDP: two CPU processes (Lightning's ddp, gloo) train what one device trains; flags; batches."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from checkpoints import write_drafter, write_target
from dscale_predictor.data import GlobalBatches
from dscale_predictor.model import record_losses
from dscale_predictor.train import TrainConfig, train
from test_train import write_synthetic_traces

REPO = Path(__file__).resolve().parents[1]
# Two processes sum each batch's gradient in another order than one; over these few dozen AdamW steps that moves
# the weights by ~1e-7 (measured 4e-8), and the report's metrics (rounded to 4 decimals) not at all.
WEIGHT_ATOL = 1e-5
METRIC_ATOL = 2e-4


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_ddp")
    target, drafter = write_target(root / "target", tokenizer=True), write_drafter(root / "drafter")
    traces = write_synthetic_traces(root / "traces", target, drafter)
    # NOTE: batch 200 over 775 train records: the last batch (175) splits 88 / 87, so the parts' weighting matters.
    cfg = TrainConfig(traces=str(traces), run_dir=str(root / "one"), artifacts_dir=str(root / "artifacts"),
                      export_name="one", max_epochs=6, batch_size=200, lr=2e-3, weight_decay=0.01, accelerator="cpu")
    return root, cfg, train(cfg)


def _flat(value, path=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(v, f"{path}/{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _flat(v, f"{path}[{i}]")
    else:
        yield path, value


def test_two_cpu_processes_train_what_one_device_trains(one_device):
    root, cfg, report = one_device
    flags = ["--traces", cfg.traces, "--run-dir", str(root / "two"), "--artifacts-dir", cfg.artifacts_dir,
             "--export-name", "two", "--max-epochs", "6", "--batch-size", "200", "--lr", "0.002",
             "--weight-decay", "0.01", "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp"]
    proc = subprocess.run([sys.executable, "-m", "dscale_predictor.train", *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stderr, "a second process trained"
    assert proc.stdout.count("dscale-train: predictor with") == 1 and "2 process(es)" in proc.stdout
    assert proc.stdout.count('"r2_accepted"') == 1, "rank 0 alone evaluates and reports"
    two = json.loads((root / "two" / "report.json").read_text())
    assert json.loads((root / "two" / "config.json").read_text())["devices"] == 2
    want, got = dict(_flat(report)), dict(_flat(two))
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if key in ("/train_seconds", "/traces"):
            continue
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, abs=METRIC_ATOL), key
        else:
            assert got[key] == value, key
    assert report["r2_accepted"] > 0.3, "the comparison is between trained predictors"
    a = torch.load(Path(cfg.artifacts_dir) / "one.pt", weights_only=True)["state_dict"]
    b = torch.load(Path(cfg.artifacts_dir) / "two.pt", weights_only=True)["state_dict"]
    assert a.keys() == b.keys()
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= WEIGHT_ATOL
    assert (Path(cfg.artifacts_dir) / "two.onnx").is_file()


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_global_batches_give_every_rank_its_part_of_the_one_device_batches(world):
    num_records, batch = 23, 5
    one = GlobalBatches(num_records, batch, 0, 1, True, seed=3)
    ranks = [GlobalBatches(num_records, batch, r, world, True, seed=3) for r in range(world)]
    assert {len(s) for s in ranks} == {len(one)} == {5}  # every rank takes the same number of steps
    epochs = []
    for epoch in range(2):  # two epochs: a new permutation each, the same on every rank
        for sampler in (one, *ranks):
            sampler.set_epoch(epoch)  # Lightning's call before every epoch
        whole = list(one)
        epochs.append(torch.cat([i for i, _ in whole]))
        parts = [list(s) for s in ranks]
        for step, (indices, size) in enumerate(whole):
            pieces = [parts[r][step] for r in range(world)]
            assert all(s == size == len(indices) for _, s in pieces)
            assert torch.equal(torch.cat([p for p, _ in pieces]), indices)
            lens = [len(p) for p, _ in pieces]
            assert max(lens) - min(lens) <= 1
        assert sorted(torch.cat([i for i, _ in whole]).tolist()) == list(range(num_records))
    assert not torch.equal(epochs[0], epochs[1])
    one.set_epoch(1)
    assert torch.equal(torch.cat([i for i, _ in one]), epochs[1])  # a function of the epoch (a resumed run)
    assert [i.tolist() for i, _ in GlobalBatches(7, 3, 0, 1, False, 0)] == [[0, 1, 2], [3, 4, 5], [6]]


def test_rank_losses_average_to_the_global_batch_mean():
    """DDP averages the ranks' gradients; each rank's sum x world / global size makes that the one-device mean."""
    torch.manual_seed(0)
    weight = torch.randn(6, 15, requires_grad=True)
    x, y = torch.randn(5, 6), torch.randint(0, 16, (5,))
    record_losses(x @ weight, y).mean().backward()
    want = weight.grad.clone()
    for world in (2, 3, 7):  # parts of 3/2, 2/2/1, and 1/1/1/1/1 with two empty ranks
        grads = []
        for part in torch.arange(5).tensor_split(world):
            weight.grad = None
            (record_losses(x[part] @ weight, y[part]).sum() * world / 5).backward()
            grads.append(weight.grad.clone())
        assert torch.allclose(torch.stack(grads).mean(0), want, atol=1e-6), world


def _train_cli(monkeypatch, argv: list[str]) -> TrainConfig:
    import dscale_predictor.train as module

    seen = []
    monkeypatch.setattr(module, "train", seen.append)
    module.main(argv)
    return seen[0]


def test_devices_strategy_num_nodes_flags(monkeypatch, capsys):
    configs = str(REPO / "configs")
    base = _train_cli(monkeypatch, ["--target", "demo", "--configs-dir", configs])
    assert (base.devices, base.strategy, base.num_nodes) == (1, "auto", 1)  # one device unless asked
    got = _train_cli(monkeypatch, ["--target", "demo", "--configs-dir", configs, "--devices", "8", "--strategy", "ddp",
                                   "--num-nodes", "2"])
    assert got == replace(base, devices=8, strategy="ddp", num_nodes=2)
    demo = ["--target", "demo", "--configs-dir", configs]
    assert _train_cli(monkeypatch, [*demo, "--devices", "auto"]).devices == "auto"
    assert _train_cli(monkeypatch, [*demo, "--num_nodes", "3"]).num_nodes == 3  # the underscored alias
    for argv, message in ((["--strategy", "ddp_spawn"], "use --strategy ddp"), (["--num-nodes", "0"], "num_nodes")):
        with pytest.raises(SystemExit):
            _train_cli(monkeypatch, ["--target", "demo", "--configs-dir", configs, *argv])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _train_cli(monkeypatch, ["--help"])
    text = capsys.readouterr().out
    assert "--devices" in text and "--num-nodes" in text and "--strategy" in text
