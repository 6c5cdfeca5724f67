"""From an OpenAI request body to the engine's prompts and `GenerationConfig`, and the
OpenAI-style error raised for a bad request.

Sampling: `temperature` 0 decodes greedily; above 0 it samples at that temperature
(with `top_p`, if given). Omitted, the model's own `generation_config` decides, as
`generate` does (greedy for the default model): OpenAI samples at 1.0 by default,
so pass `temperature` explicitly for that. `seed` seeds the request's own generator
(the engine draws a seeded request's tokens exactly as `generate` after
`torch.manual_seed(seed)`, whatever else is in the batch).

The other options, each as its definition says: `top_k`, `min_p` and `repetition_penalty`
are transformers' processors of those names; `logit_bias` is added to the logits
(transformers' `sequence_bias` with one-token sequences); `frequency_penalty` and
`presence_penalty` are OpenAI's (`engine/penalties.py`: counted over the completion);
`response_format` and a forced tool call constrain the output with a grammar.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import GenerationConfig

from chunk_llama.engine import OpenAIPenaltiesLogitsProcessor
from chunk_llama.server import tools as tool_calls
from chunk_llama.server.errors import OpenAIError
from chunk_llama.server.schemas import ChatCompletionRequest, CompletionRequest, _Sampling


@dataclass
class EngineRequests:
    """What the engine gets for one HTTP request: its prompts, their config, and per prompt
    the keyword arguments of `add_request` (`kwargs()`: a fresh penalties processor each).
    `tool_parsing`: read tool calls out of the text (chat with tools, tool_choice not none)."""

    prompts: list
    config: GenerationConfig
    grammar: object = None
    penalties: tuple[float, float] | None = None
    tool_parsing: bool = False
    adapter: str | None = None  # the LoRA adapter the request's `model` names (None: the base)

    def kwargs(self) -> dict:
        out = {}
        if self.adapter is not None:
            out["adapter"] = self.adapter
        if self.grammar is not None:
            out["grammar"] = self.grammar
        if self.penalties is not None:
            out["logits_processor"] = [OpenAIPenaltiesLogitsProcessor(*self.penalties)]
        return out


def generation_config(body: _Sampling, max_new_tokens: int | None, want_logprobs: bool,
                      vocab_size: int) -> GenerationConfig:
    """The engine's settings for one request of `body` (see the module doc)."""
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
        else:  # OpenAI samples from the whole distribution: no top-k unless asked for (below)
            kwargs.update(do_sample=True, temperature=body.temperature, top_k=0)
    if body.temperature != 0:  # greedy decoding: the warpers would change nothing
        for name in ("top_p", "top_k", "min_p"):
            if getattr(body, name) is not None:
                kwargs[name] = getattr(body, name)
    if body.repetition_penalty is not None:
        kwargs["repetition_penalty"] = body.repetition_penalty
    if body.logit_bias:
        bad = [t for t in body.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"logit_bias: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                              param="logit_bias")
        kwargs["sequence_bias"] = [[[token], bias] for token, bias in body.logit_bias.items()]
    stops = body.stop_list()
    if stops:
        kwargs["stop_strings"] = stops
    if body.seed is not None:
        kwargs["seed"] = body.seed
    if body.ignore_eos:  # generate to max_tokens: no id ends the text
        kwargs["eos_token_id"] = []
    if want_logprobs:
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    try:
        return GenerationConfig(**kwargs)
    except ValueError as error:  # transformers' own validation of the combination
        raise OpenAIError(f"invalid generation settings: {error}") from error


def _common(body: _Sampling, prompts: list, config: GenerationConfig) -> EngineRequests:
    penalties = (body.frequency_penalty or 0.0, body.presence_penalty or 0.0)
    grammar = None
    if body.response_format is not None and body.response_format.type != "text":
        grammar = body.response_format.as_dict()
    return EngineRequests(prompts, config, grammar=grammar, penalties=penalties if any(penalties) else None)


def chat_request(body: ChatCompletionRequest, max_positions: int | None, vocab_size: int,
                 native_tools: bool) -> EngineRequests:
    """The chat prompt (message dicts for the model's chat template, with the tools: `tools.py`)
    and its settings. Without `max_tokens` / `max_completion_tokens` a chat may run to the end
    of the model's context (`max_positions`), as in OpenAI's API. `native_tools`: the template
    renders tools itself."""
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
    choice = body.tool_choice or ("auto" if body.tools else "none")
    named = choice.function.name if not isinstance(choice, str) else None
    if choice != "none" and not body.tools:
        raise OpenAIError("tool_choice needs tools", param="tool_choice")
    if named is not None and named not in [t.function.name for t in body.tools]:
        raise OpenAIError(f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
    forced = choice == "required" or named is not None
    if forced and body.response_format is not None and body.response_format.type != "text":
        raise OpenAIError("response_format cannot constrain a reply that must be a tool call",
                          param="response_format")
    prompt = tool_calls.chat_prompt(body.messages, body.tools, native_tools)
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    config = generation_config(body, max_new, body.logprobs, vocab_size)
    if max_new is None and max_positions:
        config.max_length = max_positions
    request = _common(body, [prompt], config)
    request.tool_parsing = choice != "none"
    if forced:
        request.grammar = tool_calls.call_grammar(body.tools, named, body.parallel_tool_calls)
    return request


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


def completion_requests(body: CompletionRequest, vocab_size: int) -> EngineRequests:
    """The prompts (strings tokenized as given, or token ids) and their settings; without
    `max_tokens`, 16 new tokens (OpenAI's default)."""
    prompts = body.prompts()
    if not prompts:
        raise OpenAIError("prompt is empty", param="prompt")
    if body.stream and body.logprobs is not None:
        raise OpenAIError("logprobs are not supported with stream=true", param="logprobs")
    max_new = body.max_tokens if body.max_tokens is not None else 16
    return _common(body, prompts, generation_config(body, max_new, body.logprobs is not None, vocab_size))
