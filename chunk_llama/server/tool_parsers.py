"""Tool calls read out of one sample's text as it arrives (`feed`), whole or streamed, in
OpenAI's stream form: events `("content", text)` and `("call", index, delta)`, where a
call's first delta has its index, id, type and name and the next ones pieces of its
arguments (the JSON text of the arguments as generated).

`HermesParser`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks anywhere in
the text (Qwen, Hermes, SmolLM3); the arguments stream as they are generated.
`JsonCallsParser`: JSON call objects after a marker: Llama 3.x's (`<|python_tag|>` or a
`{` at the very start of the output, `{"name": ..., "parameters": ...}` objects separated by
`;`) and Mistral's (`[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`); a call is
sent whole once its object is complete.

A call the output's end cuts off (max_tokens) is never content: its markup is dropped. A
streamed call already announced stays in `calls` marked incomplete (a stream cannot take it
back); a whole response leaves it out (`complete_calls`).
"""

from __future__ import annotations

import json
import re

from chunk_llama.server.holdback import partial_suffix


class _Calls:
    """The calls read so far, as sent: {"id", "name", "arguments", "complete"}."""

    def __init__(self, new_id):
        self.new_id = new_id
        self.calls: list[dict] = []

    def announce(self, name: str, arguments: str, complete: bool) -> tuple:
        call = {"id": self.new_id(), "name": name, "arguments": arguments, "complete": complete}
        self.calls.append(call)
        index = len(self.calls) - 1
        return ("call", index, {"index": index, "id": call["id"], "type": "function",
                                "function": {"name": name, "arguments": arguments}})

    def extend(self, piece: str) -> tuple:
        self.calls[-1]["arguments"] += piece
        index = len(self.calls) - 1
        return ("call", index, {"index": index, "function": {"arguments": piece}})

    def complete_calls(self) -> list[dict]:
        """The calls that were written to their end."""
        return [c for c in self.calls if c["complete"]]


