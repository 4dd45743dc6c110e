"""The OpenAI request bodies the server accepts, and the response and chunk bodies it writes.

Strict, as OpenAI's API is: a string or a boolean where a number belongs is a 400, and null means
"the default" where OpenAI allows it. OpenAI parameters this server does not implement (n > 1,
logprobs, tools, penalties, ...) are refused by name with a 400 unless set to the value that leaves
them off (n: 1, response_format text, tool_choice "none", store false ...); unknown fields are refused
too. Text must be valid Unicode (a lone surrogate is a 400). Values echoed in errors are cut short.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

MAX_STOP_STRINGS = 4
MAX_SEED = 2**63 - 2  # torch seeds are 64-bit; drafters use seed + 1
ECHO_CHARS = 64  # the most of a client's value an error message repeats


def clip(value: object) -> str:
    """A client's value as an error message may show it: its repr, cut short."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} characters)"


def check_unicode(text: str, param: str) -> str:
    """`text` if it encodes as UTF-8 (JSON can carry lone surrogates such as \\ud800, which cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{param} is not valid Unicode (a lone surrogate at position {e.start})") from None
    return text


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return check_unicode(text, "messages.content")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


# OpenAI parameters that exist but that this server does not implement: accepted only at the values that
# leave them off (what a client sends when it leaves them alone); null is always such a value.
UNSUPPORTED = {
    "n": (1,),
    "best_of": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "reasoning_effort": (),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # extra fields are checked by `_refuse_unsupported`
    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | StrictInt | None = Field(None, ge=0.0, le=2.0)  # None: OpenAI's default, 1
    top_p: StrictFloat | StrictInt | None = Field(None, gt=0.0, le=1.0)  # None: 1
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED)
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool | None = None  # None: False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    return_token_ids: StrictBool | None = None  # vLLM's extension: the choice also carries the generated token ids

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name not in UNSUPPORTED:
                raise ValueError(f"unknown parameter '{clip(name)}'")
            off = UNSUPPORTED[name]
            if value is not None and not any(type(value) is type(v) and value == v for v in off):
                raise ValueError(f"parameter '{name}' is not supported by this server (got {clip(value)})")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        for text in [self.stop] if isinstance(self.stop, str) else self.stop or []:
            check_unicode(text, "stop")
        return self

    @property
    def sampling_temperature(self) -> float:
        return 1.0 if self.temperature is None else float(self.temperature)

    @property
    def sampling_top_p(self) -> float:
        return 1.0 if self.top_p is None else float(self.top_p)

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
        return [s for s in stop if s]


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictStr] | list[StrictInt]

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("only one prompt per request (a list of several prompts is not supported)")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("empty prompt")
        if isinstance(self.prompt, str):
            check_unicode(self.prompt, "prompt")
        return self


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice(
    chat: bool,
    text: str | None,
    finish: str | None,
    first: bool = False,
    stream: bool = False,
    token_ids: list[int] | None = None,
) -> dict:
    """One entry of `choices`: a message (chat), a delta (chat stream) or a text (completions); with `token_ids`
    (asked for by `return_token_ids`) the generated ids too."""
    out: dict = {"index": 0}
    if chat and stream:
        delta = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        out["delta"] = delta
    elif chat:
        out["message"] = {"role": "assistant", "content": text or ""}
    else:
        out["text"] = text or ""
    out["logprobs"] = None
    out["finish_reason"] = finish
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out
