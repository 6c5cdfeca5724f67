"""Each model family's tool-call format: how calls look in its output (what the parser reads
and what the grammar of a forced call writes), how earlier calls are written into a prompt
whose chat template does not render them, and what such a prompt tells the model.

`--tool-call-parser` (vLLM's names):
  hermes       `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Qwen 2.5/3,
               Hermes, SmolLM3; also the fallback for templates with no format of their own)
  llama3_json  `{"name": ..., "parameters": {...}}` objects at the start of the output, `; `
               between them, optionally after `<|python_tag|>` (Llama 3.1-3.3)
  mistral      `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral v3 tokenizers:
               Mistral 7B v0.3, Nemo, Small)
  auto         (the default) the one the chat template writes, else hermes.

A marker that is a special token of the tokenizer (Mistral's `[TOOL_CALLS]`) is matched by
the grammar as that token, and requests that read calls keep special tokens in their text.
"""

from __future__ import annotations

import json
import logging
import secrets
import string
import uuid

from chunk_llama.engine.grammar import JSON_OPTIONS, Grammar
from chunk_llama.errors import UsageError
from chunk_llama.logs import log_once
from chunk_llama.server.tool_parsers import HermesParser, JsonCallsParser

logger = logging.getLogger(__name__)

PARSER_NAMES = ("auto", "hermes", "llama3_json", "mistral")
_INTRO = ("You may call one or more functions to assist with the user query. The functions are described "
          "in JSON within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n")


def _call_schema(tool, arguments_key: str) -> dict:
    function = tool.function
    return {"type": "object", "properties": {"name": {"const": function.name},
                                             arguments_key: closed(function.parameters or {"type": "object"})},
            "required": ["name", arguments_key], "additionalProperties": False}


def closed(schema):
    """`schema` with `additionalProperties: false` on every object that declares properties and
    says nothing of others: a forced call writes the declared arguments only (what OpenAI's
    strict mode requires, and what tool executors check: smolagents refuses a call with an
    argument its tool does not declare)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k not in ("const", "enum", "default", "examples") else v for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


class ToolFormat:
    """The Hermes format, and what every format defines (module doc)."""

    name = "hermes"
    arguments_key = "arguments"
    marker = "<tool_call>"
    how_to_call = ("To call a function, reply with a JSON object holding its name and arguments within "
                   "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

    def __init__(self, marker_token_id: int | None = None):
        self.marker_token_id = marker_token_id  # the marker's id where it is a special token

    @property
    def keep_special_tokens(self) -> bool:
        """Whether requests that read calls must keep special tokens in their text."""
        return self.marker_token_id is not None

    def parser(self):
        """A fresh parser of one sample's text (`tool_parsers.py`)."""
        return HermesParser(self.new_call_id)

    def new_call_id(self) -> str:
        return "call_" + uuid.uuid4().hex[:24]

    def instructions(self, specs: list[dict]) -> str:
        """The system prompt's tool description, for a template that does not render tools."""
        return _INTRO.format(tools="\n".join(json.dumps(s) for s in specs)) + self.how_to_call.format()

    def _call(self, name: str, arguments: str) -> str:
        return f'{{"name":{json.dumps(name)},"{self.arguments_key}":{arguments}}}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Earlier calls `(name, arguments JSON)` as a forced call writes them (compact JSON),
        for a template that does not render calls: the next turn then matches the generated ids."""
        return "\n".join(f"{self.marker}\n{self._call(n, a)}\n</tool_call>" for n, a in calls)

    def _marker_rule(self) -> str:
        return f"<[{self.marker_token_id}]>" if self.marker_token_id is not None else json.dumps(self.marker)

    def _lark(self, parallel: bool) -> str:
        repeat = ' ("\\n" call)*' if parallel else ""
        return f'start: call{repeat}\ncall: {self._marker_rule()} "\\n" body "\\n</tool_call>"\n'

    def grammar(self, tools: list, only: str | None, parallel: bool) -> Grammar:
        """One call (of `only`, if given; else of any tool), or several with `parallel`, in this
        format, each naming the function and giving arguments valid under its parameters' schema."""
        bodies = [_call_schema(t, self.arguments_key) for t in tools if only is None or t.function.name == only]
        schema = {**(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}), "x-guidance": JSON_OPTIONS}
        return Grammar.lark(self._lark(parallel and only is None) + f"body: %json {json.dumps(schema)}\n")


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    marker = "<|python_tag|>"
    how_to_call = ('To call a function, reply with only a JSON object of the form {{"name": function name, '
                   '"parameters": dictionary of argument name and its value}}; several calls are separated '
                   "by '; '.")

    @property
    def keep_special_tokens(self) -> bool:
        return False  # the calls are JSON: `<|python_tag|>` before them may be left out of the text

    def parser(self):
        return JsonCallsParser(self.new_call_id, (self.marker, "{"), at_start=True)

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(self._call(n, a) for n, a in calls)

    def _lark(self, parallel: bool) -> str:
        repeat = ' ("; " body)*' if parallel else ""
        return f"start: body{repeat}\n"


