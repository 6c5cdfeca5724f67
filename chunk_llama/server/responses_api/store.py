"""The Responses API's store: responses created with `store` (OpenAI's default: true) kept
in memory for `previous_response_id` and `GET /v1/responses/{id}`, at most `max_entries`
of them, the least recently used dropped first (`--max-stored-responses`; 0 keeps none).

An entry keeps the response body and its conversation as chat messages (the earlier turns,
this input, and this output as one assistant turn, with the reasoning and calls as a chat
client would send them back), so a next turn renders the prompt a multi-turn chat renders
and finds the earlier turns' chunks in the prefix cache (`engine/conversation.py`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    body: dict  # the response as returned
    messages: list[dict]  # the conversation through this response's output, without its instructions


class ResponseStore:
    """Thread-safe, bounded (module doc)."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.max_entries <= 0:
            return
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)
