"""OpenAI response bodies: completions, stream chunks, usage, and the cut at a stop
string (logprobs: `logprobs.py`).

The engine stops a sample as soon as a stop string appears in its text, but its
text may run past it (a token can hold the stop string and more). OpenAI's text
ends before the stop string: `cut_at_stop` cuts a whole text, and `StopCutter`
does it for a stream, holding back the last `len(longest stop) - 1` characters
until they cannot begin a stop string.
"""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    """A response id such as `chatcmpl-...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """`created`: seconds since the epoch."""
    return int(time.time())


def cut_at_stop(text: str, stops: list[str], keep_stop: bool = False) -> str:
    """`text` up to (without; with `keep_stop`, with) the first stop string in it."""
    end = _stop_end(text, stops, keep_stop)
    return text if end is None else text[:end]


def _stop_end(text: str, stops: list[str], keep_stop: bool) -> int | None:
    """Where `text` ends at its first stop string (None: it holds none)."""
    positions = [(i, i + len(s) if keep_stop else i) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
    return min(positions)[1] if positions else None


class StopCutter:
    """A sample's streamed text with OpenAI's stop-string semantics (see module doc);
    `keep_stop`: the text keeps the stop string (vLLM's `include_stop_str_in_output`)."""

    def __init__(self, stops: list[str], keep_stop: bool = False):
        self.stops = stops
        self.keep_stop = keep_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.buffer = ""
        self.done = False

    def feed(self, text: str | None, finished: bool) -> str:
        """The text that can be sent now, given the new `text`."""
        if self.done:
            return ""
        self.buffer += text or ""
        if self.stops:
            end = _stop_end(self.buffer, self.stops, self.keep_stop)
            if end is not None:
                out, self.done, self.buffer = self.buffer[:end], True, ""
                return out
        if finished:
            out, self.buffer = self.buffer, ""
            return out
        ready = max(0, len(self.buffer) - self.hold)
        out, self.buffer = self.buffer[:ready], self.buffer[ready:]
        return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """The `usage` object, with `prompt_tokens_details.cached_tokens`."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_choice(index: int, read: tuple, reason: str | None, logprobs: dict | None) -> dict:
    """One choice of a chat completion from its text as read (`SampleReader.read_whole`:
    content, reasoning, tool calls); a reply that called tools and stopped by itself finishes
    with `tool_calls`."""
    content, reasoning, calls = read
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        reason = tool_finish_reason(reason, True)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for a reply that called tools and ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason


def completion_choice(index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
    """One choice of a completion."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def chat_chunk(
    response_id: str, created: int, model: str, index: int, delta: dict, reason: str | None = None
) -> dict:
    """One `chat.completion.chunk` with one choice."""
    return {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}],
    }


def completion_chunk(
    response_id: str, created: int, model: str, index: int, text: str, reason: str | None = None
) -> dict:
    """One streamed `text_completion` with one choice."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}],
    }


def usage_chunk(response_id: str, created: int, model: str, object_name: str, usage_body: dict) -> dict:
    """The last chunk of a stream with `stream_options.include_usage`: no choices, the usage."""
    return {
        "id": response_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_body,
    }
