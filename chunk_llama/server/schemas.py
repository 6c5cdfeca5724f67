"""Request bodies of the OpenAI-compatible endpoints (pydantic).

Only what the engine honours is accepted: an unknown field is a 400 naming it,
rather than a setting silently ignored. Field bounds follow OpenAI's API; what
needs the model (the model name, prompt length, `n` against the batch size) is
checked later, in `convert.py` and by the engine.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    """One part of a message's content given as a list (text parts only)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A chat turn. `content` is a string or a list of text parts (joined)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    """`include_usage`: a last chunk (no choices) carries the request's usage."""

    include_usage: bool = False


class _Sampling(_Strict):
    """Settings shared by both endpoints."""

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0)
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > 16 or not all(stops)):
            raise ValueError("stop must be a non-empty string or a list of at most 16 non-empty strings")
        return value

    def stop_list(self) -> list[str]:
        """`stop` as a list (empty when unset)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions. `max_completion_tokens` is the newer name of `max_tokens`.
    `logprobs` / `top_logprobs` (0-20) return the model's log-probabilities of the chosen
    (and the most likely) tokens; not with `stream`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, token ids, or a list of either (one
    request each; choices are numbered prompt by prompt, `n` per prompt). `logprobs`
    (0-5): log-probabilities of the chosen tokens and that many alternatives."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Literal[False] = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per engine request."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)
