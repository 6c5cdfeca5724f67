"""One sample's text read as OpenAI's parts, whole or as it streams: the cut at a stop
string (`responses.StopCutter`), the reasoning apart from the answer (`reasoning.py`), and
the tool calls out of the answer (`tool_parsers.py`). A whole response feeds the whole text
at once, so whole and streamed answers are the same parts.

Events: `("reasoning", text)`, `("content", text)`, `("call", index, delta)` (OpenAI's
stream form of a tool call: `tool_parsers.py`).
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

    @property
    def reasoning(self) -> str:
        return self.splitter.reasoning if self.splitter is not None else ""

    @property
    def calls(self) -> list[dict]:
        """Every call announced so far ({"id", "name", "arguments", "complete"})."""
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
                events += self.parser.feed(piece, False)
        if finished and self.parser is not None:
            events += self.parser.feed("", True)
        self.content += "".join(e[1] for e in events if e[0] == "content")
        return events

    def read_whole(self, text: str | None) -> tuple[str | None, str | None, list[dict]]:
        """A whole output -> (content, reasoning, complete calls); content None when the output is
        only calls, reasoning None when there is none."""
        self.feed(text, True)
        calls = self.complete_calls()
        content = None if calls and not self.content.strip() else self.content
        return content, self.reasoning or None, calls
