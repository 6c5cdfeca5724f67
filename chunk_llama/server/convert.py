"""From an OpenAI request body to the engine's prompts and `GenerationConfig`, and how
its output is read (`sample_reader.ReadSettings`).

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
`response_format` and a forced tool call constrain the output with a grammar. vLLM's:
`min_tokens` is transformers' `min_new_tokens` (no end-of-sequence id before that many);
`stop_token_ids` end the text like the model's end-of-sequence ids (their text stays in
it unless they are special tokens); `ignore_eos` ends it at max_tokens or a stop only;
`skip_special_tokens` false keeps special tokens in the text; `include_stop_str_in_output`
keeps the stop string that ended it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import GenerationConfig

from chunk_llama.engine import OpenAIPenaltiesLogitsProcessor
from chunk_llama.server.errors import OpenAIError
from chunk_llama.server.sample_reader import ReadSettings
from chunk_llama.server.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from chunk_llama.server.tools import call_grammar, chat_prompt


@dataclass
class EngineRequests:
    """What the engine gets for one HTTP request: its prompts, their config, and per prompt
    the keyword arguments of `add_request` (`kwargs()`: a fresh penalties processor each);
    `read`: how each sample's text is read (stop strings, reasoning, tool calls)."""

    prompts: list
    config: GenerationConfig
    grammar: object = None
    penalties: tuple[float, float] | None = None
    adapter: str | None = None  # the LoRA adapter the request's `model` names (None: the base)
    skip_special_tokens: bool = True
    read: ReadSettings = field(default_factory=ReadSettings)

    def kwargs(self) -> dict:
        out = {}
        if self.adapter is not None:
            out["adapter"] = self.adapter
        if self.grammar is not None:
            out["grammar"] = self.grammar
        if self.penalties is not None:
            out["logits_processor"] = [OpenAIPenaltiesLogitsProcessor(*self.penalties)]
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False
        return out


def generation_config(body: _Sampling, max_new_tokens: int | None, want_logprobs: bool, served) -> GenerationConfig:
    """The engine's settings for one request of `body` (see the module doc); `served`:
    the model's vocabulary size and end-of-sequence ids (`served.ServedModel`)."""
    vocab_size = served.vocab_size
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
    stop_ids = list(dict.fromkeys(body.stop_token_ids or []))
    bad = [t for t in stop_ids if not 0 <= t < vocab_size]
    if bad:
        raise OpenAIError(f"stop_token_ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})",
                          param="stop_token_ids")
    if body.ignore_eos or stop_ids:  # ignore_eos: no id of the model's ends the text (stop_token_ids still do)
        kwargs["eos_token_id"] = stop_ids + ([] if body.ignore_eos else [t for t in served.eos_ids if t not in stop_ids])
    if body.min_tokens:
        if max_new_tokens is not None and body.min_tokens > max_new_tokens:
            raise OpenAIError(f"min_tokens={body.min_tokens} exceeds max_tokens={max_new_tokens}", param="min_tokens")
        kwargs["min_new_tokens"] = body.min_tokens
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
    return EngineRequests(prompts, config, grammar=grammar, penalties=penalties if any(penalties) else None,
                          skip_special_tokens=body.skip_special_tokens,
                          read=ReadSettings(body.stop_list(), keep_stop=body.keep_stop_string))


def chat_request(body: ChatCompletionRequest, served) -> EngineRequests:
    """The chat prompt (message dicts for the model's chat template, with the tools and the
    template's options: `tools.py`), its settings, and how its output is read (`served`: the
    template's tool-call and reasoning formats, the server's defaults: `served.ServedModel`).
    Without `max_tokens` / `max_completion_tokens` a chat may run to the end of the model's
    context, as in OpenAI's API."""
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
    template_options = _template_options(body, served)
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
    prompt = chat_prompt(body.messages, body.tools, served.tool_format, served.native_tools, template_options)
    max_new = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    config = generation_config(body, max_new, body.logprobs, served)
    if max_new is None and served.max_positions:
        config.max_length = served.max_positions
    request = _common(body, [prompt], config)
    if choice != "none":
        request.read.tool_format = served.tool_format
        if served.tool_format.keep_special_tokens:
            request.skip_special_tokens = False
    if served.reasoning is not None and body.separate_reasoning and not body.continue_final_message:
        opened = served.reasoning_opened(template_options.get("chat_template_kwargs", {}))
        if opened is not None:  # None: the prompt closed the reasoning (e.g. enable_thinking false)
            request.read.reasoning, request.read.reasoning_opened = served.reasoning, opened
            if served.reasoning.special:
                request.skip_special_tokens = False
    if choice != "none":
        request.grammar = call_grammar(served.tool_format, body.tools, choice, body.parallel_tool_calls,
                                       request.grammar, request.read.reasoning is not None) or request.grammar
    return request


RESERVED_TEMPLATE_NAMES = ("messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
                           "documents", "chat_template", "return_dict")


def _template_options(body: ChatCompletionRequest, served) -> dict:
    """The chat template's options of `body` beyond its messages and tools (those at their
    defaults left out): the server's `chat_template_kwargs` under the request's, its
    `reasoning_effort`, and where the reply begins (`add_generation_prompt`,
    `continue_final_message`)."""
    kwargs = dict(served.default_template_kwargs)
    kwargs.update(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    reserved = [k for k in kwargs if k in RESERVED_TEMPLATE_NAMES]
    if reserved:
        raise OpenAIError(f"chat_template_kwargs: {reserved[0]!r} is not a template variable a request may set "
                          "(it has its own field)", param="chat_template_kwargs")
    last = body.messages[-1].role
    if body.continue_final_message:
        if last != "assistant":
            raise OpenAIError("continue_final_message needs the last message to be the assistant's",
                              param="continue_final_message")
        if "add_generation_prompt" in body.model_fields_set and body.add_generation_prompt:
            raise OpenAIError("continue_final_message and add_generation_prompt cannot both be true",
                              param="continue_final_message")
    elif last == "assistant" and body.add_generation_prompt:
        raise OpenAIError("the last message is the assistant's: to continue it, set continue_final_message "
                          "(and add_generation_prompt false)", param="messages")
    options: dict = {}
    if kwargs:
        options["chat_template_kwargs"] = kwargs
    if body.continue_final_message:
        options.update(add_generation_prompt=False, continue_final_message=True)
    elif not body.add_generation_prompt:
        options["add_generation_prompt"] = False
    return options


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


def completion_requests(body: CompletionRequest, served) -> EngineRequests:
    """The prompts (strings tokenized as given, or token ids) and their settings; without
    `max_tokens`, 16 new tokens (OpenAI's default)."""
    prompts = body.prompts()
    if not prompts:
        raise OpenAIError("prompt is empty", param="prompt")
    if body.stream and body.logprobs is not None:
        raise OpenAIError("logprobs are not supported with stream=true", param="logprobs")
    max_new = body.max_tokens if body.max_tokens is not None else 16
    return _common(body, prompts, generation_config(body, max_new, body.logprobs is not None, served))
