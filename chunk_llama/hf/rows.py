"""Stock `generate`'s rows on a `ChunkCache` (a mixin of it): each batch row is one sequence.

The patched forward calls `begin_rows` with each forward's input ids and attention mask:
the first forward of a call inserts the rows (rows with equal prefixes share chunks,
and with retention find earlier calls' chunks), later ones decode a token per row. Left
padding holds no chunk and is never attended; the cache counts the batch's columns,
padding included, as transformers does (`get_seq_length`). `start_rows` ends a call's
rows (the patched `generate` calls it first), so a cache is never read as the
continuation of another call.
"""

from __future__ import annotations

import torch

from chunk_llama.kv import KVCacheFull


class GenerateRows:
    """begin_rows / start_rows / reset of `ChunkCache` (which holds the tree and the steps)."""

    def start_rows(self) -> None:
        """A new stock `generate` call: the rows of the last one end (their chunks stay as a
        prefix cache with retention, else are freed), so the next forward's rows are new
        sequences, never read as a continuation of the last call's."""
        if self.tree.in_step:
            self.end_step(completed=False)
        for seq_id in self._row_seq_ids:
            if seq_id in self.tree:
                self.tree.remove(seq_id)
        self._row_seq_ids, self._columns = [], 0

    def reset(self) -> None:
        """Empty the cache (transformers' `Cache.reset`): every sequence, the stock
        `generate` rows, and every retained prefix."""
        self.start_rows()
        for seq_id in self.tree.seq_ids:
            self.tree.remove(seq_id)
        self.tree.evict_all()
        self._builder.discard_plan()

    @staticmethod
    def _left_pads(attention_mask: torch.Tensor | None, batch: int, q_len: int) -> list[int]:
        """Leading pad columns of each row among the forward's `q_len` new columns
        (generate's attention mask holds every column so far); only left padding is taken."""
        if attention_mask is None or attention_mask.ndim != 2:
            return [0] * batch
        new = attention_mask[:, -q_len:].bool()
        real = new.sum(dim=1)
        pads = q_len - real
        # left padding: zeros, then ones to the end of the row
        expected = torch.arange(q_len, device=new.device)[None, :] >= pads[:, None]
        if not torch.equal(new, expected):
            raise ValueError("ChunkCache takes left-padded batches only (attention_mask zeros before each row's "
                             "tokens, as tokenizers pad with padding_side='left'); this mask has padding on the "
                             "right or inside a row")
        if bool((real == 0).any()):
            raise ValueError("a row of the batch is all padding (attention_mask has no 1 in its new columns)")
        return pads.tolist()

    def begin_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Prepare a forward of stock `generate`: each batch row is one sequence, its tokens
        those the attention mask marks (left padding holds no chunk and is never attended)."""
        if input_ids is None:
            raise ValueError("ChunkCache needs input_ids (inputs_embeds are not supported)")
        batch, q_len = input_ids.shape
        pads = self._left_pads(attention_mask, batch, q_len)
        rows = input_ids.tolist()
        self._open_step()
        if not self._row_seq_ids:
            # negative ids: engine sequences are >= 0, so the two never collide
            self._row_seq_ids = [-1 - r for r in range(batch)]
            matched = self._insert_rows([row[pad:] for row, pad in zip(rows, pads)])
            segments = [(s, r * q_len + pad, 0, q_len - pad, m)
                        for r, (s, pad, m) in enumerate(zip(self._row_seq_ids, pads, matched))]
            self._begin(self._builder.prefill(segments, batch * q_len, columns=q_len))
            return
        if batch != len(self._row_seq_ids):
            raise ValueError(
                f"this ChunkCache holds {len(self._row_seq_ids)} sequences but the batch has {batch} rows "
                "(beam search and assisted decoding are not supported on a ChunkCache)"
            )
        if any(pads):
            raise ValueError("padding in a continuation of the rows (only the first forward may be left-padded)")
        past = self._columns
        if q_len == 1:  # each row's sequence keeps its batch row: the plan's rows are reordered
            rows_of = {s: r for r, s in enumerate(self._row_seq_ids)}
            self._begin(self._builder.decode(dict(zip(self._row_seq_ids, (r[0] for r in rows))), batch_rows=rows_of,
                                             past_len=past, columns=past + 1))
            return
        starts = [self.tree.seq_len(s) for s in self._row_seq_ids]  # rows differ where the first was padded
        for seq_id, row in zip(self._row_seq_ids, rows):
            self.tree.extend(seq_id, row)
        segments = [(s, r * q_len, start, q_len, start) for r, (s, start) in enumerate(zip(self._row_seq_ids, starts))]
        self._begin(self._builder.prefill(segments, batch * q_len, past_len=past, columns=past + q_len))

    def _insert_rows(self, rows: list[list[int]]) -> list[int]:
        try:
            return [self.tree.insert(seq_id, row) for seq_id, row in zip(self._row_seq_ids, rows)]
        except KVCacheFull:
            self.end_step(completed=False)  # drops the rows inserted so far
            raise
