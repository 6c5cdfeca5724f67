"""`choices[i].logprobs` of chat and (legacy) text completions, built from each token's bytes.

A token is bytes, not text: byte-level BPE splits a character such as 🎉 (four UTF-8 bytes)
over several tokens, and SentencePiece writes unknown characters as byte tokens `<0xF0>`.
Decoding one such token alone gives "�", which loses the bytes and makes distinct tokens
look the same. So each token's bytes come from the tokenizer as llguidance reads it (the
engine's `GrammarCompiler`, which needs every token's bytes for grammars anyway: byte-level
BPE through its byte decoder, `<0xNN>` as that byte, "▁" as a space), and:

- `bytes` is exactly those bytes: consecutive tokens' bytes join into the text (OpenAI's
  definition of the field);
- `token` is their text when they are whole UTF-8, else `bytes:` and every byte escaped
  (`bytes:\\xf0\\x9f`), as OpenAI's legacy completions write such tokens: distinct tokens
  keep distinct strings, so completions' `top_logprobs` (a dict keyed by token) keeps one
  entry per token;
- completions' `text_offset` counts characters of the returned text: a token that ends
  inside a character does not move it, the token that completes it does.

A tokenizer llguidance cannot read falls back to decoding each token alone.
"""

from __future__ import annotations

import asyncio
import codecs

import torch


def token_string(raw: bytes) -> str:
    """A token's `token`: its text, or `bytes:\\xNN...` when it is not whole UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _rows(output, top: int, token_bytes):
    """Per generated token: (bytes, logprob, [(alt bytes, alt logprob)] of the `top` most likely)."""
    logprobs = torch.log_softmax(output.logits.float(), dim=-1)
    rows = []
    for step, token in enumerate(output.token_ids):
        alternatives = []
        if top:
            values, ids = logprobs[step].topk(top)
            alternatives = [(token_bytes(i), v) for i, v in zip(ids.tolist(), values.tolist())]
        rows.append((token_bytes(token), float(logprobs[step, token]), alternatives))
    return rows


def chat_logprobs(output, top: int, token_bytes) -> dict:
    """`choices[i].logprobs` of a chat completion."""

    def entry(raw: bytes, value: float) -> dict:
        return {"token": token_string(raw), "logprob": value, "bytes": list(raw)}

    content = []
    for raw, value, alternatives in _rows(output, top, token_bytes):
        item = entry(raw, value)
        item["top_logprobs"] = [entry(r, v) for r, v in alternatives]
        content.append(item)
    return {"content": content}


def completion_logprobs(output, top: int, token_bytes) -> dict:
    """`choices[i].logprobs` of a (legacy) completion."""
    rows = _rows(output, top, token_bytes)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, offset = [], 0
    for raw, _, _ in rows:
        offsets.append(offset)
        offset += len(decoder.decode(raw))  # the characters this token completes
    tops = None
    if top:
        tops = []
        for _, _, alternatives in rows:
            entries: dict[str, float] = {}
            for raw, value in alternatives:  # most likely first: a same-bytes token cannot replace it
                entries.setdefault(token_string(raw), value)
            tops.append(entries)
    return {
        "tokens": [token_string(raw) for raw, _, _ in rows],
        "token_logprobs": [value for _, value, _ in rows],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


async def build_logprobs(engine, output, top: int, *, chat: bool) -> dict:
    """`choices[i].logprobs` of `output` (in a worker thread: the softmax over the vocabulary
    and, on first use, reading the tokenizer's bytes are not for the event loop)."""
    build = chat_logprobs if chat else completion_logprobs

    def work():
        with engine.inputs.tokenizer_lock:
            return build(output, top, _token_bytes(engine))

    return await asyncio.to_thread(work)


def _token_bytes(engine):
    """A function from a token id to its bytes (see the module doc); call with the tokenizer lock."""
    try:
        llg = engine.inputs.grammars.prepare()
    except ValueError:  # a tokenizer llguidance cannot read
        tokenizer = engine.tokenizer
        return lambda token: tokenizer.decode([token], skip_special_tokens=False).encode("utf-8")
    return lambda token: llg.decode_bytes([token])
