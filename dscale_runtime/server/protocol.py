"""The OpenAI wire format: request bodies (strictly typed and bounded, the bad field named),
sampling options, answer bodies and SGLang's `meta_info`.

Fields follow the OpenAI API (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`, `stream`,
`stream_options.include_usage`; `user`, `store`, `metadata` accepted and without effect), the vLLM extensions
`top_k`, `ignore_eos`, `stop_token_ids`, `chat_template_kwargs`, `chat_template`, and SGLang's
`return_meta_info`. Options the engine cannot honour (n > 1, logprobs, echo, penalties, tools,
response_format, ...) are refused with a 400 naming the field rather than ignored.

Every check here runs before a request reaches the engine thread, so a bad value fails its own request only:
types are strict (no "4" for 4, no 1 for true), numbers finite and bounded (seeds in [0, 2^64), top_k and
token ids within the vocabulary), stop strings capped in count and length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dscale_runtime.config import RequestOutput, SamplingParams

MAX_STOP_STRINGS = 16
"""Most stop strings per request (each is searched in the text after every generated token)."""
MAX_STOP_CHARS = 256
"""Longest stop string, in characters."""
MAX_STOP_TOKEN_IDS = 256
"""Most stop token ids per request."""
TOKENIZER_OPTIONS = frozenset({
    "chat_template", "tokenize", "tokenizer_kwargs", "add_special_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "continue_final_message",
    "sanitize_control_tokens", "split_special_tokens"})
"""`apply_chat_template` options that are not template variables (refused in chat_template_kwargs)."""
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
"""Variables the server itself passes to the chat template."""


class ApiError(Exception):
    """An error answer: HTTP status, a message saying what to fix, the offending field, extra headers."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ApiError.TYPES.get(status, "error"), "param": param,
                      "code": status}}


