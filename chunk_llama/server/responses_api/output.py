"""A response's output items, built from one sample's text as it is read (`SampleReader`
events), with the stream's events where the request streams: the same builder makes the
streamed and the whole response, so they hold the same items.

Items come in the order the text has them: a `reasoning` item (its text as one
`reasoning_text` part), `message` items (one `output_text` part each) and `function_call`
items. The events of an item: `response.output_item.added`, for text a
`response.content_part.added`, its deltas (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta`), their `.done`,
`response.content_part.done`, `response.output_item.done`. A call that the end of the output
cut off (max_output_tokens) is announced in a stream but left out of the response's output.
"""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Output items from `SampleReader` events (module doc); `emit(event)` (None: no stream)
    receives each stream event, without its `sequence_number` (the stream numbers them)."""

    def __init__(self, emit=None):
        self.emit = emit
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.text = ""  # the open item's text (or arguments)
        self.call_items: dict[int, dict] = {}  # the reader's call index -> its item

    def feed(self, events: list[tuple]) -> None:
        for event in events:
            kind = event[0]
            if kind == "call":
                delta = event[2]
                if "id" in delta:
                    self._start("function_call", call=delta)
                    self.call_items[event[1]] = self.open
                piece = delta["function"].get("arguments") or ""
                if piece:
                    self.text += piece
                    self._send("response.function_call_arguments.delta", delta=piece)
            else:
                wanted = "reasoning" if kind == "reasoning" else "message"
                if self.open is None or self.open["type"] != wanted:
                    self._start(wanted)
                self.text += event[1]
                name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                self._send(name, content_index=0, delta=event[1], **({} if kind == "reasoning" else {"logprobs": []}))

    def finish(self, incomplete: bool, calls: list[dict]) -> list[dict]:
        """Close the open item and return the output (`calls`: the reader's, to leave out the cut-off ones);
        an output with no item is one empty message, as OpenAI's."""
        if not self.items:
            self._start("message")
        self._close("incomplete" if incomplete else "completed")
        cut = {id(self.call_items[i]) for i, call in enumerate(calls) if not call["complete"] and i in self.call_items}
        return [item for item in self.items if id(item) not in cut]

    def _start(self, kind: str, call: dict | None = None) -> None:
        self._close("completed")
        if kind == "function_call":
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": ""}
        elif kind == "reasoning":
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
        else:
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
        self.items.append(item)
        self.open, self.text = item, ""
        self._send("response.output_item.added", item=dict(item))
        if kind != "function_call":
            self._send("response.content_part.added", content_index=0, part=self._part(""))

    def _part(self, text: str) -> dict:
        if self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _close(self, status: str) -> None:
        item = self.open
        if item is None:
            return
        item["status"] = status
        if item["type"] == "function_call":
            item["arguments"] = self.text
            self._send("response.function_call_arguments.done", arguments=self.text, name=item["name"])
        else:
            part = self._part(self.text)
            item["content"] = [part]
            if item["type"] == "reasoning":
                self._send("response.reasoning_text.done", content_index=0, text=self.text)
            else:
                self._send("response.output_text.done", content_index=0, text=self.text, logprobs=[])
            self._send("response.content_part.done", content_index=0, part=dict(part))
        self._send("response.output_item.done", item=dict(item))
        self.open, self.text = None, ""

    def _send(self, event_type: str, **fields) -> None:
        if self.emit is None:
            return
        index = len(self.items) - 1
        if event_type.startswith("response.output_item"):
            self.emit({"type": event_type, "output_index": index, **fields})
        else:
            self.emit({"type": event_type, "item_id": self.open["id"], "output_index": index, **fields})


def usage(input_tokens: int, cached_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict:
    """The Responses API's `usage`."""
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


class ResponseHead:
    """What a response says of its request (`body`: the validated Responses body)."""

    def __init__(self, body: dict, response_id: str | None = None):
        self.body = body
        self.id = response_id or new_id("resp")
        self.created_at = time.time()

    def response(self, status: str, output: list[dict] | None = None, usage_body: dict | None = None) -> dict:
        """The response object at `status` ("in_progress", "completed" or "incomplete")."""
        b = self.body
        text = b.get("text") or {}
        reasoning = b.get("reasoning")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": time.time() if status != "in_progress" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": b["model"], "output": output or [], "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")} if reasoning else None,
            "store": b.get("store", True), "temperature": b.get("temperature"),
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools", []), "top_p": b.get("top_p"),
            "truncation": b.get("truncation") or "disabled", "usage": usage_body, "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }


def assistant_message(output: list[dict]) -> dict:
    """The response's output as the chat assistant turn a client would send back (the store's)."""
    texts = [p["text"] for item in output if item["type"] == "message" for p in item["content"]]
    reasoning = [p["text"] for item in output if item["type"] == "reasoning" for p in item["content"]]
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message
