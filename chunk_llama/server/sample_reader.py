"""One sample's text read as OpenAI's parts, whole or as it streams: the cut at a stop
string (`responses.StopCutter`), the reasoning apart from the answer (`reasoning.py`), and
the tool calls out of the answer (`tool_parsers.py`). A whole response feeds the whole text
at once, so whole and streamed answers are the same parts.

Events: `("reasoning", text)`, `("content", text)`, `("call", index, delta)` (OpenAI's
stream form of a tool call: `tool_parsers.py`).

Two rules make a stream and a whole response report the same calls and text:
- whitespace after a call is the format's separator (a forced grammar writes "\n" between
  calls), not text: it is held back, and sent only if text other than whitespace follows;
- with stop strings, a call's deltas are held back until the call is complete: a stop string
  may cut it anywhere before its end, and a cut call is no call (the whole response leaves it
  out), so a streamed call is always one that parses. Without stop strings only the end of
  the output (max_tokens) can cut a call, and the stream reports that with `length`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chunk_llama.server.reasoning import ReasoningFormat, ReasoningSplitter
from chunk_llama.server.responses import StopCutter


@dataclass
class ReadSettings:
    """How one request's samples are read: its stop strings (`keep_stop`: the text keeps the one
    that ended it), its reasoning format and whether the prompt opened the reasoning, and its
    tool-call format (None: calls are not read)."""

    stops: list[str] = field(default_factory=list)
    keep_stop: bool = False
    reasoning: ReasoningFormat | None = None
    reasoning_opened: bool = False
    tool_format: object = None

    def reader(self) -> SampleReader:
        """A fresh reader of one sample."""
        return SampleReader(self)


class SampleReader:
    """One sample's text -> events (module doc); totals in `content`, `reasoning`, `calls`."""

    def __init__(self, settings: ReadSettings):
        self.cutter = StopCutter(settings.stops, keep_stop=settings.keep_stop)
        self.splitter = (ReasoningSplitter(settings.reasoning, settings.reasoning_opened)
                         if settings.reasoning is not None else None)
        self.parser = settings.tool_format.parser() if settings.tool_format is not None else None
        self.content = ""
        self.num_reasoning_tokens = 0
        self.hold_calls = bool(settings.stops)
        self.held: list[tuple] = []  # the deltas of a call not yet complete (`hold_calls`)
        self.space = ""  # whitespace right after a call, held back
        self.after_call = False  # a call was sent and no text since
        self.held_id = None  # the id of the call whose deltas are held (or last were)

    @property
    def reasoning(self) -> str:
        return self.splitter.reasoning if self.splitter is not None else ""

    @property
    def calls(self) -> list[dict]:
        """Every call the parser announced so far ({"id", "name", "arguments", "complete"})."""
        return self.parser.calls if self.parser is not None else []

    def complete_calls(self) -> list[dict]:
        """The calls written to their end (a whole response's `tool_calls`)."""
        return self.parser.complete_calls() if self.parser is not None else []

    def feed(self, text: str | None, finished: bool, num_tokens: int = 0) -> list[tuple]:
        """The events of the sample's new `text` (its `num_tokens` tokens, counted as reasoning
        tokens when they arrive inside the reasoning)."""
        cut = self.cutter.feed(text, finished)
        pieces = self.splitter.feed(cut, finished) if self.splitter is not None else [("content", cut)]
        if self.splitter is not None and (self.splitter.in_reasoning or any(k == "reasoning" for k, _ in pieces)):
            self.num_reasoning_tokens += num_tokens
        events = []
        for kind, piece in pieces:
            if kind == "reasoning" or self.parser is None:
                if piece:
                    events.append((kind, piece))
            else:
                events += self._calls_and_text(self.parser.feed(piece, False))
        if finished and self.parser is not None:
            events += self._calls_and_text(self.parser.feed("", True))
            self.held = []  # never completed: cut off
        self.content += "".join(e[1] for e in events if e[0] == "content")
        return events

    def read_whole(self, text: str | None) -> tuple[str | None, str | None, list[dict]]:
        """A whole output -> (content, reasoning, complete calls); content None when the output is
        only calls, reasoning None when there is none."""
        self.feed(text, True)
        calls = self.complete_calls()
        content = None if calls and not self.content.strip() else self.content
        return content, self.reasoning or None, calls

    def _calls_and_text(self, events: list[tuple]) -> list[tuple]:
        """The parser's events as sent (module doc: whitespace after calls, held calls)."""
        out = []
        for event in events:
            out += self._release()
            if event[0] == "call":
                self.space = ""
                if "id" in event[2]:  # (a call's first delta)
                    self.held_id = event[2]["id"]
                self.held.append(event)
                if not self.hold_calls:
                    out += self._release(complete=True)
            elif self.after_call and not event[1].strip():
                self.space += event[1]
            else:
                if self.space:
                    event, self.space = ("content", self.space + event[1]), ""
                self.after_call = False
                self.held = []  # an announced call that turned out text (tool_parsers.HermesParser)
                out.append(event)
        return out + self._release()

    def _release(self, complete: bool = False) -> list[tuple]:
        """The held deltas, once their call is `complete` (or now, with `complete`). The call is
        known by its id: a block the parser dropped (not a call after all) leaves its index to the
        next call, whose completion must not release the dropped one's deltas."""
        if not self.held:
            return []
        if not complete:
            index, calls = self.held[0][1], self.parser.calls
            if not (index < len(calls) and calls[index]["id"] == self.held_id and calls[index]["complete"]):
                return []
        out, self.held, self.after_call = self.held, [], True
        return out
