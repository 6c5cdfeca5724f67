"""Incremental detokenization and stop strings.

Decoding the whole output after every token costs O(n^2); instead each step
decodes a short window: the tokens from `prefix_offset` (a few tokens of context,
so tokenizers that merge spaces into the next token render correctly) to the end,
and emits what extends past the text of the window's already-emitted part. A
trailing U+FFFD means a UTF-8 character is split across tokens: it is held back.
"""

from __future__ import annotations

from chunk_llama.engine.request import Sequence


def advance_text(seq: Sequence, tokenizer, flush: bool = False) -> str:
    """Append the text of the tokens added since the last call; returns the new text."""
    ids = seq.output_ids
    if seq.read_offset >= len(ids):
        return ""
    emitted = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    window = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=True)
    if not flush and (window.endswith("\ufffd") or len(window) <= len(emitted)):
        return ""
    delta = window[len(emitted) :] if window.startswith(emitted) else window
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.text += delta
    return delta


def hit_stop_string(seq: Sequence, delta: str) -> bool:
    """Whether a stop string ends inside `delta` (the text just appended)."""
    if not delta:
        return False
    longest = max(len(s) for s in seq.stop_strings)
    tail = seq.text[-(len(delta) + longest - 1) :]
    return any(stop in tail for stop in seq.stop_strings)
