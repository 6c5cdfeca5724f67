"""A `POST /v1/responses` body: validated against the `openai` package's own request types
(`ResponseCreateParamsBase`, a TypedDict per input item and tool), then turned into the
chat request it means (`ChatCompletionRequest`), which runs as any chat does: same prompt,
same engine, same prefix cache and guards, so a Responses answer is the chat answer.

Inputs: `instructions` (the first system message; not carried over from a previous
response), `input` as a string (one user message) or items: messages (text parts),
`function_call` items (an assistant turn's calls) and `function_call_output` items (tool
turns), `reasoning` items (an assistant turn's `reasoning_content`). Options: function
`tools` (`strict: true` as in chat: `tools.call_grammar`) and `tool_choice`, `text.format`
(`json_schema`, `json_object`), `max_output_tokens`,
`temperature`, `top_p`, `parallel_tool_calls`, `reasoning.effort` (to the chat template, as
`reasoning_effort`), and vLLM's sampling fields (`SAMPLING_EXTRAS`). What no text model here
can do is a 400 naming it: other tool types, image and file inputs, `background`,
`conversation`, prompt templates, logprobs. Fields of OpenAI's that change nothing here
(`store` aside: `store.py`) are accepted and ignored; unknown ones are listed as for chat.
"""

from __future__ import annotations

import functools
import typing

from pydantic import TypeAdapter, ValidationError

from chunk_llama.server.errors import OpenAIError

SAMPLING_EXTRAS = ("stop", "seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "logit_bias", "ignore_eos", "min_tokens", "stop_token_ids", "skip_special_tokens",
                   "include_stop_str_in_output", "chat_template_kwargs")
_REFUSED = {"background": "background responses", "conversation": "conversations (use previous_response_id)",
            "prompt": "prompt templates", "top_logprobs": "logprobs"}
_CHAT_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


class InvalidBody(Exception):
    """A body that does not validate: pydantic's errors, paths as in the body."""

    def __init__(self, errors: list[dict]):
        super().__init__(str(errors))
        self.errors = errors


@functools.cache
def _field_types() -> dict:
    from openai.types.responses.response_create_params import ResponseCreateParamsBase

    return typing.get_type_hints(ResponseCreateParamsBase)


@functools.cache
def _adapter(kind) -> TypeAdapter:
    return TypeAdapter(kind)


@functools.cache
def _item_types() -> dict[str, tuple]:
    """Input item and tool types this server takes, by their `type`, as the openai package types them."""
    from openai.types.responses import (
        EasyInputMessageParam,
        FunctionToolParam,
        ResponseFunctionToolCallParam,
        ResponseOutputMessageParam,
        ResponseReasoningItemParam,
    )
    from openai.types.responses.response_input_item_param import FunctionCallOutput, Message

    return {"message": (EasyInputMessageParam, Message, ResponseOutputMessageParam),
            "function_call": (ResponseFunctionToolCallParam,), "function_call_output": (FunctionCallOutput,),
            "reasoning": (ResponseReasoningItemParam,), "function": (FunctionToolParam,)}


def validate_body(body) -> tuple[dict, list[str]]:
    """The body's known fields, validated, and the names of the unknown ones. Raises
    `InvalidBody` (a 400 with pydantic's message) or `OpenAIError` (what is not served here)."""
    if not isinstance(body, dict):
        raise InvalidBody([{"type": "dict_type", "loc": (), "msg": "the body must be a JSON object"}])
    types = _field_types()
    known, unknown = {}, []
    for name, value in body.items():
        if name in ("input", "tools") and isinstance(value, list):
            known[name] = [_item(value[i], (name, i), "function" if name == "tools" else None)
                           for i in range(len(value))]
        elif name == "stream":  # null: not streamed (sglang-router writes it when the client sent none)
            known[name] = False if value is None else _validate(bool, value, (name,))
        elif name in types:
            known[name] = _validate(types[name], value, (name,))
        elif name in SAMPLING_EXTRAS:
            known[name] = value  # validated by the chat request
        else:
            unknown.append(name)
    for name, what in _REFUSED.items():
        if known.get(name) not in (None, False, 0):
            raise OpenAIError(f"{name}: {what} are not supported by this server", param=name)
    if "model" not in known:
        raise InvalidBody([{"type": "missing", "loc": ("model",), "msg": "Field required"}])
    return known, sorted(unknown)


