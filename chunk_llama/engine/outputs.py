"""What a sample's progress looks like to the caller: `RequestDelta`s and the final `RequestOutput`."""

from __future__ import annotations

import time

import torch

from chunk_llama.engine.inputs import InputProcessor
from chunk_llama.engine.request import RequestDelta, RequestOutput, Sequence
from chunk_llama.engine.text import advance_text, output_text


def make_delta(seq: Sequence, inputs: InputProcessor) -> RequestDelta:
    """The tokens (and text) `seq` produced since its last delta; with the output once it finished."""
    new_ids = seq.output_ids[seq.num_reported :]
    seq.num_reported = len(seq.output_ids)
    text = None
    if seq.track_text:
        with inputs.tokenizer_lock:
            advance_text(seq, inputs.tokenizer, flush=seq.is_finished)
        text, seq.num_reported_chars = seq.text[seq.num_reported_chars :], len(seq.text)
    output = make_output(seq, inputs) if seq.is_finished else None
    return RequestDelta(seq.request_id, seq.index, new_ids, text, seq.is_finished, seq.finish_reason, output)


def make_output(seq: Sequence, inputs: InputProcessor) -> RequestOutput:
    seq.finish_time = seq.finish_time or time.perf_counter()
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_ids,
        token_ids=list(seq.output_ids),
        text=None if inputs.tokenizer is None else _locked(inputs, output_text, seq),
        finish_reason=seq.finish_reason,
        logits=torch.stack(seq.logits) if seq.keep_logits and seq.logits else None,
        scores=torch.stack(seq.scores) if seq.keep_scores and seq.scores else None,
        index=seq.index,
        arrival_time=seq.arrival_time,
        first_token_time=seq.first_token_time,
        finish_time=seq.finish_time,
        num_cached_tokens=seq.num_cached_tokens or 0,
    )


def _locked(inputs: InputProcessor, function, seq: Sequence):
    with inputs.tokenizer_lock:
        return function(seq, inputs.tokenizer)
