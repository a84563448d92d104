"""The demo corpus: the running interpreter's standard-library source, split by module into train / held-out.

The file list is fixed and sorted; a module is held out when a stable hash of its relative path falls in
the held-out bucket, so the split is the same on every machine that has the same Python version.
Held-out modules give the evaluation prompts: a function's signature and docstring, the body to write.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "pydoc_data", "lib2to3", "turtledemo",
             "ensurepip", "venv"}
HELD_OUT_BUCKETS = 10  # one module in ten (by hash) is held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every stdlib *.py file outside test and data folders, sorted by relative path."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts[:-1]) & SKIP_DIRS)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_held_out(relpath: str) -> bool:
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % HELD_OUT_BUCKETS == 0


def split_files(root: Path | None = None, limit: int | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files); `limit` keeps only the first files of the sorted list (tiny runs)."""
    root = root or stdlib_root()
    files = stdlib_files(root)[:limit]
    held = [p for p in files if is_held_out(p.relative_to(root).as_posix())]
    train = [p for p in files if not is_held_out(p.relative_to(root).as_posix())]
    return train, held


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def documented_functions(source: str):
    """(first line, docstring end line, name) of every function with a docstring and a body, in walk order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(node):
            continue
        doc = node.body[0]
        if len(node.body) < 2 or doc.end_lineno is None:
            continue  # a docstring-only function has no body to write
        yield min([node.lineno] + [d.lineno for d in node.decorator_list]), doc.end_lineno, node.name


def _documented_in(files: list[Path]):
    """(path, source lines, first line, docstring end line, name) of every documented function of the files."""
    for path in files:
        source = read_text(path)
        if source is None:
            continue
        lines = source.splitlines(keepends=True)
        for start, end, name in documented_functions(source):
            yield path, lines, start, end, name


def function_prompts(files: list[Path], root: Path | None = None, max_prompts: int = 256,
                     max_chars: int = 1200) -> list[dict]:
    """Prompts `def name(args):` + docstring (dedented) from functions with docstrings, in file order.

    NOTE: the prompt stops right after the closing quotes, without the newline: byte-level BPE merges a
    newline with the indentation that follows, so a bare trailing newline would tell the model "no indent"."""
    root = root or stdlib_root()
    prompts = []
    for path, lines, start, end, name in _documented_in(files):
        text = textwrap.dedent("".join(lines[start - 1 : end])).rstrip("\n")
        if len(text) > max_chars:
            continue
        rel = path.relative_to(root).as_posix()
        prompts.append({"id": f"stdlib/{rel}:{start}:{name}", "dataset": "stdlib-heldout", "prompt": text})
        if len(prompts) >= max_prompts:
            break
    return prompts


def docstring_contexts(files: list[Path], max_chars: int = 4000) -> list[str]:
    """File text up to the closing quotes of each documented function's docstring (training prompts shaped
    like the evaluation prompts, with the file's preceding text as extra context)."""
    return ["".join(lines[:end]).rstrip("\n")[-max_chars:] for _, lines, _, end, _ in _documented_in(files)]


def corpus_text(files: list[Path], eos: str) -> str:
    """All files joined, each followed by the end-of-text token."""
    parts = []
    for path in files:
        text = read_text(path)
        if text:
            parts.append(text + eos)
    return "".join(parts)