def _validate(kind, value, loc: tuple):
    try:
        return _materialize(_adapter(kind).validate_python(value))
    except ValidationError as error:
        raise InvalidBody([{**e, "loc": loc + tuple(e["loc"])} for e in error.errors()]) from None


def _materialize(value):
    """pydantic validates an `Iterable` field lazily: its items are checked as they are read."""
    if isinstance(value, dict):
        return {k: _materialize(v) for k, v in value.items()}
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if hasattr(value, "__iter__"):
        return [_materialize(v) for v in value]
    return value


_ITEM_KINDS = {"input": ("message", "function_call", "function_call_output", "reasoning"), "tools": ("function",)}


def _item(item, loc: tuple, default_type: str | None):
    """One input item (or tool) validated as the openai type its `type` names."""
    kind = item.get("type", default_type or "message") if isinstance(item, dict) else None
    if kind not in _ITEM_KINDS[loc[0]]:
        what = "tools" if loc[0] == "tools" else "input items"
        path = ".".join(map(str, loc))
        raise OpenAIError(f"{path}: {what} of type {kind!r} are not supported by this server (it serves function "
                          "tools and text)", param=path)
    first_error = None
    for candidate in _item_types()[kind]:
        try:
            return _validate(candidate, item, loc)
        except InvalidBody as error:
            first_error = first_error or error
    raise first_error


def chat_body(body: dict, previous_messages: list[dict]) -> dict:
    """The chat completion request (a dict for `ChatCompletionRequest`) that `body` (validated)
    means, after the earlier turns `previous_messages` (a stored response's conversation)."""
    messages = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    messages += previous_messages
    messages += input_messages(body.get("input", []))
    chat = {"model": body["model"], "messages": messages, "stream": bool(body.get("stream"))}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "metadata", *SAMPLING_EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        keys = ("name", "description", "parameters", "strict")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in keys
                                                           if t.get(k) is not None}} for t in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise OpenAIError(f"tool_choice of type {choice.get('type')!r} is not supported by this server",
                              param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    text_format = (body.get("text") or {}).get("format")
    if text_format and text_format["type"] == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            k: text_format[k] for k in ("name", "schema", "description", "strict") if k in text_format}}
    elif text_format:
        chat["response_format"] = {"type": text_format["type"]}
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def input_messages(items) -> list[dict]:
    """Input items as chat messages: consecutive assistant text, reasoning and function calls
    make one assistant turn; each call's output one tool turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []

    def assistant() -> dict:
        if not messages or messages[-1]["role"] != "assistant" or messages[-1].get("_closed"):
            messages.append({"role": "assistant", "content": None})
        return messages[-1]

    for item in items:
        kind = item.get("type", "message")
        if kind == "message" and item["role"] == "assistant":
            turn = assistant()
            if turn.get("tool_calls"):  # text after calls begins another turn
                turn["_closed"] = True
                turn = assistant()
            turn["content"] = (turn["content"] or "") + _text(item["content"])
        elif kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "reasoning":
            turn = assistant()
            parts = item.get("content") or item.get("summary") or []
            turn["reasoning_content"] = (turn.get("reasoning_content") or "") + "".join(p["text"] for p in parts)
        elif kind == "function_call":
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        else:  # function_call_output
            output = item["output"] if isinstance(item["output"], str) else _text(item["output"])
            messages.append({"role": "tool", "tool_call_id": item.get("call_id") or "", "content": output})
    for m in messages:
        m.pop("_closed", None)
    return messages


def _text(content) -> str:
    """A message's content as one text: text parts only."""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") not in ("input_text", "output_text", "text", "refusal"):
            raise OpenAIError(f"input content of type {part.get('type')!r} is not supported by this server (text "
                              "only)", param="input")
        texts.append(part.get("text") or part.get("refusal") or "")
    return "".join(texts)


def chat_param(loc: str) -> str:
    """A chat request's field path as the Responses body names it."""
    head, _, rest = loc.partition(".")
    return _CHAT_NAMES.get(head, head) + (f".{rest}" if rest else "")