class HermesParser(_Calls):
    """`<tool_call>` blocks (module doc). A block whose text is not a call is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

    def __init__(self, new_id):
        super().__init__(new_id)
        self.buffer = ""  # text not yet classified
        self.in_call = False
        self.head_sent = False
        self.args_scanned = 0  # how far the arguments value has been scanned (and sent)
        self.depth, self.in_string, self.escape, self.args_done = 0, False, False, False

    def feed(self, text: str | None, finished: bool) -> list[tuple]:
        """New text of the sample -> events."""
        self.buffer += text or ""
        events = []
        while True:
            if not self.in_call:
                start = self.buffer.find(self.OPEN)
                if start < 0:
                    keep = 0 if finished else partial_suffix(self.buffer, self.OPEN)
                    ready, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                    if ready:
                        events.append(("content", ready))
                    return events
                if start:
                    events.append(("content", self.buffer[:start]))
                self.buffer = self.buffer[start + len(self.OPEN):]
                self.in_call, self.head_sent, self.args_done = True, False, False
                continue
            end = self.buffer.find(self.CLOSE)
            body = self.buffer if end < 0 else self.buffer[:end]
            events += self._stream_call(body)
            if end < 0 and not finished:
                return events
            self.buffer = "" if end < 0 else self.buffer[end + len(self.CLOSE):]
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
            self.args_scanned = head.end()
            self.depth, self.in_string, self.escape = 0, False, False
            events.append(self.announce(json.loads(head.group(1)), "", False))
        piece = self._scan(body)
        if piece:
            events.append(self.extend(piece))
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
        """A block ended (or the text did): a call when its JSON parses; a closed block that is
        not a call is content; an unclosed one that is not complete was cut off: dropped."""
        parsed = _call_object(body)
        if parsed is None:
            if not closed:
                return []  # cut off by the end of the output: never content
            if self.head_sent:  # announced as a call but not one after all: drop the announcement
                self.calls.pop()
            return [("content", self.OPEN + body + self.CLOSE)]
        name, arguments = parsed
        if not self.head_sent:
            return [self.announce(name, arguments, True)]
        self.calls[-1]["complete"] = True
        if self.args_done:
            return []  # streamed whole
        # arguments not scanned to their end: send the rest of the value
        sent = self.calls[-1]["arguments"]
        rest = arguments[len(sent):] if arguments.startswith(sent) else arguments
        return [self.extend(rest)] if rest else []


class JsonCallsParser(_Calls):
    """JSON call objects after a marker (module doc). `markers`: what opens the calls;
    `at_start`: only at the very beginning of the output (Llama), else anywhere (Mistral);
    `keys`: the arguments' key names accepted."""

    _SEPARATORS = " \t\r\n;,[]"

    def __init__(self, new_id, markers: tuple[str, ...], at_start: bool, keys=("arguments", "parameters")):
        super().__init__(new_id)
        self.markers, self.at_start, self.keys = markers, at_start, keys
        self.buffer = ""
        self.state = "start" if at_start else "content"  # start | content | calls | text (no calls: all content)
        self.skipped = ""  # what the calls' start consumed (whitespace, a marker): content if no call follows

    def feed(self, text: str | None, finished: bool) -> list[tuple]:
        """New text of the sample -> events."""
        self.buffer += text or ""
        if self.state == "start":
            head = self.buffer.lstrip()
            marker = next((m for m in self.markers if head.startswith(m)), None)
            if marker is not None:
                skip = len(self.buffer) - len(head) + (0 if marker == "{" else len(marker))  # "{" begins the JSON
                self.skipped, self.buffer, self.state = self.buffer[:skip], self.buffer[skip:], "calls"
            elif not finished and any(m.startswith(head) for m in self.markers):
                return []
            else:
                self.state = "text"
        if self.state == "content":
            found = [(self.buffer.find(m), m) for m in self.markers if m in self.buffer]
            if not found:
                keep = 0 if finished else max(partial_suffix(self.buffer, m) for m in self.markers)
                ready, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return [("content", ready)] if ready else []
            start, marker = min(found)
            events = [("content", self.buffer[:start])] if start else []
            self.skipped, self.buffer, self.state = marker, self.buffer[start + len(marker):], "calls"
            return events + self._calls(finished)
        if self.state == "calls":
            return self._calls(finished)
        out, self.buffer = self.buffer, ""
        return [("content", out)] if out else []

    def _calls(self, finished: bool) -> list[tuple]:
        events = []
        decoder = json.JSONDecoder()
        while True:
            i = 0
            while i < len(self.buffer) and self.buffer[i] in self._SEPARATORS:
                i += 1
            rest = self.buffer[i:]
            if not rest:
                self.buffer = "" if finished else self.buffer
                return events
            if not rest.startswith("{"):  # not a call: the rest is content
                return events + self._not_calls(rest if self.calls else self.skipped + self.buffer)
            try:
                value, end = decoder.raw_decode(rest)
            except json.JSONDecodeError:
                if finished:  # cut off by the end of the output: never content
                    self.buffer = ""
                return events
            parsed = _call_object(rest[:end], self.keys) if isinstance(value, dict) else None
            if parsed is None:  # a JSON object that is not a call: the rest is content
                return events + self._not_calls(rest if self.calls else self.skipped + self.buffer)
            events.append(self.announce(*parsed, True))
            self.buffer = rest[end:]

    def _not_calls(self, text: str) -> list[tuple]:
        """What follows is not a call: all of it is content (with what the start consumed, before any call)."""
        self.buffer, self.state = "", "text"
        return [("content", text)]


def _call_object(text: str, keys=("arguments",)) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object's text, or None if it is not one. Arguments
    given as a JSON string (some models write them so) are taken as that string's text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in keys if k in value), None)
    if key is None:
        return None
    arguments = value[key]
    if isinstance(arguments, str):
        return value["name"], arguments
    raw = _raw_value(text, key)
    return value["name"], raw if raw is not None and json.loads(raw) == arguments else json.dumps(arguments)


def _raw_value(text: str, key: str) -> str | None:
    """The text of `key`'s value in the JSON object `text`, as written (the arguments as the
    model generated them, which a stream sends piece by piece)."""
    match = re.search(r'"' + re.escape(key) + r'"\s*:\s*', text)
    if match is None:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(text, match.end())
    except json.JSONDecodeError:
        return None
    return text[match.end():end]
