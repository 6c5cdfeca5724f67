"""OpenAI's frequency and presence penalties as a transformers logits processor.

OpenAI's definition (API reference, "Parameter details"):

    mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence

where c[j] is how often token j was sampled before the current position, i.e. in the
completion so far (the prompt does not count, unlike transformers'
`repetition_penalty`). transformers has no such processor; `logit_bias` needs none
(it is `sequence_bias` with one-token sequences, added to the logits).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class OpenAIPenaltiesLogitsProcessor(LogitsProcessor):
    """Subtracts `frequency_penalty * count + presence_penalty * (count > 0)` from each token's
    logit, counting the tokens generated so far.

    It takes the length of the first `input_ids` it sees as the prompt's: the engine calls
    a request's processors first on the prompt alone, for every sample. So use one instance
    per request (the server does), never one for requests with different prompts.
    """

    def __init__(self, frequency_penalty: float = 0.0, presence_penalty: float = 0.0):
        for name, value in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        self.frequency_penalty = float(frequency_penalty)
        self.presence_penalty = float(presence_penalty)
        self.prompt_length: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids: [batch, prompt + generated]; scores: [batch, vocab] -> the penalized scores."""
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        generated = input_ids[:, self.prompt_length:]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency_penalty - (counts > 0).to(scores.dtype) * self.presence_penalty
