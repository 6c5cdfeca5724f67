"""Next-token selection with transformers' logits processors, per request."""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from chunk_llama.engine.request import Sequence


def build_processors(config: GenerationConfig) -> LogitsProcessorList:
    """The processors `generate` would apply for these settings, in its order."""
    processors = LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=config.repetition_penalty))
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k is not None and config.top_k != 0:
            processors.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
        if config.min_p is not None:
            processors.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    return processors


def select_tokens(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Pick the next token of each sequence.

    logits: [num_seqs, vocab] raw logits of the last position of each sequence
    """
    logits = logits.float()
    tokens: list[int] = []
    greedy_rows = [i for i, s in enumerate(seqs) if not s.do_sample and not s.processors]
    greedy = logits[greedy_rows].argmax(dim=-1).tolist() if greedy_rows else []
    by_row = dict(zip(greedy_rows, greedy))
    for i, seq in enumerate(seqs):
        if i in by_row:
            tokens.append(by_row[i])
            continue
        scores = logits[i : i + 1]
        if seq.processors:
            input_ids = torch.tensor([seq.all_ids], device=logits.device)
            scores = seq.processors(input_ids, scores)
        if seq.do_sample:
            probs = torch.softmax(scores, dim=-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
        else:
            tokens.append(int(scores.argmax(dim=-1)))
    return tokens
