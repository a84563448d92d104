"""dscale-collect over several workers (torchrun): one trace folder equal to one worker's, kills, resume, refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from checkpoints import write_drafter, write_target
from trace_collection.collect import NOT_IDENTITY, CollectConfig
from trace_collection.workers import WorkerError, Workers, worker_group

REPO = Path(__file__).resolve().parents[1]
IDENTITY = ("feature_spec", "feature_width", "feature_names", "hidden_projection_sha256", "models", "config", "prompts")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny pair, 12 prompts in chunks of 2 at concurrencies 2 and 4 (12 shards), and one worker's folder."""
    root = tmp_path_factory.mktemp("collect_distributed")
    write_target(root / "target", tokenizer=True)
    write_drafter(root / "drafter")
    rows = [{"id": f"p{i}", "prompt": "".join(chr(33 + (i * 11 + j) % 90) for j in range(4 + i % 7))}
            for i in range(12)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump({"collect": {
        "target": str(root / "target"), "drafter": str(root / "drafter"), "output": str(root / "unused"),
        "datasets": [{"name": "jsonl", "path": str(root / "prompts.jsonl"), "label": "tiny"}], "concurrency": [2, 4],
        "max_new_tokens": 32, "chunk_prompts": 2, "max_model_len": 128, "progress": False}}))
    # NOTE: torchrun gives each of several workers one thread (OMP_NUM_THREADS=1); fp32 CPU sums change in their last
    # bits with the thread count, so the one-worker oracle runs with one thread too.
    single = root / "single"
    proc = _run(config, single, threads=1)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()[-3000:]
    return root, config, single


