"""Requests as the user sees them (`RequestOutput`, `RequestDelta`) and as the engine
tracks them (`Sequence`, one per returned sample)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RequestOutput:
    """The result of one sample of a request.

    index: which of the request's `num_return_sequences` samples this is
    token_ids: generated tokens (the EOS token included when generation stopped on it)
    finish_reason: "stop" (EOS, stop string or a stopping criterion), "length"
        (max_new_tokens or max_time) or "abort"
    logits: [num_generated, vocab] raw logits when `output_logits` was set, else None
    scores: [num_generated, vocab] the processed scores when `output_scores` was set, else None
    arrival_time, first_token_time, finish_time: `time.perf_counter()` stamps
    num_cached_tokens: leading prompt tokens the prefix cache served when the request
        was first admitted (not computed by its prefill); 0 if it never was
    """

    request_id: int
    prompt: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logits: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    index: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestDelta:
    """What one `step()` produced for one sample of a request.

    token_ids: the tokens generated this step (empty for an abort)
    text: their text (None without a tokenizer); UTF-8 sequences split across
        tokens are held back until complete, so the deltas concatenate to the output
    output: the final `RequestOutput` when `finished`
    """

    request_id: int
    index: int
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None = None
    output: RequestOutput | None = None


@dataclass(eq=False)
class SampleGroup:
    """The samples of one request. Like the `num_return_sequences` rows of one `generate`
    call, they draw their tokens together, one multinomial over all of them per step
    from one generator (the request's `seed`), so a seeded request gets the tokens
    stock `generate` gives it after `torch.manual_seed(seed)`. The scheduler keeps a
    request's unfinished samples together (admitted, preempted and decoded at once)."""

    num_samples: int
    generator: torch.Generator | None


@dataclass(eq=False)  # identity: the scheduler's lists hold and remove the objects
class Sequence:
    """A sample in flight. Its cached tokens are `prompt_ids + output_ids[:-1]`
    while running: the newest token is fed in the next decode step."""

    seq_id: int
    request_id: int
    index: int
    prompt: Any
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    processors: Any  # LogitsProcessorList, this sample's own
    criteria: Any  # StoppingCriteriaList: max_time and the user's
    do_sample: bool
    group: SampleGroup
    keep_logits: bool = False
    keep_scores: bool = False
    stop_strings: tuple[str, ...] = ()
    track_text: bool = False  # decode text as tokens arrive (streaming, stop strings)
    skip_special_tokens: bool = True  # special tokens are not text (but see text.py for EOS)
    grammar: Any = None  # GrammarState when the output is constrained (grammar.py)
    adapter: Any = None  # what the request runs under, as resolved when submitted (`hf/lora/registry.py`)
    lora: Any = None  # its weights (a LoraAdapter) once admitted; None: the base
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    output_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""  # text streamed so far (see `text.py`)
    decoder: Any = None  # tokenizers.decoders.DecodeStream while text is tracked
    num_decoded: int = 0  # tokens fed to the text decoder
    num_reported: int = 0  # tokens already returned in a `RequestDelta`
    num_reported_chars: int = 0  # characters of `text` already returned
    num_cached_tokens: int | None = None  # prompt tokens found cached at its first admission
    _ids: torch.Tensor | None = None  # all_ids in [1, capacity], filled to _ids_length (ids_tensor)
    _ids_length: int = 0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_tensor(self, device) -> torch.Tensor:
        """`all_ids` as a [1, length] int64 tensor on `device`, what logits processors take: a
        view of a buffer that grows by the new tokens only (a tensor made from the whole
        list each step costs in proportion to the context). Views given earlier keep their
        values (the buffer is only written past them, or replaced)."""
        ids, length = self.all_ids, self._ids_length
        if self._ids is None or self._ids.device != torch.device(device) or len(ids) > self._ids.shape[1]:
            buffer = torch.empty(1, max(2 * len(ids), 64), dtype=torch.int64, device=device)
            buffer[0, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
            self._ids, self._ids_length = buffer, len(ids)
        elif len(ids) > length:
            self._ids[0, length:len(ids)] = torch.tensor(ids[length:], dtype=torch.int64)
            self._ids_length = len(ids)
        return self._ids[:, :len(ids)]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token: int, logits: torch.Tensor | None, scores: torch.Tensor | None) -> None:
        self.output_ids.append(token)
        if logits is not None:
            self.logits.append(logits)
        if scores is not None:
            self.scores.append(scores)
        if token in self.eos_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.grammar is not None:
            self.grammar.advance(token, more=not self.is_finished)
