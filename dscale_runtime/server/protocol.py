"""The OpenAI wire format: request bodies (validated, field errors named), sampling options, answer bodies.

Fields follow the OpenAI API (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`, `stream`,
`stream_options.include_usage`) plus the vLLM extensions `top_k`, `ignore_eos`, `stop_token_ids` and
`chat_template_kwargs`. Options the engine cannot honour (n > 1, logprobs, echo, penalties, ...) are
refused with a 400 naming the field rather than ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dscale_runtime.config import RequestOutput, SamplingParams


class ApiError(Exception):
    """An error answer: HTTP status, a message saying what to fix, the offending field."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

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

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stop):
            raise ApiError(400, "stop strings must not be empty", "stop")
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, seed=self.seed)

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
    name: str | None = None

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
    chat_template_kwargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs is not supported (leave it out)", "logprobs")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def parse_body(model: type[BaseModel], body: Any):
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = [str(p) for p in error["loc"]
                if isinstance(p, int) or (p.isidentifier() and p.lower() not in _TYPE_TAGS)]
        field = ".".join(path) or None
        if error["type"] == "missing":
            message = f"missing field '{field}'"
        elif error["type"] == "extra_forbidden":
            message = f"unknown field '{field}' (not part of this endpoint's request body)"
        else:
            message = f"invalid field '{field}': {error['msg']}"
        raise ApiError(400, message, field) from None


def usage(output: RequestOutput) -> dict:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(request_id: str, model: str, text: str, output: RequestOutput) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": output.finish_reason}],
            "usage": usage(output)}


def chat_body(request_id: str, model: str, text: str, output: RequestOutput) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": output.finish_reason}],
            "usage": usage(output)}


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, model: str, chat: bool, output: RequestOutput) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage(output)}
