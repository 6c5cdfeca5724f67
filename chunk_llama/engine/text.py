"""Incremental detokenization (`tokenizers`' `DecodeStream`) and stop strings.

Each sample with tracked text owns a `DecodeStream`, which decodes one token at a
time in constant work and holds back bytes of a UTF-8 character split across
tokens. When the sample finishes, the rest of `tokenizer.decode(output_ids)` is
flushed, so the deltas add up to the output text. A tokenizer without a
`tokenizers` backend decodes the whole output each time instead (logged once).

Special tokens are left out of the text unless the request asks for them
(`skip_special_tokens=False`: a tool-call or reasoning marker that is a special token);
even then the end-of-sequence token that ended the sample is not text (it is in
`token_ids`), as in vLLM.
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from chunk_llama.engine.request import Sequence
from chunk_llama.logs import log_once

logger = logging.getLogger(__name__)


def decode(tokenizer, token_ids: list[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def text_ids(seq: Sequence, token_ids: list[int]) -> list[int]:
    """The ids of `token_ids` (the sample's) that are text: all of them, less the end-of-sequence
    ids where special tokens are kept (those are never text)."""
    if seq.skip_special_tokens or not seq.eos_token_ids:
        return token_ids
    return [t for t in token_ids if t not in seq.eos_token_ids]


def output_text(seq: Sequence, tokenizer) -> str:
    """The whole output's text, as the request asked it decoded."""
    return decode(tokenizer, text_ids(seq, seq.output_ids), seq.skip_special_tokens)


def advance_text(seq: Sequence, tokenizer, flush: bool = False) -> str:
    """Append the text of the tokens added since the last call; returns the new text.

    flush: the sample finished: also append what the stream held back.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    new_ids = text_ids(seq, seq.output_ids[seq.num_decoded :])
    seq.num_decoded = len(seq.output_ids)
    if backend is None:
        log_once(logger, f"{type(tokenizer).__name__} has no `tokenizers` backend: streamed text "
                   "re-decodes the whole output every step")
        full = output_text(seq, tokenizer)
        delta = full[len(seq.text) :] if full.startswith(seq.text) and not full.endswith("\ufffd") else ""
    else:
        if seq.decoder is None:
            seq.decoder = DecodeStream(skip_special_tokens=seq.skip_special_tokens)
        pieces = [seq.decoder.step(backend, token) for token in new_ids]
        delta = "".join(piece for piece in pieces if piece)
    if flush:
        full = output_text(seq, tokenizer)
        so_far = seq.text + delta
        if full.startswith(so_far):
            delta += full[len(so_far) :]
        elif full != so_far:
            log_once(logger, f"{type(tokenizer).__name__}.decode differs from its streamed text "
                       "(e.g. clean_up_tokenization_spaces): outputs keep decode()'s text")
    seq.text += delta
    return delta


def hit_stop_string(seq: Sequence, delta: str) -> bool:
    """Whether a stop string ends inside `delta` (the text just appended)."""
    if not delta:
        return False
    longest = max(len(s) for s in seq.stop_strings)
    tail = seq.text[-(len(delta) + longest - 1) :]
    return any(stop in tail for stop in seq.stop_strings)