# ---------------------------------------------------------------------------------------------- bodies
@dataclass(frozen=True)
class Limits:
    """Bounds that depend on the served model."""

    vocab_size: int
    max_model_len: int


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = Field(None, max_length=256)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    return_meta_info: bool = False
    """SGLang: add `meta_info` (token counts, latency, speculative-decoding figures) to the answer."""
    user: str | None = Field(None, max_length=256)
    """OpenAI: an end-user id; no effect here."""
    store: bool | None = None
    """OpenAI: store the completion; no effect here (nothing is stored)."""
    metadata: dict[str, str] | None = Field(None, max_length=16)
    """OpenAI: up to 16 key-value tags (keys <= 64, values <= 512 characters); no effect here."""

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise ApiError(400, f"n={self.n} is not supported: this server returns one choice per request (n=1); "
                                "send several requests instead", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported (leave it at 0)", name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported (leave it out)", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", "stream_options")
        if self.return_meta_info and self.stream:
            raise ApiError(400, "return_meta_info is only supported with stream=false (as in SGLang)",
                           "return_meta_info")

    def check_limits(self, limits: Limits) -> None:
        """The bounds that depend on the model, and the caps on stop conditions and metadata."""
        vocab = limits.vocab_size
        if self.top_k > vocab:
            raise ApiError(400, f"invalid field 'top_k': must be -1 (off) or at most the vocabulary size {vocab}, "
                                f"got {self.top_k}", "top_k")
        stop = self.stop_strings
        if len(stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"invalid field 'stop': at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}",
                           "stop")
        for s in stop:
            if not s:
                raise ApiError(400, "invalid field 'stop': stop strings must not be empty", "stop")
            if len(s) > MAX_STOP_CHARS:
                raise ApiError(400, f"invalid field 'stop': a stop string has at most {MAX_STOP_CHARS} characters, "
                                    f"got {len(s)}", "stop")
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ApiError(400, f"invalid field 'stop_token_ids': at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                           "stop_token_ids")
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(400, f"invalid field 'stop_token_ids': token ids must lie in [0, {vocab})",
                           "stop_token_ids")
        for key, value in (self.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ApiError(400, "invalid field 'metadata': keys have at most 64 characters and values at most "
                                    "512", "metadata")
        limit = self.output_limit
        if limit is not None and limit >= limits.max_model_len:
            name = self.output_limit_field
            raise ApiError(400, f"invalid field '{name}': this server's context limit is {limits.max_model_len} "
                                f"tokens (prompt + output), so {name} must be below it, got {limit}", name)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def output_limit_field(self) -> str:
        return "max_tokens"

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=max_tokens, stop=self.stop_strings,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                              seed=self.seed)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: Any
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError(400, "echo=true is not supported", "echo")
        if self.logprobs is not None:
            raise ApiError(400, "logprobs is not supported (leave it out)", "logprobs")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of={self.best_of} is not supported (only 1)", "best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")

    def prompt_input(self, vocab_size: int) -> str | list[int]:
        """The one prompt: a string or a list of token ids (a list holding one of these is accepted)."""
        prompt = self.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if any(not 0 <= t < vocab_size for t in prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {vocab_size})", "prompt")
            return prompt
        if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, f"prompt holds {len(prompt)} prompts; this server takes one prompt per request",
                           "prompt")
        raise ApiError(400, "prompt must be a string or a list of token ids", "prompt")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None
    """vLLM: a Jinja template to use instead of the model's (only with --trust-request-chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra template variables (e.g. enable_thinking)."""
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs is not supported (leave it out)", "logprobs")
        for name in ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call"):
            if getattr(self, name) is not None:
                raise ApiError(400, f"{name} is not supported: this server does no tool calling (leave it out)",
                               name)
        if self.response_format is not None:
            raise ApiError(400, "response_format is not supported: output is never constrained here (leave it "
                                "out)", "response_format")

    def template_variables(self, trust_request_templates: bool) -> tuple[str | None, dict]:
        """(the request's own template or None, the template variables); refuses what is not a variable."""
        kwargs = dict(self.chat_template_kwargs or {})
        template = self.chat_template
        where = "chat_template"
        if "chat_template" in kwargs:
            if template is not None:
                raise ApiError(400, "give the chat template once: either 'chat_template' or "
                                    "'chat_template_kwargs.chat_template'", "chat_template_kwargs.chat_template")
            template, where = kwargs.pop("chat_template"), "chat_template_kwargs.chat_template"
        if template is not None:
            if not trust_request_templates:
                raise ApiError(400, f"invalid field '{where}': this server renders only the model's own chat "
                                    "template (start dscale-serve with --trust-request-chat-template to accept "
                                    "templates from requests)", where)
            if not isinstance(template, str):
                raise ApiError(400, f"invalid field '{where}': must be a string", where)
        for key in kwargs:
            field = f"chat_template_kwargs.{key}"
            if key in TOKENIZER_OPTIONS:
                raise ApiError(400, f"invalid field '{field}': a tokenizer option, not a template variable; this "
                                    "server tokenizes the rendered prompt itself (leave it out)", field)
            if key in RESERVED_TEMPLATE_VARIABLES:
                raise ApiError(400, f"invalid field '{field}': the server sets '{key}' itself", field)
            if not key.isidentifier() or key.startswith("_"):
                raise ApiError(400, f"invalid field '{field}': template variable names are identifiers not "
                                    "starting with '_'", field)
        return template, kwargs

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def output_limit_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def parse_body(model: type[BaseModel], body: Any):
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        # NOTE: a union (e.g. `str | list[str]`) reports one error per member: the deepest names the field best.
        paths = [[str(p) for p in e["loc"] if isinstance(p, int) or (p.isidentifier() and p.lower() not in _TYPE_TAGS)]
                 for e in exc.errors()]
        depth = max(len(p) for p in paths)
        index = next(i for i, p in enumerate(paths) if len(p) == depth)
        error, field = exc.errors()[index], ".".join(paths[index]) or None
        if error["type"] == "missing":
            message = f"missing field '{field}'"
        elif error["type"] == "extra_forbidden":
            message = f"unknown field '{field}' (not part of this endpoint's request body)"
        else:
            message = f"invalid field '{field}': {error['msg']}"
        raise ApiError(400, message, field) from None


def check_context(num_prompt_tokens: int, max_tokens: int | None, limit: int, limit_field: str = "max_tokens") -> int:
    """The request's max_tokens (None: what the context leaves); a 400 when prompt and output do not fit."""
    if num_prompt_tokens == 0:
        raise ApiError(400, "the prompt is empty: send at least one token", "prompt")
    if num_prompt_tokens >= limit:
        raise ApiError(400, f"the prompt has {num_prompt_tokens} tokens; this server's context limit is {limit} "
                            f"tokens (prompt + output, dscale-serve --max-model-len), so the prompt must be shorter "
                            f"than {limit}", "prompt")
    if max_tokens is None:
        return limit - num_prompt_tokens
    if num_prompt_tokens + max_tokens > limit:
        raise ApiError(400, f"the prompt has {num_prompt_tokens} tokens and {limit_field} is {max_tokens}: together "
                            f"they exceed this server's context limit of {limit} tokens; lower {limit_field} to at "
                            f"most {limit - num_prompt_tokens}", limit_field)
    return max_tokens


# ---------------------------------------------------------------------------------------------- answers
def usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def meta_info(request_id: str, output: RequestOutput, e2e_latency: float) -> dict:
    """SGLang's `meta_info`: spec_verify_ct = the request's verify steps (decode steps), spec_accept_length =
    completion tokens / verify steps (the successor token counted, as in SGLang); null without a verify step."""
    stats = output.stats
    completion = len(output.token_ids)
    steps = stats.num_steps
    return {"id": request_id, "prompt_tokens": len(output.prompt_token_ids), "completion_tokens": completion,
            "cached_tokens": 0, "e2e_latency": e2e_latency, "spec_verify_ct": steps,
            "spec_accept_length": completion / steps if steps else None,
            "spec_num_correct_drafts": sum(stats.accepted_lens), "spec_verify_tokens": sum(stats.verify_lens)}


def completion_body(request_id: str, model: str, text: str, output: RequestOutput, meta: dict | None = None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
    return _with_meta({"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                       "choices": [choice], "usage": usage(output)}, meta)


def chat_body(request_id: str, model: str, text: str, output: RequestOutput, meta: dict | None = None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": output.finish_reason}
    return _with_meta({"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                       "choices": [choice], "usage": usage(output)}, meta)


def _with_meta(body: dict, meta: dict | None) -> dict:
    # NOTE: SGLang's OpenAI routes put meta_info on each choice, its native /generate at the top level (where
    # z-lab's benchmark client reads it): both are filled.
    if meta is not None:
        body["choices"][0]["meta_info"] = meta
        body["meta_info"] = meta
    return body


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, model: str, chat: bool, output: RequestOutput) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage(output)}
