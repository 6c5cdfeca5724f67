"""Tool calling: the tools in the prompt, the grammar of a forced call, and the calls read
back out of the generated text (whole or streamed).

Format: Hermes-style blocks, which Qwen 2.5/3, Hermes and SmolLM3 templates use,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that knows this format (it reads `tools` and writes `<tool_call>`)
renders the tools and the earlier calls and results itself (`apply_chat_template(tools=...)`).
Any other template (none for tools, or another syntax such as Llama 3.1's) gets the
fallback: the tools described in the system message (`FALLBACK_INSTRUCTIONS`), earlier
calls written into the assistant's text as blocks in compact JSON (what a forced call
generates, so a conversation's next turn matches the generated ids and reuses its
chunks), and tool results as user turns in `<tool_response>` tags.

`tool_choice`: `none` (tools in the prompt, text not parsed), `auto` (the default with
tools: the model may call; blocks that parse become `tool_calls`), `required` (the output
is one or more calls under a grammar of the tools' schemas; one with
`parallel_tool_calls: false`), or a named function (one call of it under its schema).
"""

from __future__ import annotations

import json
import re
import uuid

from chunk_llama.engine.grammar import JSON_OPTIONS, Grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FALLBACK_INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query. The functions are described "
    "in JSON within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, reply "
    "with a JSON object holding its name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_writes_tool_calls(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders `tools` and Hermes-style `<tool_call>` blocks."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template and OPEN in template


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_text(name: str, arguments: str) -> str:
    """A call as a block in compact JSON (what the grammar of a forced call generates)."""
    return f'{OPEN}\n{{"name":{json.dumps(name)},"arguments":{arguments}}}\n{CLOSE}'


def chat_prompt(messages: list, tools: list | None, native: bool):
    """The engine's prompt for `messages` (pydantic `ChatMessage`s) and `tools` (pydantic
    `Tool`s): a message list, or `{"messages", "tools"}` for a template that renders tools."""
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
            calls = "\n".join(call_text(c.function.name, c.function.arguments) for c in m.tool_calls or [])
            item = {"role": role, "content": text + calls}
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    if not tools:
        return out
    specs = [t.model_dump(exclude_none=True) for t in tools]
    if native:
        return {"messages": out, "tools": specs}
    described = FALLBACK_INSTRUCTIONS.format(tools="\n".join(json.dumps(s) for s in specs))
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + described}
    else:
        out.insert(0, {"role": "system", "content": described})
    return out


def _arguments(text: str):
    """An earlier call's arguments as the dict a template's `tojson` expects."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        from chunk_llama.server.errors import OpenAIError

        raise OpenAIError(f"a tool call's arguments are not valid JSON: {error}", param="messages") from error


def call_grammar(tools: list, only: str | None, parallel: bool) -> Grammar:
    """One call (of `only`, if given; else of any tool), or several with `parallel`, each a
    block whose JSON names the function and gives arguments valid under its parameters' schema."""
    bodies = []
    for tool in tools:
        function = tool.function
        if only is not None and function.name != only:
            continue
        bodies.append({"type": "object", "properties": {"name": {"const": function.name},
                                                        "arguments": function.parameters or {"type": "object"}},
                       "required": ["name", "arguments"], "additionalProperties": False})
    schema = {**(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}), "x-guidance": JSON_OPTIONS}
    repeat = ' ("\\n" call)*' if parallel and only is None else ""
    return Grammar.lark(f'start: call{repeat}\ncall: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n'
                        f"body: %json {json.dumps(schema)}\n")


