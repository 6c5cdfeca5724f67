"""Reasoning output: the text a thinking model writes between its reasoning tags, apart from
its answer (`reasoning_content` in chat completions, reasoning items in the Responses API).

`--reasoning-parser` names the tags, with vLLM's names: `deepseek_r1`, `qwen3`, `glm45`
(`<think>` ... `</think>`) and `mistral` (`[THINK]` ... `[/THINK]`); `auto` (the default)
finds them in the chat template, `none` leaves all text in `content`.

Where the reasoning starts is read from the rendered prompt, not assumed: a template that
opens the reasoning itself (DeepSeek-R1's, Qwen3's thinking variants: the generation prompt
ends with `<think>`) puts the output inside it from its first token; one that closes it
(Qwen3's with `enable_thinking: false` writes an empty `<think></think>`) leaves all of it
to the answer; otherwise reasoning is only what the model opens itself with the start tag
at the very beginning of its output. So an answer without reasoning is never taken for it.
The reasoning ends at the end tag; text after it is the answer. A reasoning that the
output's end cuts off (max_tokens) stays reasoning, with no answer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from chunk_llama.errors import UsageError
from chunk_llama.logs import log_once
from chunk_llama.server.holdback import partial_suffix

logger = logging.getLogger(__name__)

REASONING_TAGS = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
    "mistral": ("[THINK]", "[/THINK]"),
}
PARSER_NAMES = ("auto", "none", *REASONING_TAGS)
_PROBE = [{"role": "user", "content": "hi"}]


@dataclass(frozen=True)
class ReasoningFormat:
    """The tags of one reasoning parser; `special`: a tag is a special token, so requests that
    split reasoning keep special tokens in their text."""

    name: str
    start: str
    end: str
    special: bool = False


def reasoning_format(name: str | None, tokenizer) -> ReasoningFormat | None:
    """The format `--reasoning-parser` names (`auto`: found in the chat template), or None."""
    name = name or "auto"
    if name not in PARSER_NAMES:
        raise UsageError(f"--reasoning-parser {name!r}: choose one of {', '.join(PARSER_NAMES)}")
    if name == "none":
        return None
    template = _template_text(tokenizer)
    if name == "auto":
        if "[THINK]" in template:
            name = "mistral"
        elif "<think>" in template:
            name = "qwen3"
        else:
            return None
    start, end = REASONING_TAGS[name]
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    return ReasoningFormat(name, start, end, start in special or end in special)


def _template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template or ""


class PromptProbe:
    """Where the chat template leaves the reasoning at the start of the output, per distinct
    `chat_template_kwargs` (rendered once each, on a probe turn, under the tokenizer's lock)."""

    def __init__(self, tokenizer, lock, fmt: ReasoningFormat, max_entries: int = 256):
        self.tokenizer, self.lock, self.fmt, self.max_entries = tokenizer, lock, fmt, max_entries
        self._known: dict[str, bool | None] = {}

    def opened(self, template_kwargs: dict) -> bool | None:
        """True: the generation prompt opens the reasoning (the output starts inside it); None:
        it closes it (nothing to read); False: neither (the model may open it)."""
        key = repr(sorted(template_kwargs.items()))
        if key not in self._known:
            if len(self._known) >= self.max_entries:
                self._known.clear()
            self._known[key] = self._probe(template_kwargs)
        return self._known[key]

    def _probe(self, template_kwargs: dict) -> bool | None:
        try:
            with self.lock:
                text = self.tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True,
                                                          **template_kwargs)
        except Exception as error:  # noqa: BLE001 - the request itself meets the template's error
            log_once(logger, "the chat template does not render a probe turn (%s): reasoning is read only "
                             "where the model opens it", error)
            return False
        tail = text.rstrip()
        if tail.endswith(self.fmt.end):
            return None
        return tail.endswith(self.fmt.start)


class ReasoningSplitter:
    """One sample's text as it arrives (`feed`), split into reasoning and answer pieces
    (module doc). Whitespace next to the tags belongs to neither."""

    def __init__(self, fmt: ReasoningFormat, opened: bool):
        self.fmt = fmt
        self.state = "reasoning" if opened else "start"  # start: the model may still open it
        self.buffer = ""
        self.strip_leading = opened  # whitespace after the start tag is not reasoning
        self.reasoning = ""  # all reasoning so far

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, text: str | None, finished: bool) -> list[tuple[str, str]]:
        """[("reasoning" | "content", text), ...] for the new `text`."""
        self.buffer += text or ""
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(self.fmt.start):
                self.buffer = head[len(self.fmt.start):]
                self.state, self.strip_leading = "reasoning", True
            elif self.fmt.start.startswith(head) and not finished:
                return out  # the tag may still come
            else:
                self.state = "content"
        if self.state == "reasoning":
            if self.strip_leading:
                self.buffer = self.buffer.lstrip()
                self.strip_leading = not self.buffer
            end = self.buffer.find(self.fmt.end)
            if end < 0:
                keep = 0 if finished else partial_suffix(self.buffer, self.fmt.end)
                ready = self.buffer[:len(self.buffer) - keep]
                body = ready.rstrip()  # trailing whitespace waits: it is reasoning only if more follows
                self._reason(out, body)
                self.buffer = "" if finished else self.buffer[len(body):]
                return out
            self._reason(out, self.buffer[:end].rstrip())
            self.buffer = self.buffer[end + len(self.fmt.end):]
            self.state = "answer"
        if self.state == "answer":  # whitespace after the end tag is not part of the answer
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return out
            self.state = "content"
        if self.buffer:
            out.append(("content", self.buffer))
            self.buffer = ""
        return out

    def _reason(self, out: list, text: str) -> None:
        if text:
            out.append(("reasoning", text))
            self.reasoning += text
