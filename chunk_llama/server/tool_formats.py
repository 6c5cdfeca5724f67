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

A marker that is a token of its own (an added token: Mistral's `[TOOL_CALLS]`, Qwen's
`<tool_call>`; llguidance lets no text write those) is matched by the grammar as that token,
and where it is a special token requests that read calls keep special tokens in their text.
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
from chunk_llama.server.tool_schemas import call_schema

logger = logging.getLogger(__name__)

PARSER_NAMES = ("auto", "hermes", "llama3_json", "mistral")
_INTRO = ("You may call one or more functions to assist with the user query. The functions are described "
          "in JSON within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n")


class ToolFormat:
    """The Hermes format, and what every format defines (module doc)."""

    name = "hermes"
    arguments_key = "arguments"
    marker = "<tool_call>"
    how_to_call = ("To call a function, reply with a JSON object holding its name and arguments within "
                   "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                   '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

    def __init__(self, marker_token_id: int | None = None, marker_special: bool = False):
        self.marker_token_id = marker_token_id  # the marker's id where it is one token of its own
        self.marker_special = marker_special  # that token is special: decoding would drop it

    @property
    def keep_special_tokens(self) -> bool:
        """Whether requests that read calls must keep special tokens in their text."""
        return self.marker_special

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

    def _after(self, parallel: bool) -> str:
        """The rule `after`: the calls after the first one's marker."""
        more = f' ("\\n" {self._marker_rule()} one)*' if parallel else ""
        return f'after: one{more}\none: "\\n" body "\\n</tool_call>"\n'

    def _start(self, free_text: bool) -> str:
        """The rule `start`: the calls alone, or (`free_text`) text without the marker, or that text
        and the marker then calls. A text marker ends the first `LEAD` (a lexeme ending at the
        marker's first occurrence); a marker token of its own cannot be written by text: it ends the text."""
        if not free_text:
            return f"start: {self._marker_rule()} after\n"
        marker = _regex(self.marker)
        plain = f"PLAIN: /(.|\\n)+/ & ~/(.|\\n)*{marker}(.|\\n)*/\n"
        if self.marker_token_id is not None:
            return f"start: PLAIN? | PLAIN? {self._marker_rule()} after\n" + plain
        return (f"start: PLAIN? | LEAD after\n{plain}"
                f"LEAD: /(.|\\n)*{marker}/ & ~/(.|\\n)*{marker}(.|\\n)+/\n")

    def grammar(self, tools: list, only: str | None, parallel: bool, free_text: bool = False) -> Grammar:
        """One call (of `only`, if given; else of any tool), or several with `parallel`, in this
        format, each naming the function and giving arguments valid under its parameters' schema
        (`tool_schemas.py`); `free_text`: or text, the calls (if any) after it (`tool_choice`
        auto with a strict tool)."""
        bodies = [call_schema(t.function, self.arguments_key) for t in tools if only is None or t.function.name == only]
        schema = {**(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}), "x-guidance": JSON_OPTIONS}
        rules = self._start(free_text) + self._after(parallel and only is None)
        return Grammar.lark(rules + f"body: %json {json.dumps(schema)}\n")


def _regex(text: str) -> str:
    """`text` as a literal in a Lark regex (Rust's syntax: `<` and `>` are not escaped there)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~" else c for c in text)


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

    def _after(self, parallel: bool) -> str:
        more = ' ("; " body)*' if parallel else ""
        return f"after: body{more}\n"

    def _start(self, free_text: bool) -> str:
        """Calls only at the output's start (the parser's rule): text must not begin as they do."""
        if not free_text:
            return "start: after\n"
        return f"start: PLAIN? | after\nPLAIN: /(.|\\n)+/ & ~/\\s*(\\{{|{_regex(self.marker)})(.|\\n)*/\n"


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

    def _after(self, parallel: bool) -> str:
        more = ' ("," body)*' if parallel else ""
        return f'after: "[" body{more} "]"\n'


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
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    marker_id = tokenizer.convert_tokens_to_ids(cls.marker) if cls.marker in special or cls.marker in added else None
    return cls(marker_id, cls.marker in special)


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
