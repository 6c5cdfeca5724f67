"""Next-token selection, per request, as `generate`'s sampling loop does it.

Each sample's scores go through its grammar's mask, if it has one (`grammar.py`: the
disallowed tokens set to -inf, so every processor after it sees only what the grammar
allows), then its own logits processors (built by `generation.resolve`, run by `processors.run`) on
its own `input_ids`; greedy samples take the argmax.
Sampled samples of one request draw together: one `torch.multinomial` over a
`[num_samples, vocab]` matrix from the request's generator, with a row of ones
standing in for each sample that already finished (stock `generate` keeps
drawing for finished rows too), so the draws consume the random stream exactly
as `generate` does for that request alone.
"""

from __future__ import annotations

import torch

from chunk_llama.engine import processors
from chunk_llama.engine.request import SampleGroup, Sequence


def select_tokens(seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int], list[torch.Tensor | None]]:
    """Pick the next token of each sequence.

    logits: [num_seqs, vocab] raw logits of the last position of each sequence
    returns the tokens and, per sequence, its processed scores [vocab] (None when
    it keeps none and needs none)
    """
    tokens: list[int | None] = [None] * len(seqs)
    scores: list[torch.Tensor | None] = [None] * len(seqs)
    plain = [i for i, s in enumerate(seqs) if not s.do_sample and not s.processors and s.grammar is None]
    if len(plain) == len(seqs) and not any(s.keep_scores for s in seqs):
        # (the common case: every row greedy and plain) one argmax on the device, one copy to the host
        return logits.argmax(dim=-1).tolist(), [None] * len(seqs)
    if plain:  # no processors, no grammar: one batched argmax, no copies
        for i, token in zip(plain, logits[plain].argmax(dim=-1).tolist()):
            tokens[i] = token
    masked = [i for i, s in enumerate(seqs)
              if not s.do_sample and not s.processors and s.grammar is not None and not s.keep_scores]
    if masked:  # greedy under a grammar only: one float32 copy, each row masked, one batched argmax
        rows = logits[masked].to(dtype=torch.float32)
        for r, i in enumerate(masked):
            seqs[i].grammar.constrain(rows[r : r + 1])
        for i, token in zip(masked, rows.argmax(dim=-1).tolist()):
            tokens[i] = token
    groups: dict[SampleGroup, dict[int, int]] = {}  # sampled: group -> sample index -> row
    for i, seq in enumerate(seqs):
        if tokens[i] is not None and not seq.keep_scores:
            continue
        # float32 copy, as generate takes it (processors may work in place)
        row = logits[i : i + 1].to(dtype=torch.float32, copy=True)
        if seq.grammar is not None:
            seq.grammar.constrain(row)
        if seq.processors:
            row = processors.run(seq.processors, seq.ids_tensor(logits.device), row)
        scores[i] = row[0]
        if seq.do_sample:
            groups.setdefault(seq.group, {})[seq.index] = i
        elif tokens[i] is None:
            tokens[i] = int(row.argmax(dim=-1))
    for group, rows in groups.items():
        probs = torch.ones(group.num_samples, logits.shape[-1], device=logits.device)
        for index, i in rows.items():
            probs[index] = torch.softmax(scores[i], dim=-1)
        drawn = torch.multinomial(probs, num_samples=1, generator=group.generator).squeeze(1).tolist()
        for index, i in rows.items():
            tokens[i] = drawn[index]
    return tokens, [s if seq.keep_scores else None for s, seq in zip(scores, seqs)]
