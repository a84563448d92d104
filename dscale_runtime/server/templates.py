"""Chat templates and tokenisation off the event loop, bounded in time and size.

`PromptBuilder` renders chat messages with the model's template (or, with --trust-request-chat-template, one a
request sent) and tokenizes prompts in a small thread pool, so neither the asyncio loop (health checks,
other requests) nor the engine thread waits on them.

A thread cannot be stopped from outside, so the rendering checks its own budget: the Jinja sandbox is the one
transformers builds (same filters and globals, so output equals `apply_chat_template`) with hooks that check
the deadline and the size limit at every output piece, attribute or item access, call and filter, and refuse
`+`, `*`, `**` whose result would be too large before computing it. What stays unbounded is one single
built-in operation on values within the limit.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dscale_runtime.server.protocol import ApiError

_budget = threading.local()
"""The budget of the rendering running on this thread: `deadline` (perf_counter) and `max_chars`."""


class TemplateBudgetError(Exception):
    """A rendering ran past its time or size limit."""


def _check(value: Any = None) -> Any:
    if time.perf_counter() > _budget.deadline:
        raise TemplateBudgetError("time")
    if isinstance(value, (str, list, tuple, dict)) and len(value) > _budget.max_chars:
        raise TemplateBudgetError("size")
    return value


def _check_args(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _budget.max_chars:
            raise TemplateBudgetError("size")


def _guarded_filter(fn):
    @functools.wraps(fn)  # NOTE: keeps jinja's pass_context / pass_environment markers
    def guarded(*args, **kwargs):
        _check()
        _check_args(args, kwargs)
        return _check(fn(*args, **kwargs))

    return guarded


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """`template` compiled in a budget-checking copy of transformers' chat-template sandbox."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    # NOTE: transformers' environment (its filters, globals, extensions) from an empty template: compiling the
    # request's template there would constant-fold e.g. `7 ** 99999999` unchecked.
    base = _compile_jinja_template("").environment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**"})

        def call_binop(self, context, operator, left, right):
            _check()
            if operator == "*" and isinstance(right, int) and hasattr(left, "__len__"):
                left, right = right, left
            if operator == "*" and isinstance(left, int) and hasattr(right, "__len__"):
                if abs(left) * len(right) > _budget.max_chars:
                    raise TemplateBudgetError("size")
            elif operator == "+" and hasattr(left, "__len__") and hasattr(right, "__len__"):
                if len(left) + len(right) > _budget.max_chars:
                    raise TemplateBudgetError("size")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if abs(right) * max(abs(left), 2).bit_length() > 4096:
                    raise TemplateBudgetError("size")
            return super().call_binop(context, operator, left, right)

        def getattr(self, obj, attribute):
            return _check(super().getattr(obj, attribute))

        def getitem(self, obj, argument):
            return _check(super().getitem(obj, argument))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            _check()
            _check_args(args, kwargs)
            return _check(super().call(__context, __obj, *args, **kwargs))

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[type(e) for e in base.extensions.values()])
    env.globals.update(base.globals)
    env.filters.update({name: _guarded_filter(fn) for name, fn in base.filters.items()})
    return env.from_string(template)


def render_bounded(template: str, variables: dict, timeout: float, max_chars: int) -> str:
    """Render `template` with `variables`; TemplateBudgetError past `timeout` seconds or `max_chars` characters."""
    _budget.deadline, _budget.max_chars = time.perf_counter() + timeout, max_chars
    compiled = _compile(template)
    pieces, size = [], 0
    for piece in compiled.generate(**variables):
        size += len(piece)
        pieces.append(piece)
        _check()
        if size > max_chars:
            raise TemplateBudgetError("size")
    return "".join(pieces)


class PromptBuilder:
    """Chat rendering and tokenisation for the HTTP handlers, in a thread pool of `workers` threads."""

    def __init__(self, tokenizer, *, timeout: float, max_chars: int, workers: int = 4) -> None:
        self.tokenizer = tokenizer
        self.timeout = timeout
        self.max_chars = max_chars
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dscale-prompt")

    @property
    def model_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def chat_token_ids(self, messages: list[dict], template: str, variables: dict) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._chat, messages, template, variables)

    async def token_ids(self, text: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._encode, text)

    def _chat(self, messages: list[dict], template: str, variables: dict) -> list[int]:
        # The variables transformers' apply_chat_template passes: the special tokens, then the request's own.
        context = {**self.tokenizer.special_tokens_map, **variables, "messages": messages, "tools": None,
                   "documents": None, "add_generation_prompt": True}
        try:
            text = render_bounded(template, context, self.timeout, self.max_chars)
        except TemplateBudgetError as exc:
            if exc.args[0] == "time":
                raise ApiError(400, f"the chat template took longer than {self.timeout:g} s to render these messages "
                                    "(dscale-serve --template-timeout)", "messages") from None
            raise ApiError(400, f"the chat template's output for these messages exceeds {self.max_chars} characters "
                                "(dscale-serve --max-prompt-chars)", "messages") from None
        except ApiError:
            raise
        except Exception as exc:  # template errors are the request's (roles, variables, its own template)
            raise ApiError(400, f"the chat template could not render these messages: "
                                f"{type(exc).__name__}: {exc}", "messages") from None
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        if len(text) > self.max_chars:
            raise ApiError(400, f"the prompt has {len(text)} characters; this server takes at most {self.max_chars} "
                                "(dscale-serve --max-prompt-chars)", "prompt")
        return list(self.tokenizer.encode(text, add_special_tokens=False))