class MistralFormat(ToolFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    how_to_call = ('To call functions, reply with [TOOL_CALLS] followed by a JSON list of calls: '
                   '[TOOL_CALLS][{{"name": <function-name>, "arguments": <args-json-object>}}]')

    def parser(self):
        return JsonCallsParser(self.new_call_id, (self.marker,), at_start=False, keys=("arguments",))

    def new_call_id(self) -> str:
        """Mistral's templates take call ids of 9 letters and digits, no other."""
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        return self.marker + "[" + ",".join(self._call(n, a) for n, a in calls) + "]"

    def _lark(self, parallel: bool) -> str:
        repeat = ' ("," body)*' if parallel else ""
        return f'start: {self._marker_rule()} "[" body{repeat} "]"\n'


FORMATS = {f.name: f for f in (ToolFormat, Llama3JsonFormat, MistralFormat)}


def template_text(tokenizer) -> str:
    """The chat template's source (all of a tokenizer's named templates), or ""."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def tool_format(name: str | None, tokenizer) -> ToolFormat:
    """The format `--tool-call-parser` names; `auto` (or None): the chat template's, else Hermes."""
    name = name or "auto"
    if name not in PARSER_NAMES:
        raise UsageError(f"--tool-call-parser {name!r}: choose one of {', '.join(PARSER_NAMES)}")
    if name == "auto":
        template = template_text(tokenizer)
        if "<tool_call>" in template:
            name = "hermes"
        elif "[TOOL_CALLS]" in template:
            name = "mistral"
        elif "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
            name = "llama3_json"
        else:
            name = "hermes"
            if template:
                log_once(logger, "the chat template writes no tool-call format known here: tool calls use "
                                 "Hermes <tool_call> blocks, described in the system prompt", level=logging.INFO)
    cls = FORMATS[name]
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    marker_id = tokenizer.convert_tokens_to_ids(cls.marker) if cls.marker in special else None
    return cls(marker_id)


_PROBE_TOOL, _PROBE_CALL = "zz_probe_tool", "zz_probe_call"


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template renders `tools` and earlier calls itself (both probe names
    appear in a rendering of a turn that has them); else the fallback writes them (`tools.py`)."""
    if not template_text(tokenizer):
        return False
    tools = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "a1b2c3d4e", "type": "function",
                 "function": {"name": _PROBE_CALL, "arguments": {}}}]},
                {"role": "tool", "tool_call_id": "a1b2c3d4e", "name": _PROBE_CALL, "content": "ok"},
                {"role": "user", "content": "thanks"}]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001 - a template that refuses tools: the fallback renders them
        log_once(logger, "the chat template does not render tools and tool calls (%s): they are written into "
                         "the prompt as described in the system prompt", error)
        return False
    return _PROBE_TOOL in text and _PROBE_CALL in text
