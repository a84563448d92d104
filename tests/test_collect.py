"""dscale-collect: configs, prompt sources offline, crash-and-resume, labels, and the trace dataset."""

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
import yaml

from checkpoints import write_drafter, write_target
from dscale_runtime.config import EngineConfig, SamplingParams
from dscale_runtime.demo.prompts import DEMO_DIR
from dscale_runtime.dvl.features import FeatureSpec
from dscale_runtime.engine import Engine
from trace_collection.collect import CollectConfig, collect
from trace_collection.sources import CHOICES, DatasetSpec, SourceError, load_prompts
from trace_collection.store import TraceFolderError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["demo", "qwen3-8b", "qwen3-4b"])
def test_checked_in_configs_are_valid(name):
    section = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())["collect"]
    cfg = CollectConfig(**section)
    assert all(d.name in CHOICES for d in cfg.datasets) and cfg.concurrency == [8, 16, 32]
    if name != "demo":
        assert {d.name for d in cfg.datasets} == {"gsm8k", "math500", "humaneval", "mbpp"}


def _collect_cli(monkeypatch, argv: list[str]) -> CollectConfig:
    """dscale-collect's main() with `argv`; returns the config it would collect with."""
    import trace_collection.collect as module

    seen = []
    monkeypatch.setattr(module, "collect", lambda cfg: seen.append(cfg) or {})
    module.main(argv)
    return seen[0]


@pytest.mark.parametrize("name", ["demo", "qwen3-8b", "qwen3-4b"])
def test_cli_reads_each_config_and_takes_dashed_flags(monkeypatch, name):
    path = str(REPO / "configs" / f"{name}.yaml")
    section = CollectConfig(**yaml.safe_load(Path(path).read_text())["collect"])
    assert _collect_cli(monkeypatch, ["--config", path]) == section
    dashed = _collect_cli(monkeypatch, ["--config", path, "--max-prompts", "3", "--max-new-tokens", "7",
                                        "--chunk-prompts", "5", "--concurrency", "[2, 4]", "--log-records", "false"])
    underscored = _collect_cli(monkeypatch, ["--config", path, "--max_prompts", "3", "--max_new_tokens", "7",
                                             "--chunk_prompts", "5", "--concurrency", "[2, 4]", "--log_records", "false"])
    assert dashed == underscored
    assert (dashed.max_prompts, dashed.max_new_tokens, dashed.chunk_prompts, dashed.concurrency, dashed.log_records) \
        == (3, 7, 5, [2, 4], False)
    assert (dashed.max_model_len, dashed.datasets) == (section.max_model_len, section.datasets)  # the YAML's


def test_cli_errors_and_help(monkeypatch, capsys):
    path = str(REPO / "configs" / "demo.yaml")
    for argv in (["--max-promptz", "3"], ["--chunk-prompts", "0"], ["--max-new-tokens", "many"]):
        with pytest.raises(SystemExit):
            _collect_cli(monkeypatch, ["--config", path, *argv])
    assert "chunk_prompts must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _collect_cli(monkeypatch, ["--config", str(REPO / "configs" / "missing.yaml")])
    assert "no such config file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _collect_cli(monkeypatch, ["--help"])
    text = capsys.readouterr().out
    assert "--max-new-tokens" in text and "--chunk-prompts" in text and "--max_new_tokens" not in text


# ----------------------------------------------------------------------------------------------- sources
def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


HUB_LAYOUTS = {  # the real datasets' columns, a few rows each
    "gsm8k": [{"question": f"Q{i}: 3 + {i}?", "answer": f"#### {3 + i}"} for i in range(3)],
    "math500": [{"problem": f"Solve x + {i} = 0", "solution": "...", "answer": f"{-i}", "subject": "Algebra",
                 "level": 1, "unique_id": f"test/algebra/{i}.json"} for i in range(3)],
    "humaneval": [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": "  pass",
                   "test": "", "entry_point": f"f{i}"} for i in range(3)],
    "mbpp": [{"task_id": 11 + i, "text": f"Write a function number {i}.", "code": "", "test_list": []}
             for i in range(3)],
}


@pytest.mark.parametrize("name", sorted(HUB_LAYOUTS))
def test_hub_datasets_from_local_copies(tmp_path, name):
    folder = tmp_path / name
    _write_jsonl(folder / "test.jsonl", HUB_LAYOUTS[name])
    prompts = load_prompts(DatasetSpec(name, path=str(folder)))
    text_field = {"gsm8k": "question", "math500": "problem", "humaneval": "prompt", "mbpp": "text"}[name]
    assert [p["prompt"] for p in prompts] == [r[text_field] for r in HUB_LAYOUTS[name]]
    assert len({p["id"] for p in prompts}) == 3 and all(p["id"].startswith(name + "/") for p in prompts)


