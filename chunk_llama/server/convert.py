"""From an OpenAI request body to the engine's prompts and `GenerationConfig`, and the
OpenAI-style error raised for a bad request.

Sampling: `temperature` 0 decodes greedily; above 0 it samples at that temperature
(with `top_p`, if given). Omitted, the model's own `generation_config` decides, as
`generate` does (greedy for the default model): OpenAI samples at 1.0 by default,
so pass `temperature` explicitly for that. `seed` seeds the request's own generator
(the engine draws a seeded request's tokens exactly as `generate` after
`torch.manual_seed(seed)`, whatever else is in the batch).
"""

from __future__ import annotations

from transformers import GenerationConfig

from chunk_llama.server.schemas import ChatCompletionRequest, CompletionRequest, _Sampling


class OpenAIError(Exception):
    """A request the server refuses, sent as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type

    def body(self) -> dict:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


def check_model(body: _Sampling, served: list[str]) -> None:
    """The request must name the served model."""
    if body.model not in served:
        raise OpenAIError(
            f"model {body.model!r} does not exist here; this server serves {served[0]!r}", param="model"
        )


def generation_config(body: _Sampling, max_new_tokens: int | None, want_logprobs: bool) -> GenerationConfig:
    """The engine's settings for one request of `body` (see the module doc for sampling)."""
    if body.n > 1 and not body.temperature:
        raise OpenAIError(
            f"n={body.n} needs temperature > 0: greedy decoding would return {body.n} identical choices",
            param="n",
        )
    kwargs: dict = {"num_return_sequences": body.n}
    if max_new_tokens is not None:
        kwargs["max_new_tokens"] = max_new_tokens
    if body.temperature is not None:
        if body.temperature == 0:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=body.temperature, top_k=0)  # OpenAI has no top-k
            if body.top_p is not None:
                kwargs["top_p"] = body.top_p
    elif body.top_p is not None:
        kwargs["top_p"] = body.top_p
    stops = body.stop_list()
    if stops:
        kwargs["stop_strings"] = stops
    if body.seed is not None:
        kwargs["seed"] = body.seed
    if want_logprobs:
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    try:
        return GenerationConfig(**kwargs)
    except ValueError as error:  # transformers' own validation of the combination
        raise OpenAIError(f"invalid generation settings: {error}") from error


def chat_request(
    body: ChatCompletionRequest, max_positions: int | None
) -> tuple[list[dict], GenerationConfig]:
    """The chat prompt (message dicts, for the model's chat template) and its config. Without
    `max_tokens` / `max_completion_tokens` a chat may run to the end of the model's context
    (`max_positions`), as in OpenAI's API."""
    if (
        body.max_tokens is not None
        and body.max_completion_tokens is not None
        and body.max_tokens != body.max_completion_tokens
    ):
        raise OpenAIError(
            "max_tokens and max_completion_tokens differ; give one", param="max_completion_tokens"
        )
    if body.stream and body.logprobs:
        raise OpenAIError("logprobs are not supported with stream=true", param="logprobs")
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
    if body.messages[-1].role == "assistant":
        raise OpenAIError(
            "the last message is the assistant's: continuing an assistant turn is not supported",
            param="messages",
        )
    messages = []
    for message in body.messages:
        item = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        messages.append(item)
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    config = generation_config(body, max_new, body.logprobs)
    if max_new is None and max_positions:
        config.max_length = max_positions
    return messages, config


def explain(error: Exception, config: GenerationConfig) -> str:
    """The engine's (or transformers') message for a refused request; a chat without a length
    whose prompt fills the model's context gets a plainer one than transformers'."""
    message = str(error)
    if (
        config.max_new_tokens is None
        and config.max_length is not None
        and message.startswith("Input length of")
    ):
        return (
            f"the prompt leaves no room to generate: this model's context is {config.max_length} tokens "
            f"({message.split('.')[0]})"
        )
    return message


def completion_requests(body: CompletionRequest) -> tuple[list[str | list[int]], GenerationConfig]:
    """The prompts (strings tokenized as given, or token ids) and their config; without
    `max_tokens`, 16 new tokens (OpenAI's default)."""
    prompts = body.prompts()
    if not prompts:
        raise OpenAIError("prompt is empty", param="prompt")
    if body.stream and body.logprobs is not None:
        raise OpenAIError("logprobs are not supported with stream=true", param="logprobs")
    max_new = body.max_tokens if body.max_tokens is not None else 16
    return prompts, generation_config(body, max_new, body.logprobs is not None)
