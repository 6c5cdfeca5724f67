"""Streamed text that may be the beginning of a marker (a tag, a stop string) is held back
until the next piece shows whether it is."""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (and is shorter than it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