class ToolCallParser:
    """Splits one sample's text into content and tool calls as it arrives (`feed`), in
    OpenAI's stream form: a call's first delta has its index, id, type and name, the next
    ones pieces of its arguments (the JSON text of the `arguments` value as generated)."""

    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

    def __init__(self):
        self.buffer = ""  # text not yet classified
        self.in_call = False
        self.calls: list[dict] = []  # {"id", "name", "arguments"} as sent so far
        self.head_sent = False
        self.args_start = 0  # in `buffer` (inside a call) where the arguments value begins
        self.args_scanned = 0  # how far the arguments value has been scanned (and sent)
        self.depth, self.in_string, self.escape, self.args_done = 0, False, False, False

    def feed(self, text: str, finished: bool) -> list[tuple]:
        """New text of the sample -> events `("content", text)` and `("call", index, delta)`."""
        self.buffer += text or ""
        events = []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = 0 if finished else _partial_suffix(self.buffer, OPEN)
                    ready, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if ready:
                        events.append(("content", ready))
                    return events
                if start:
                    events.append(("content", self.buffer[:start]))
                self.buffer = self.buffer[start + len(OPEN):]
                self.in_call, self.head_sent, self.args_done = True, False, False
                continue
            end = self.buffer.find(CLOSE)
            events += self._stream_call(self.buffer if end < 0 else self.buffer[:end])
            if end < 0 and not finished:
                return events
            body = self.buffer if end < 0 else self.buffer[:end]
            self.buffer = "" if end < 0 else self.buffer[end + len(CLOSE):]
            self.in_call = False
            events += self._close_call(body, closed=end >= 0)
            if end < 0:
                return events

    def _stream_call(self, body: str) -> list[tuple]:
        """The name once it is complete, then the arguments as far as they are known."""
        events = []
        if not self.head_sent:
            head = self._HEAD.match(body)
            if head is None:
                return events
            self.head_sent = True
            self.calls.append({"id": new_call_id(), "name": json.loads(head.group(1)), "arguments": ""})
            self.args_start = self.args_scanned = head.end()
            self.depth, self.in_string, self.escape = 0, False, False
            call = self.calls[-1]
            events.append(("call", len(self.calls) - 1, {"index": len(self.calls) - 1, "id": call["id"],
                                                         "type": "function",
                                                         "function": {"name": call["name"], "arguments": ""}}))
        piece = self._scan(body)
        if piece:
            self.calls[-1]["arguments"] += piece
            events.append(("call", len(self.calls) - 1, {"index": len(self.calls) - 1,
                                                         "function": {"arguments": piece}}))
        return events

    def _scan(self, body: str) -> str:
        """The arguments text from where the last scan stopped to where the value ends (a JSON
        value: brackets counted outside strings)."""
        i = self.args_scanned
        if not self.calls[-1]["arguments"]:  # the value has not begun: whitespace before it is not part of it
            while i < len(body) and body[i].isspace():
                i += 1
        start = i
        while i < len(body) and not self.args_done:
            c = body[i]
            if self.in_string:  # a character after a backslash is literal
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
            i += 1
            self.args_done = self.depth == 0 and not self.in_string and c in '}]"'
        self.args_scanned = i
        return body[start:i]

    def _close_call(self, body: str, closed: bool) -> list[tuple]:
        """A block ended (or the text did): a call when its JSON parses, else its text is content."""
        try:
            parsed = json.loads(body)
            ok = isinstance(parsed, dict) and isinstance(parsed.get("name"), str) and "arguments" in parsed
        except json.JSONDecodeError:
            ok = False
        if not ok:
            if self.head_sent:  # announced as a call but not one after all: drop the announcement
                self.calls.pop()
            return [("content", OPEN + body + (CLOSE if closed else ""))]
        arguments = parsed["arguments"] if isinstance(parsed["arguments"], str) else None
        if self.head_sent and self.args_done:
            return []  # streamed whole
        if self.head_sent:  # arguments not scanned to their end: send the rest of the value
            rest = json.dumps(parsed["arguments"]) if arguments is None else arguments
            rest = rest[len(self.calls[-1]["arguments"]):] if rest.startswith(self.calls[-1]["arguments"]) else rest
            self.calls[-1]["arguments"] += rest
            return [("call", len(self.calls) - 1, {"index": len(self.calls) - 1, "function": {"arguments": rest}})]
        call = {"id": new_call_id(), "name": parsed["name"],
                "arguments": arguments if arguments is not None else json.dumps(parsed["arguments"])}
        self.calls.append(call)
        return [("call", len(self.calls) - 1, {"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                               "function": {"name": call["name"], "arguments": call["arguments"]}})]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may open a block)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """A whole output -> (content, [{"id", "type", "function": {"name", "arguments"}}]). Content
    is None when the output is only calls."""
    parser = ToolCallParser()
    content = "".join(e[1] for e in parser.feed(text, True) if e[0] == "content")
    calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
             for c in parser.calls]
    if calls and not content.strip():
        content = None
    return content, calls
