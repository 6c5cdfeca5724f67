"""A sample's logits processors, run as transformers' `LogitsProcessorList.__call__` runs
them, at less cost per decode step.

`LogitsProcessorList.__call__` reads each processor's signature with `inspect.signature`
at every call (tens of microseconds a processor), and `MinLengthLogitsProcessor` and
`MinNewTokensLengthLogitsProcessor` (`min_length`, `min_new_tokens`: both made for a request
with `min_new_tokens`) build a vocabulary-sized mask every step, even after their minimum is
reached (about 0.2 ms each a step at a 49k vocabulary). Here the signature is read once per
processor class, and those two processors' outputs are made with one copy and an indexed
fill (no copy once the minimum is reached): the same values, bit for bit
(`torch.where(mask, -inf, scores)` and `scores` with those entries set to -inf hold the
same values).
"""

from __future__ import annotations

import inspect
import math

import torch
from transformers import LogitsProcessorList, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor


def run(processors, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """`processors(input_ids, scores)`: input_ids [1, length] int64, scores [1, vocab] ->
    the processed scores [1, vocab]. A list of another class than transformers' own is
    called as it is (its `__call__` may do more)."""
    if type(processors) is not LogitsProcessorList:
        return processors(input_ids, scores)
    for processor in processors:
        if type(processor) in _EOS_UNTIL and "__call__" not in processor.__dict__:
            masked = _EOS_UNTIL[type(processor)](processor, input_ids.shape[-1])
            scores = _eos_masked(scores, processor.eos_token_id, masked)
            continue
        names = _parameter_names(processor)
        if len(names) > 2:  # (what LogitsProcessorList raises: the engine passes no extra arguments)
            raise ValueError(f"Make sure that all the required parameters: {list(names)} for {processor.__class__} "
                             f"are passed to the logits processor.")
        scores = processor(input_ids, scores)
    return scores


# processors that set the EOS tokens' scores to -inf while the sequence is short, by class:
# whether they do at a sequence of this length (input_ids.shape[-1])
_EOS_UNTIL = {
    MinLengthLogitsProcessor: lambda p, length: length < p.min_length,
    MinNewTokensLengthLogitsProcessor: lambda p, length: length - p.prompt_length_to_skip < p.min_new_tokens,
}


def banned_eos(processors, length: int) -> frozenset[int] | None:
    """The token ids `run` would set to -inf at a sequence of `length` tokens, where every
    processor only bans EOS tokens while the sequence is short (`min_length`,
    `min_new_tokens`); None where one does anything else. For a greedy sample this decides
    its token without running them: the first maximum of the raw scores is the processed
    scores' one unless it is banned (banning other entries moves no first maximum)."""
    if type(processors) is not LogitsProcessorList:
        return None
    banned = set()
    for processor in processors:
        if type(processor) not in _EOS_UNTIL or "__call__" in processor.__dict__:
            return None
        if _EOS_UNTIL[type(processor)](processor, length):
            banned.update(torch.as_tensor(processor.eos_token_id).reshape(-1).tolist())
    return frozenset(banned)


def _eos_masked(scores: torch.Tensor, eos_token_id, masked: bool) -> torch.Tensor:
    """scores [1, vocab], or a copy with the EOS tokens' entries -inf if `masked`. (Stock
    returns a copy either way; the scores a processor gets here are the engine's own copy
    or an earlier processor's output, which nothing else reads.)"""
    if not masked:
        return scores
    eos = torch.as_tensor(eos_token_id, device=scores.device).reshape(-1)
    eos = eos[(eos >= 0) & (eos < scores.shape[-1])]  # (isin over the vocabulary ignores other ids)
    out = scores.clone()
    out[..., eos] = -math.inf
    return out


_NAMES: dict[type, tuple[str, ...]] = {}  # processor class -> its __call__'s parameter names


def _parameter_names(processor) -> tuple[str, ...]:
    """The parameters of `processor.__call__` (bound), read once per class unless the
    instance has a `__call__` of its own."""
    if "__call__" in processor.__dict__:
        return tuple(inspect.signature(processor.__call__).parameters)
    names = _NAMES.get(type(processor))
    if names is None:
        names = _NAMES[type(processor)] = tuple(inspect.signature(processor.__call__).parameters)
    return names
