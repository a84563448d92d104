"""Command-line flags generated from a frozen config dataclass: one `--dashed-name` per field, its docstring
as the help text (the issue's flag spelling: `--max-running-requests`, `--api-key`, ...)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal that follows its annotation)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _converter(annotation):
    """The argparse `type` of a field: int, float, str, bool (flag or explicit value), or their `X | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args else annotation
    if base is bool:
        return _parse_bool
    if base in (int, float, str):
        return base
    raise TypeError(f"unsupported flag type {annotation!r}")


def dataclass_parser(cls, prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of `cls`; `parse_config` turns its result into a `cls`."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        convert = _converter(hints[f.name])
        help_text = docs.get(f.name, "") + ("" if f.default is None else f" (default: {f.default})")
        kwargs = dict(dest=f.name, default=f.default, help=help_text, type=convert)
        if convert is _parse_bool:
            kwargs.update(nargs="?", const=True, metavar="BOOL")
        parser.add_argument(flag, **kwargs)
    return parser


def parse_config(cls, prog: str, argv: list[str] | None = None, description: str | None = None):
    """Parse `argv` into a `cls` instance; a `ValueError` from its checks exits with the message."""
    parser = dataclass_parser(cls, prog, description)
    namespace = parser.parse_args(argv)
    try:
        return cls(**vars(namespace))
    except ValueError as exc:
        parser.error(str(exc))