def test_local_files_package_and_demo_sources(tmp_path):
    rows = [{"id": "a", "prompt": "x = 1"}, {"id": "b", "prompt": "y = 2"}]
    jl = load_prompts(DatasetSpec("jsonl", path=str(_write_jsonl(tmp_path / "p.jsonl", rows)), label="mine"))
    assert [p["id"] for p in jl] == ["mine/a", "mine/b"]
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist([{"key": 7, "text": "z = 3"}]), tmp_path / "p.parquet")
    pa_rows = load_prompts(DatasetSpec("parquet", path=str(tmp_path / "p.parquet"), field="text", id_field="key"))
    assert pa_rows == [{"id": "parquet/7", "dataset": "parquet", "prompt": "z = 3"}]
    he = load_prompts(DatasetSpec("humaneval-pkg"))
    assert len(he) == 164 and he[0]["id"] == "humaneval-pkg/HumanEval/0"
    assert len(load_prompts(DatasetSpec("demo-stdlib"))) >= 128


def test_source_errors_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(SourceError, match="choose one of gsm8k, math500"):
        load_prompts(DatasetSpec("gsm9k"))
    import datasets
    import huggingface_hub

    # The hub is unreachable here anyway; offline mode makes the failure immediate instead of a timeout.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(SourceError, match="pass a local copy"):
        load_prompts(DatasetSpec("gsm8k"))
    with pytest.raises(SourceError, match="no column 'prompt'"):
        load_prompts(DatasetSpec("jsonl", path=str(_write_jsonl(tmp_path / "q.jsonl", [{"id": 1, "q": "?"}]))))


# ----------------------------------------------------------------------------------------------- collection
@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("collect")
    write_target(root / "target", tokenizer=True)
    write_drafter(root / "drafter")
    rows = [{"id": f"p{i}", "prompt": "".join(chr(33 + (i * 7 + j) % 90) for j in range(5 + i % 9))}
            for i in range(24)]
    prompts = _write_jsonl(root / "prompts.jsonl", rows)
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump({"collect": {
        "target": str(root / "target"), "drafter": str(root / "drafter"), "output": str(root / "unused"),
        "datasets": [{"name": "jsonl", "path": str(prompts), "label": "tiny"}], "concurrency": [2, 5],
        "max_new_tokens": 40, "chunk_prompts": 3, "max_model_len": 160, "progress": False}}))
    return root, config


def _run(config: Path, output: Path, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trace_collection.collect", "--config", str(config), "--output", str(output)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def _records(folder: Path) -> list[dict]:
    rows = []
    for shard in sorted((folder / "shards").glob("*.parquet")):
        rows += pq.read_table(shard).to_pylist()
    return sorted(rows, key=lambda r: (r["concurrency"], r["prompt_id"], r["step"]))


def test_sigkill_then_resume_equals_uninterrupted_run(tiny_setup):
    root, config = tiny_setup
    # NOTE: half the prompts and half the tokens of tiny_setup (8 shards, not 16): three collector processes run
    # here, and this was the suite's slowest test
    section = yaml.safe_load(config.read_text())["collect"]
    source = section["datasets"][0]
    rows = [json.loads(line) for line in Path(source["path"]).read_text().splitlines()][:12]
    config = root / "sigkill.yaml"
    config.write_text(yaml.safe_dump({"collect": dict(section, max_new_tokens=20, datasets=[
        dict(source, path=str(_write_jsonl(root / "prompts12.jsonl", rows)))])}))
    whole, crashed = root / "whole", root / "crashed"
    assert _run(config, whole).wait(timeout=300) == 0
    proc = _run(config, crashed)
    deadline = time.time() + 120
    while not list((crashed / "shards").glob("*.parquet")) and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(list((crashed / "shards").glob("*.parquet")))
    total = len(list((whole / "shards").glob("*.parquet")))
    assert 1 <= written < total, f"kill landed after {written} of {total} shards"
    assert _run(config, crashed).wait(timeout=300) == 0
    got, want = _records(crashed), _records(whole)
    keys = [(r["prompt_id"], r["concurrency"], r["step"]) for r in got]
    assert len(keys) == len(set(keys)), "a (prompt, concurrency, step) record appears twice"
    assert got == want
    manifest = json.loads((crashed / "manifest.json").read_text())
    assert manifest["counts"]["records"] == len(want) and manifest["counts"]["shards"] == total
    assert manifest["run"]["request_steps"] > 0  # the resumed invocation's own figures
    assert not list((crashed / "shards").glob(".*"))


def test_folder_of_another_collection_is_refused(tiny_setup, tmp_path):
    root, config = tiny_setup
    out = tmp_path / "t"
    section = yaml.safe_load(config.read_text())["collect"]
    base = dict(section, output=str(out), concurrency=[2], max_new_tokens=8)
    collect(CollectConfig(**base))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["feature_spec"]["version"] = "dscale-features-v0"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFolderError, match="different 'feature_spec'"):
        collect(CollectConfig(**base))
    other = tmp_path / "drafter2"
    write_drafter(other, seed=9)
    collect(CollectConfig(**dict(base, output=str(tmp_path / "t2"))))
    with pytest.raises(TraceFolderError, match="different 'models'"):
        collect(CollectConfig(**dict(base, output=str(tmp_path / "t2"), drafter=str(other))))


