"""A chat request's messages and tools as the engine's prompt (`engine/inputs.py`'s chat
dict), written for the model's chat template.

A template that renders tools and earlier calls itself (`tool_formats.template_renders_tools`:
Qwen's, Llama 3.1's, Mistral's, Hermes') gets them as it expects: `tools` as OpenAI's
function specs, each earlier call with its arguments as a dict, tool results as `tool`
messages. Any other template gets the fallback: the tools described in the system message
in the server's tool-call format (`tool_formats.py`), earlier calls written into the
assistant's text as that format writes them (compact JSON: what a forced call generates, so
a conversation's next turn matches the generated ids and reuses its chunks), and tool
results as user turns in `<tool_response>` tags.

`tool_choice`: `none` (tools in the prompt, text not parsed), `auto` (the default with
tools: the model may call; calls that parse become `tool_calls`), `required` (the output is
one or more calls under a grammar of the tools' schemas; one with `parallel_tool_calls:
false`), or a named function (one call of it under its schema). Under `auto` a function
with `strict: true` is OpenAI's guarantee: the output is text or calls, and a call, once its
marker is written, is a valid call of a declared tool (`call_grammar`).
"""

from __future__ import annotations

import json
import logging

from chunk_llama.logs import log_once
from chunk_llama.server.errors import OpenAIError

logger = logging.getLogger(__name__)


def call_grammar(tool_format, tools: list, choice, parallel: bool, answer_grammar, reasoning: bool = False):
    """The grammar of a reply under `choice` (`"required"`, `"auto"` or a named function:
    `NamedToolChoice`): forced calls only; under `auto` with a strict tool, free text or calls
    in the format, each valid under its tool's closed schema; else None (unconstrained).
    `answer_grammar`: the request's `response_format` grammar, which a reply that may be
    text keeps; `reasoning`: the reply opens with a reasoning model's thinking, whose tags
    (added tokens) no text of the grammar may write. In both cases the strict tools are not
    enforced under `auto` (logged once)."""
    if not isinstance(choice, str):
        return tool_format.grammar(tools, choice.function.name, parallel)
    if choice == "required":
        return tool_format.grammar(tools, None, parallel)
    if choice != "auto" or not any(t.function.strict for t in tools):
        return None
    if answer_grammar is not None:
        log_once(logger, "strict tools under tool_choice auto with a response_format: the answer follows the "
                         "response_format, the tools' calls are not constrained (logged once)")
        return None
    if reasoning:
        log_once(logger, "strict tools under tool_choice auto on a reasoning model: its thinking tags are tokens "
                         "a grammar's text cannot write, so the tools' calls are not constrained (logged once)")
        return None
    return tool_format.grammar(tools, None, parallel, free_text=True)


def chat_prompt(messages: list, tools: list | None, tool_format, native: bool, template_options: dict):
    """The engine's prompt for `messages` (pydantic `ChatMessage`s) and `tools` (pydantic
    `Tool`s) in `tool_format`; `native`: the template renders tools and calls itself;
    `template_options`: the template's other options (`chat_template_kwargs`,
    `add_generation_prompt`, `continue_final_message`; those at their defaults left out)."""
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if native:
            item = {"role": role, "content": text}
            if m.tool_calls:
                item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id is not None:
                item["tool_call_id"] = m.tool_call_id
        elif role == "tool":
            item = {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
        else:
            for c in m.tool_calls or []:
                _arguments(c.function.arguments)  # refused unless valid JSON, as with a native template
            calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
            item = {"role": role, "content": text + (tool_format.calls_text(calls) if calls else "")}
        if m.name is not None:
            item["name"] = m.name
        if m.reasoning_content is not None and role == "assistant":
            item["reasoning_content"] = m.reasoning_content
        out.append(item)
    if tools:
        specs = [_spec(t) for t in tools]
        if native:
            template_options = {**template_options, "tools": specs}
        else:
            described = tool_format.instructions(specs)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
            else:
                out.insert(0, {"role": "system", "content": described})
    return {"messages": out, **template_options} if template_options else out


def _arguments(text: str):
    """An earlier call's arguments as the dict a template's `tojson` expects."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise OpenAIError(f"a tool call's arguments are not valid JSON: {error}", param="messages") from error


def _spec(tool) -> dict:
    """A tool as OpenAI's function spec (the fields a template reads; a client's extra fields left out)."""
    function = {"name": tool.function.name}
    for name in ("description", "parameters"):
        if getattr(tool.function, name) is not None:
            function[name] = getattr(tool.function, name)
    return {"type": "function", "function": function}
