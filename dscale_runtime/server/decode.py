"""Request bodies from bytes to JSON values, refusing what Python's json module would take or choke on.

Each problem is a 400 saying what is wrong: not UTF-8, not JSON, nested deeper than `MAX_JSON_DEPTH`, an
integer literal longer than `MAX_INT_DIGITS` (Python refuses past 4300 digits with a ValueError, and large ones
are slow), a string holding a lone surrogate (it decodes to a str no tokenizer takes; the field is named).
`NaN` / `Infinity` decode as floats: the field checks refuse them by name.
"""

from __future__ import annotations

import json
from typing import Any

from dscale_runtime.server.protocol import ApiError

MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects in a request body (OpenAI bodies need 5)."""
MAX_INT_DIGITS = 20
"""Longest integer literal in a request body: 2^64 has 20 digits."""


class _IntegerTooLong(ValueError):
    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _IntegerTooLong(digits)
    return int(text)


def decode_json(raw: bytes) -> Any:
    """The decoded body; a 400 saying what is wrong with it (UTF-8, syntax, nesting, integers, surrogates)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (bad byte at offset {exc.start})") from None
    try:
        value = json.loads(text, parse_int=_parse_int)
    except _IntegerTooLong as exc:
        raise ApiError(400, f"the request body holds an integer of {exc.digits} digits; integers in a request "
                            f"have at most {MAX_INT_DIGITS} digits (64 bits)") from None
    except RecursionError:
        raise ApiError(400, f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    _check_tree(value)
    return value


def _check_tree(value: Any) -> None:
    """Nesting depth and strings that are not Unicode text (lone surrogates such as "\\ud800"), path named."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ApiError(400, f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels")
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                if isinstance(key, str) and not _is_text(key):
                    where = f"a key of '{_path(path)}'" if path else "a key"
                    raise ApiError(400, f"{where} holds a lone surrogate, which is not Unicode text",
                                   _path(path) or None)
                stack.append((child, path + (key,), depth + 1))
        elif isinstance(item, str) and not _is_text(item):
            field = _path(path) or None
            raise ApiError(400, f"invalid field '{field}': holds a lone surrogate (e.g. \"\\ud800\"), which is not "
                                "Unicode text; send characters, not halves of UTF-16 pairs", field)


def _is_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(path: tuple) -> str:
    return ".".join(str(p) for p in path)
