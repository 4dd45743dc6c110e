"""The OpenAI request bodies the server accepts, and the response and chunk bodies it writes.

Unsupported OpenAI parameters (n > 1, logprobs, tools, penalties, ...) are refused by name with
a 400 rather than ignored; unknown fields are refused too.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 4


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


# OpenAI parameters that exist but that this server does not implement: refused when set to a value
# that would change the output (None, 1, 0, false, {} are what a client sends when it leaves them alone).
UNSUPPORTED = {
    "n": 1, "best_of": 1, "logprobs": (False, None), "top_logprobs": (None, 0), "echo": False, "suffix": None,
    "tools": None, "tool_choice": None, "functions": None, "function_call": None, "parallel_tool_calls": None,
    "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "response_format": None,
    "audio": None, "modalities": None, "prediction": None,
}  # fmt: skip


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # extra fields are checked by `_refuse_unsupported`
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI does for logging

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name not in UNSUPPORTED:
                raise ValueError(f"unknown parameter '{name}'")
            allowed = UNSUPPORTED[name]
            allowed = allowed if isinstance(allowed, tuple) else (allowed,)
            if value not in allowed and value not in (None, {}, []):
                raise ValueError(f"parameter '{name}' is not supported by this server (got {value!r})")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        return self

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
        return [s for s in stop if s]


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            if self.max_completion_tokens < 1:
                raise ValueError(f"max_completion_tokens must be >= 1, got {self.max_completion_tokens}")
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise ValueError("only one prompt per request (a list of several prompts is not supported)")
            self.prompt = self.prompt[0]
        if not self.prompt:
            raise ValueError("empty prompt")
        return self


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def choice(chat: bool, text: str | None, finish: str | None, first: bool = False, stream: bool = False) -> dict:
    """One entry of `choices`: a message (chat), a delta (chat stream) or a text (completions)."""
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
    return out
