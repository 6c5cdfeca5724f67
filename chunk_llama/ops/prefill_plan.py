"""Per-step metadata of packed prefill attention, built once per forward, read by every layer.

A step prefills several sequences at once; their new tokens are rows of one flattened
query tensor. The plan says, per sequence, where its tokens sit in that tensor and in
the sequence, and which pool chunks hold its K/V (cached prefix and new tokens alike);
and it cuts the work into tiles for the CPU kernel (`csrc/cpu/prefill.h`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# csrc/cpu/params.h kRowsPerItem: the most query rows (tokens x GQA group) one kernel
# work item holds; the glue rejects wider tiles.
ROWS_PER_TILE = 128


@dataclass
class PrefillPlan:
    """chunk_table: [num_seqs, max_chunks] each sequence's chunk ids in order, padded with 0
    q_start, num_tokens, token_start: [num_seqs] position of the first new token in its
        sequence, count of new tokens, and row of the first in the flattened queries
    tiles: [num_tiles, 3] (seq, row_begin, row_end) ranges of query rows (row = token *
        group + head of the group), at most ROWS_PER_TILE each, most work first
    segments: (token_start, q_start, num_tokens) per sequence, as Python ints (reference)
    """

    chunk_table: torch.Tensor
    q_start: torch.Tensor
    num_tokens: torch.Tensor
    token_start: torch.Tensor
    tiles: torch.Tensor
    segments: list[tuple[int, int, int]]
    group: int

    @property
    def num_seqs(self) -> int:
        return len(self.segments)


def prefill_tiles(segments: list[tuple[int, int, int]], group: int,
                  rows_per_tile: int = ROWS_PER_TILE) -> list[tuple[int, int, int]]:
    """(seq, row_begin, row_end) tiles, ordered by their work (rows x keys they see),
    largest first, so that dynamic scheduling over them balances the threads."""
    tiles = []
    for seq, (_, q_start, num_tokens) in enumerate(segments):
        rows = num_tokens * group
        for begin in range(0, rows, rows_per_tile):
            end = min(rows, begin + rows_per_tile)
            keys = q_start + (end - 1) // group + 1  # the last row's position + 1
            tiles.append((-(end - begin) * keys, seq, begin, end))
    tiles.sort()
    return [(seq, begin, end) for _, seq, begin, end in tiles]


def build_prefill_plan(chunk_ids: list[list[int]], segments: list[tuple[int, int, int]], group: int,
                       device: torch.device | str = "cpu") -> PrefillPlan:
    """chunk_ids: each sequence's path; segments: (token_start, q_start, num_tokens) each."""
    max_chunks = max((len(c) for c in chunk_ids), default=0)
    table = [c + [0] * (max_chunks - len(c)) for c in chunk_ids]
    tiles = prefill_tiles(segments, group)

    def longs(values, shape):
        return torch.tensor(values, dtype=torch.long).reshape(shape).to(device)

    n = len(segments)
    return PrefillPlan(
        chunk_table=longs(table, (n, max_chunks)),
        q_start=longs([s[1] for s in segments], (n,)),
        num_tokens=longs([s[2] for s in segments], (n,)),
        token_start=longs([s[0] for s in segments], (n,)),
        tiles=longs(tiles, (len(tiles), 3)),
        segments=list(segments),
        group=group,
    )