def _run(config: Path, output: Path, *extra: str, threads: int | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trace_collection.collect", "--config", str(config), "--output", str(output), *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "OMP_NUM_THREADS")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _shards(folder: Path) -> dict[str, list[dict]]:
    return {p.name: pq.read_table(p).to_pylist() for p in sorted((folder / "shards").glob("*.parquet"))}


def _records(folder: Path) -> list[dict]:
    rows = [r for shard in _shards(folder).values() for r in shard]
    return sorted(rows, key=lambda r: (r["concurrency"], r["prompt_id"], r["step"]))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _workers_of(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the collection workers torchrun started under `launcher`."""
    pids = {}
    for task in Path(f"/proc/{launcher.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"trace_collection.collect" in Path(f"/proc/{pid}/cmdline").read_bytes():
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                rank = next(v for v in environ if v.startswith(b"RANK="))
                pids[int(rank[5:])] = int(pid)
    return pids


def test_two_workers_write_the_records_of_one(tiny):
    root, config, single = tiny
    out = root / "two"
    proc = _run(config, out, "--num-workers", "2")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    want, got = _shards(single), _shards(out)
    assert len(want) == 12 and sorted(got) == sorted(want)
    for name in want:  # shard by shard, bit for bit
        assert got[name] == want[name], f"{name} differs from the one-worker shard"
    one, two = _manifest(single), _manifest(out)
    assert {k: two[k] for k in IDENTITY} == {k: one[k] for k in IDENTITY}  # either folder resumes the other
    assert two["counts"] == one["counts"] and two["counts"]["records"] == len(_records(single)) > 0
    run = two["run"]
    assert run["workers"] == 2 and [w["rank"] for w in run["by_worker"]] == [0, 1]
    assert [w["shards"] for w in run["by_worker"]] == [6, 6], "the plan is shared item by item"
    assert all(w["request_steps"] > 0 for w in run["by_worker"])
    assert run["request_steps"] == one["run"]["request_steps"] == two["counts"]["records"]
    summaries = [line for line in stdout.decode().splitlines() if line.startswith("{")]
    assert len(summaries) == 1 and json.loads(summaries[0])["counts"] == one["counts"]  # rank 0 alone reports
    assert not list((out / "shards").glob(".*")) and not list(out.glob(".*"))


def test_a_killed_worker_loses_only_its_chunk_and_the_rerun_resumes(tiny):
    root, config, single = tiny
    out = root / "killed"
    launcher = _run(config, out, "--num-workers", "2")
    deadline = time.time() + 120
    while not list((out / "shards").glob("*.parquet")) and time.time() < deadline:
        time.sleep(0.02)
    workers = _workers_of(launcher)
    assert sorted(workers) == [0, 1]
    os.kill(workers[1], signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert "rank 1: SIGKILL" in stderr.decode() and "rerun the same command to resume" in stderr.decode()
    left, want = _shards(out), _shards(single)
    assert 1 <= len(left) < len(want), f"the kill landed after {len(left)} of {len(want)} shards"
    for name, rows in left.items():  # whatever either worker finished is whole and final
        assert rows == want[name]
    resumed = _run(config, out, "--num-workers", "2")
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr.decode()[-3000:]
    got = _records(out)
    keys = [(r["prompt_id"], r["concurrency"], r["step"]) for r in got]
    assert len(keys) == len(set(keys)), "a (prompt, concurrency, step) record appears twice"
    assert got == _records(single)
    manifest = _manifest(out)
    assert manifest["counts"] == _manifest(single)["counts"]
    assert sum(w["shards"] for w in manifest["run"]["by_worker"]) == len(want) - len(left)  # only the rest redone
    assert not list((out / "shards").glob(".*"))


def test_a_folder_of_another_collection_stops_every_worker(tiny):
    root, config, single = tiny
    before = _shards(single)
    proc = _run(config, single, "--num-workers", "2", "--max-new-tokens", "8")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    text = stderr.decode()
    # NOTE: both workers stop with the refusal (rank 1 gets it from rank 0's broadcast), but whichever exits first,
    # torchrun stops the other (SIGTERM), possibly before it printed: at least one end is the error's own.
    assert "different 'config'" in text and "workers stopped (rank 0: " in text and "exit code 1" in text
    assert _shards(single) == before


def test_the_plan_is_shared_once_and_the_launch_checked(monkeypatch):
    plan = [(c, k) for c in (8, 16) for k in range(7)]
    for world in (1, 2, 3, 5):
        shares = [Workers(rank, world, rank).share(plan) for rank in range(world)]
        assert sorted(item for share in shares for item in share) == sorted(plan)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(WorkerError, match="dscale-collect --num-workers 2"):
        with worker_group(2):
            pass
    with worker_group(1) as alone:
        assert alone == Workers(0, 1, 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(WorkerError, match="LOCAL_RANK"):
        with worker_group(1):
            pass
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(WorkerError, match="under torchrun leave it at 1"):
        with worker_group(2):
            pass
    if not torch.cuda.is_available():
        with pytest.raises(WorkerError, match="no CUDA device"):
            Workers(1, 4, 1).device("cuda")
    assert Workers(1, 4, 1).device("cpu") == "cpu"


def test_num_workers_flag_and_identity(monkeypatch, capsys):
    import trace_collection.collect as module

    seen, launches = [], []
    monkeypatch.setattr(module, "collect", lambda cfg: seen.append(cfg) or {})
    monkeypatch.setattr(module, "launch_local", lambda n, argv: launches.append((n, argv)))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    path = str(REPO / "configs" / "demo.yaml")
    module.main(["--config", path, "--num-workers", "4"])
    assert launches == [(4, ["--config", path, "--num-workers", "4"])] and not seen  # the launcher decodes nothing
    monkeypatch.setenv("WORLD_SIZE", "4")
    module.main(["--config", path, "--num_workers", "4"])
    assert seen[-1].num_workers == 4 and len(launches) == 1  # a launched worker collects
    with pytest.raises(SystemExit):
        module.main(["--config", path, "--num-workers", "0"])
    assert "num_workers must be >= 1" in capsys.readouterr().err
    assert "num_workers" in NOT_IDENTITY and CollectConfig().num_workers == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_workers_write_the_records_of_one(tmp_path):
    """The demo pair in bf16: two workers (one per GPU, or both on cuda:0 on a one-GPU machine) == one worker.
    Worker 1's first shard (c = 8, chunk 0) is the one worker's second: it must not read what the earlier shards
    left in the engine (a prefix cache would prefill that chunk's prompts from cached pages, in other shapes)."""
    section = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["collect"]
    config = tmp_path / "demo_gpu.yaml"
    device = "cuda" if torch.cuda.device_count() >= 2 else "cuda:0"
    config.write_text(yaml.safe_dump({"collect": dict(
        section, device=device, datasets=[{"name": "demo-stdlib"}], max_prompts=8, concurrency=[4, 8],
        chunk_prompts=4, max_new_tokens=16, progress=False)}))
    single, two = tmp_path / "single", tmp_path / "two"
    # NOTE: both runs at once (separate processes and folders; on one GPU they share it): the suite's time.
    procs = [_run(config, out, *extra, threads=1) for out, extra in ((single, ()), (two, ("--num-workers", "2")))]
    for proc in procs:
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr.decode()[-3000:]
    want, got = _shards(single), _shards(two)
    assert len(want) == 4 and sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], f"{name} differs from the one-worker shard"
    assert any(r["accepted"] > 0 for rows in want.values() for r in rows), "the demo pair accepts drafts"
    assert [w["shards"] for w in _manifest(two)["run"]["by_worker"]] == [2, 2]


@pytest.mark.parametrize("body, code, printed", [
    ("print('done', end='')", 0, "done"),
    ("raise ValueError('different config')", 1, "ValueError: different config"),
    ("raise SystemExit('use another --output folder')", 1, "use another --output folder"),
    ("raise SystemExit(3)", 3, ""),
])
def test_a_launched_worker_ends_with_its_jobs_exit_code(body, code, printed):
    """`run_worker` in a process of a launch (WORLD_SIZE > 1) ends it with the job's exit code, its output
    flushed and any error printed, skipping the interpreter's teardown (dscale_runtime/torchrun.py)."""
    script = (f"import atexit, sys\nfrom dscale_runtime.torchrun import run_worker\n"
              f"atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
              f"def job():\n    {body}\nrun_worker(job)\nprint('after the job')\n")
    for world, teardown in (("2", False), ("1", True)):
        env = dict(os.environ, WORLD_SIZE=world)
        run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == code, run.stderr
        assert printed in run.stdout + run.stderr
        assert ("teardown ran" in run.stderr) == teardown  # a lone process exits as usual
        assert ("after the job" in run.stdout) == (world == "1" and code == 0)
