"""Token ids of a chat prompt that continues an earlier conversation, so that the
next turn finds the earlier turns' chunks in the prefix cache.

A client sends the whole conversation every turn: the earlier messages, the
assistant's reply as text, then a new message. Rendering it with the chat
template and tokenizing the text anew can give other ids than the engine used:
the reply re-tokenizes differently from the ids the model generated (a BPE merge
across a boundary, a segmentation the tokenizer would not choose), so the prefix
tree's match, which compares token ids, stops inside the reply.

`ConversationHistory` remembers, for the last `max_entries` chat prompts, the
rendered text and the ids used, and for finished requests their generated ids.
For messages whose last assistant message is the reply to a remembered prompt
(the messages before it render to that prompt's text, and the reply equals the
generated text), the prompt ids are

    earlier prompt ids + generated ids + ids of the rest of the rendering

when the rendering of the whole conversation starts with the earlier prompt's
text followed by the generated text (its special tokens, e.g. an end-of-turn
token, included; a trailing EOS is dropped when the template writes another end
marker). Otherwise, such as a template that renders earlier turns differently
once a reply follows (Qwen3 drops the <think> block of earlier replies), the
prompt is the plain rendering, and the reason is logged once (WARNING).

What the model sees: these ids decode to exactly the text stock rendering gives
(`apply_chat_template`), and they equal its tokenization wherever the reply
re-tokenizes to the ids the model generated (the usual case). Where it does not,
the engine keeps the generated ids, the ids the model actually produced and
attended to when it wrote the reply; stock `generate` on
`RequestOutput.prompt_token_ids` gives the same tokens as the engine.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict

from chunk_llama.logs import log_once

logger = logging.getLogger(__name__)


class ConversationHistory:
    """Chat prompts' texts and ids and finished requests' generated ids, least recently used dropped first.

    Thread-safe. Tokenizer calls are made under `tokenizer_lock` (fast tokenizers
    are not safe to call from several threads at once)."""

    def __init__(self, tokenizer, tokenizer_lock: threading.Lock, max_entries: int = 64):
        if not isinstance(max_entries, int) or max_entries <= 0:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        self.tokenizer = tokenizer
        self.tokenizer_lock = tokenizer_lock
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._ids_of_text: OrderedDict[str, list[int]] = OrderedDict()
        self._replies: OrderedDict[tuple[int, ...], list[list[int]]] = OrderedDict()
        self.num_continued = 0  # prompts built from an earlier turn's ids

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None,
                   chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                   continue_final_message: bool = False) -> list[int]:
        """The token ids of `messages` with the generation prompt (see the module docstring);
        `tools` and `chat_template_kwargs` go to the chat template (its `tools` variable and
        its own ones, e.g. `enable_thinking`); `continue_final_message`: the last message (the
        assistant's) stays open, to be continued, instead of a generation prompt."""
        options = dict(chat_template_kwargs or {}, tools=tools)

        def render(m, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message):
            return self._render(m, add_generation_prompt=add_generation_prompt,
                                continue_final_message=continue_final_message, **options)

        with self.tokenizer_lock:
            text = render(messages)
        # an earlier turn was rendered with a generation prompt, whatever this one asks
        ids = self._continue(messages, text, functools.partial(render, add_generation_prompt=True,
                                                               continue_final_message=False))
        if ids is None:
            with self.tokenizer_lock:
                ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        with self._lock:
            self._put(self._ids_of_text, text, ids)
        return ids

    def record(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A chat request's sample finished with `output_ids` (abort excluded by the caller)."""
        key = tuple(prompt_ids)
        with self._lock:
            outputs = self._replies.get(key, [])
            if list(output_ids) not in outputs:
                outputs.append(list(output_ids))
            self._put(self._replies, key, outputs[-8:])  # n samples: the last few

    def _put(self, table: OrderedDict, key, value) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.max_entries:
            table.popitem(last=False)

    def _render(self, messages: list[dict], **options) -> str:
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, **options)

    def _continue(self, messages: list[dict], text: str, render_earlier) -> list[int] | None:
        """Earlier ids + generated ids + the rest, or None for the plain rendering
        (`render_earlier`: the earlier messages to the earlier prompt's text)."""
        last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
        if not last or not isinstance(messages[last].get("content"), str):
            return None
        with self.tokenizer_lock:
            try:
                earlier_text = render_earlier(messages[:last])
            except Exception:  # a template that refuses a conversation ending before an assistant turn
                return None
        with self._lock:
            earlier_ids = self._ids_of_text.get(earlier_text)
            outputs = self._replies.get(tuple(earlier_ids)) if earlier_ids is not None else None
        if not outputs:
            return None  # no remembered turn: a new conversation, or one from elsewhere
        reply = messages[last]["content"]
        special = set(getattr(self.tokenizer, "all_special_ids", []))
        with self.tokenizer_lock:
            generated = [out for out in outputs
                         if self.tokenizer.decode(out, skip_special_tokens=True) == reply]
        if not generated:
            return None  # the client edited the reply (or a stop string cut it): plain rendering
        if not text.startswith(earlier_text):
            _rendered_anew("the chat template renders the earlier turns differently once a reply follows "
                           "(e.g. it drops reasoning from earlier replies)")
            return None
        tail = text[len(earlier_text):]
        out = generated[0]
        # a final EOS that the template writes as another end marker: match without it
        candidates = [out] + ([out[:-1]] if out and out[-1] in special else [])
        with self.tokenizer_lock:
            for ids in candidates:
                reply_text = self.tokenizer.decode(ids, skip_special_tokens=False)
                if tail.startswith(reply_text):
                    rest = tail[len(reply_text):]
                    rest_ids = self.tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
                    with self._lock:
                        self.num_continued += 1
                    return list(earlier_ids) + list(ids) + list(rest_ids)
        _rendered_anew("the chat template does not render the assistant's reply as the generated text "
                       "(it changes the reply's text or its end-of-turn marker)")
        return None


def _rendered_anew(reason: str) -> None:
    log_once(logger, "multi-turn prompt rendered anew, earlier turns' ids not reused: %s", reason)
