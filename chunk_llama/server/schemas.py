"""Request bodies of the OpenAI-compatible endpoints (pydantic).

A field of OpenAI's API or vLLM's extensions that the engine honours is validated here,
and a malformed value of it is a 400 naming the field. A field unknown here is accepted
and ignored, as vLLM does (`extra="allow"`): clients such as LangChain, LiteLLM and the
OpenAI SDK's `extra_body` send fields of other servers (`fields.py` logs each name once and
lists them in the `X-Chunk-Llama-Ignored-Fields` response header). Fields clients send
that change nothing here (`user`, `metadata`, `store`, `service_tier`) are known and
ignored. Field bounds follow OpenAI's API; what needs the model (the model name, prompt
length, `n` against the batch size) is checked later, in `convert.py` and by the engine.
`top_k`, `min_p` and `repetition_penalty` are transformers' (and vLLM's) processors;
`ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`,
`include_stop_str_in_output`, `chat_template_kwargs`, `add_generation_prompt` and
`continue_final_message` are vLLM's fields, as vLLM defines them; what sglang-router adds
to every request it forwards is accepted at its defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from chunk_llama.server.text_checks import lone_surrogate

SEED_RANGE = (-(1 << 63), (1 << 63) - 1)  # OpenAI's: a 64-bit signed integer


class _Strict(BaseModel):
    """A part of a request body: its fields validated, unknown ones kept aside (`model_extra`).
    No string in it may hold a lone surrogate (`text_checks.py`): a 400 naming where."""

    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="after")
    @classmethod
    def _no_lone_surrogate(cls, value):
        found = lone_surrogate(value)
        if found is not None:
            raise PydanticCustomError("string_unicode", found)
        return value


class TextPart(_Strict):
    """One part of a message's content given as a list (text parts only)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    """A called function: its name and its arguments as a JSON text."""

    name: str
    arguments: str


class ToolCall(_Strict):
    """One tool call of an assistant message."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    """A chat turn. `content` is a string or a list of text parts (joined); an assistant
    turn may carry `tool_calls`, a `tool` turn answers the call `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning, for templates that render it

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


class FunctionDefinition(_Strict):
    """A function the model may call; `parameters` is a JSON schema of its arguments."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`tool_choice` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`text`, `json_object` (any JSON object) or `json_schema` (valid under its schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def as_dict(self) -> dict:
        """As the engine's `grammar` argument takes it."""
        return self.model_dump(by_alias=True, exclude_none=True)


class _Sampling(_Strict):
    """Settings shared by both endpoints."""

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None  # in SEED_RANGE
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None
    top_k: int | None = Field(None, ge=-1)  # -1: none (vLLM's and SGLang's; sglang-router writes it)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    response_format: ResponseFormat | None = None
    # accepted and ignored: they change nothing in what is generated
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # SGLang's, which sglang-router writes into every request it forwards (with these
    # defaults): no_stop_trim is SGLang's include_stop_str_in_output
    no_stop_trim: bool = False
    return_hidden_states: Literal[False] = False

    @field_validator("top_k")
    @classmethod
    def _no_top_k(cls, value):
        return None if value == -1 else value

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value):
        if value is not None and not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
            raise PydanticCustomError("int_range", "must be a 64-bit signed integer, from {low} to {high}; got {value}",
                                      {"low": SEED_RANGE[0], "high": SEED_RANGE[1], "value": value})
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value):
        if value is not None and not all(-100.0 <= b <= 100.0 for b in value.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else value
        if stops is not None and (len(stops) > 16 or not all(stops)):
            raise ValueError("stop must be a non-empty string or a list of at most 16 non-empty strings")
        return value

    @property
    def keep_stop_string(self) -> bool:
        """Whether the text keeps the stop string that ended it."""
        return self.include_stop_str_in_output or self.no_stop_trim

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
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # the chat template: its own variables (e.g. enable_thinking), over the server's defaults
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not answered
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # to the template
    # SGLang's: separate_reasoning false leaves the reasoning in `content`
    separate_reasoning: bool = True
    stream_reasoning: bool = True


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