def test_demo_traces_load_and_labels_equal_engine(tmp_path):
    from datasets import load_dataset

    out = tmp_path / "demo"
    cfg = CollectConfig(output=str(out), datasets=[DatasetSpec("demo-stdlib")], max_prompts=5, concurrency=[3],
                        max_new_tokens=24, chunk_prompts=5, progress=False, max_model_len=1024)
    manifest = collect(cfg)
    data = load_dataset("parquet", data_files=str(out / "shards" / "*.parquet"), split="train")
    spec = FeatureSpec()
    assert manifest["feature_width"] == spec.width and manifest["feature_names"] == spec.names()
    assert all(len(f) == spec.width for f in data["features"])
    assert manifest["counts"]["records"] == len(data) > 0
    # The same prompts at the same concurrency through the engine directly: identical accepted counts.
    from trace_collection.sources import load_prompts as lp

    prompts = lp(DatasetSpec("demo-stdlib"))[:5]
    engine = Engine.from_pretrained(DEMO_DIR / "target", DEMO_DIR / "drafter",
                                    config=EngineConfig(mode="dflash", max_running_requests=3, max_model_len=1024))
    outs = engine.generate([p["prompt"] for p in prompts], SamplingParams(temperature=0, max_tokens=24))
    rows = data.to_list()
    for p, o in zip(prompts, outs):
        labels = [r["accepted"] for r in sorted(rows, key=lambda r: r["step"]) if r["prompt_id"] == p["id"]]
        assert labels == o.stats.accepted_lens
    assert any(a > 0 for a in data["accepted"]), "the demo pair accepts drafts"


def test_chat_template_with_thinking_disabled(tiny_setup):
    from transformers import AutoTokenizer

    from trace_collection.sources import format_prompt

    root, _ = tiny_setup
    tok = AutoTokenizer.from_pretrained(root / "target")
    assert format_prompt(tok, "x = 1", "auto") == "x = 1"  # no template: the raw prompt
    with pytest.raises(SourceError, match="no chat template"):
        format_prompt(tok, "x = 1", "on")
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}"
                         "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}")
    assert format_prompt(tok, "x = 1", "auto") == "<user>x = 1<assistant><no-think>"
    assert format_prompt(tok, "x = 1", "off") == "x = 1"


def test_several_temperatures_into_one_trace_set(tiny_setup, tmp_path):
    """--temperatures: each record carries its temperature and rule, in its v2 feature columns too, and the greedy
    part equals a greedy-only collection (the ids apart)."""
    root, config = tiny_setup
    section = yaml.safe_load(config.read_text())["collect"]
    base = dict(section, concurrency=[2], max_new_tokens=12, max_prompts=4)
    both = collect(CollectConfig(**dict(base, output=str(tmp_path / "both"), temperatures=[0.0, 0.8])))
    greedy = collect(CollectConfig(**dict(base, output=str(tmp_path / "greedy"))))
    assert set(both["counts"]["by_temperature"]) == {"0.0", "0.8"}
    spec = FeatureSpec()
    rows = _records(tmp_path / "both")
    assert {(round(r["temperature"], 4), r["sampling_rule"]) for r in rows} == {(0.0, "greedy"), (0.8, "sampled")}
    for r in rows:
        sampling = r["features"][spec.temperature_column : spec.temperature_column + spec.num_sampling]
        assert sampling == pytest.approx([r["temperature"], float(r["temperature"] > 0)])
    strip = lambda r: (r["prompt_id"], r["step"], r["accepted"], r["features"])  # noqa: E731
    assert [strip(r) for r in rows if r["temperature"] == 0] == [strip(r) for r in _records(tmp_path / "greedy")]
    assert greedy["counts"]["records"] == sum(r["temperature"] == 0 for r in rows)
    assert all("-t800-" in r["request_id"] for r in rows if r["temperature"] > 0)
