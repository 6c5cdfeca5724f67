"""Next-token selection, per request, as `generate`'s sampling loop does it.

Each sample's scores go through its grammar's mask, if it has one (`grammar.py`: the
disallowed tokens set to -inf, so every processor after it sees only what the grammar
allows), then its own logits processors (built by `generation.resolve`, run by `processors.run`) on
its own `input_ids`; greedy samples take the argmax. A greedy sample whose processors only ban
EOS tokens while it is short (`min_new_tokens`, `min_length`) takes the raw logits' argmax
where that is not a banned token (the processed scores' argmax, without a vocabulary-sized
copy: `processors.banned_eos`).
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
    # greedy rows that keep no scores, without a grammar, whose processors (if any) only ban EOS
    # tokens while the sequence is short: one batched argmax of the raw logits, theirs unless banned
    banned = {}
    for i, s in enumerate(seqs):
        if not s.do_sample and s.grammar is None and not s.keep_scores:
            length = len(s.prompt_ids) + len(s.output_ids)  # (all_ids' length, without joining them)
            ban = processors.banned_eos(s.processors, length) if s.processors else frozenset()
            if ban is not None:
                banned[i] = ban
    if banned:
        rows = list(banned)
        for i, token in zip(rows, argmax_rows(logits if len(rows) == len(seqs) else logits[rows])):
            if token not in banned[i]:
                tokens[i] = token
        if None not in tokens:  # (the common case: every row decided)
            return tokens, scores
    masked = [i for i, s in enumerate(seqs)
              if not s.do_sample and not s.processors and s.grammar is not None and not s.keep_scores]
    if masked:  # greedy under a grammar only: one float32 copy, each row masked, one batched argmax
        rows = logits[masked].to(dtype=torch.float32)
        for r, i in enumerate(masked):
            seqs[i].grammar.constrain(rows[r : r + 1])
        for i, token in zip(masked, argmax_rows(rows)):
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
            tokens[i] = argmax_rows(row)[0]
    for group, rows in groups.items():
        probs = torch.ones(group.num_samples, logits.shape[-1], device=logits.device)
        for index, i in rows.items():
            probs[index] = torch.softmax(scores[i], dim=-1)
        drawn = torch.multinomial(probs, num_samples=1, generator=group.generator).squeeze(1).tolist()
        for index, i in rows.items():
            tokens[i] = drawn[index]
    return tokens, [s if seq.keep_scores else None for s, seq in zip(scores, seqs)]


def argmax_rows(rows: torch.Tensor) -> list[int]:
    """Each row's first maximum (NaN above everything), as `rows.argmax(-1).tolist()`: rows
    [n, vocab]. numpy's argmax of a float32 CPU tensor, the same index (the same ties and NaN
    rule), in a tenth of torch's time at a 49k vocabulary (about 3 us against 28)."""
    if rows.dtype is torch.float32 and rows.device.type == "cpu" and not rows.requires_grad:
        return rows.numpy().argmax(-1).tolist()
    return rows.argmax(dim=-1).tolist()
