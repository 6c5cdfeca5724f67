"""Requests as the user sees them (`RequestOutput`) and as the engine tracks them (`Sequence`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RequestOutput:
    """The result of one request.

    token_ids: generated tokens (the EOS token included when generation stopped on it)
    finish_reason: "stop" (EOS or stop string) or "length" (max_new_tokens)
    logits: [num_generated, vocab] raw logits when `output_logits` was set, else None
    """

    request_id: int
    prompt: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logits: torch.Tensor | None = None


@dataclass
class Sequence:
    """A request in flight. Its cached tokens are `prompt_ids + output_ids[:-1]`
    while running: the newest token is fed in the next decode step."""

    seq_id: int
    prompt: Any
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    processors: Any
    do_sample: bool
    generator: torch.Generator | None
    keep_logits: bool
    output_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def add_token(self, token: int, logits: torch.Tensor | None) -> None:
        self.output_ids.append(token)
        if logits is not None:
            self.logits.append(logits)
        if token in self.eos_token_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finish_reason = "length"
