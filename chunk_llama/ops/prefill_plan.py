"""Per-step metadata of packed prefill attention, built once per forward, read by every layer.

A step prefills several sequences at once; their new tokens are rows of one flattened
query tensor. The plan says, per sequence, where its tokens sit in that tensor and in
the sequence, and which pool slots hold its K/V (cached prefix and new tokens alike),
as segments: runs of slots of one chunk at consecutive positions (`kv/plan.py`); and it
cuts the work into tiles for the CPU kernel (`csrc/cpu/prefill.h`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunk_llama.kv.plan import NO_POSITION

# csrc/cpu/params.h kRowsPerItem: the most query rows (tokens x GQA group) one kernel
# work item holds; the glue rejects wider tiles.
ROWS_PER_TILE = 128


@dataclass
class PrefillPlan:
    """seg_chunk, seg_start, seg_pos: [num_seqs, max_segments + 1] each sequence's segments in
        order (chunk, first slot, position of the first key), padded with position
        NO_POSITION; a segment runs to the next one's position
    q_start, num_tokens, token_start: [num_seqs] position of the first new token in its
        sequence, count of new tokens, and row of the first in the flattened queries
    tiles: [num_tiles, 3] (seq, row_begin, row_end) ranges of query rows (row = token *
        group + head of the group), at most ROWS_PER_TILE each, most work first
    segments: (token_start, q_start, num_tokens) per sequence, as Python ints (reference)
    """

    seg_chunk: torch.Tensor
    seg_start: torch.Tensor
    seg_pos: torch.Tensor
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


def build_prefill_plan(kv_segments: list[list[tuple[int, int, int]]], segments: list[tuple[int, int, int]],
                       group: int, device: torch.device | str = "cpu") -> PrefillPlan:
    """kv_segments: each sequence's (chunk, first slot, number of tokens) runs in order
    (`PrefixTree.segments`); segments: (token_start, q_start, num_tokens) each."""
    width = max((len(runs) for runs in kv_segments), default=0) + 1  # an unused entry ends every walk
    chunks, starts, positions = [], [], []
    for runs in kv_segments:
        position = 0
        for chunk, start, count in runs:
            chunks.append(chunk)
            starts.append(start)
            positions.append(position)
            position += count
        pad = width - len(runs)
        chunks += [0] * pad
        starts += [0] * pad
        positions += [NO_POSITION] * pad
    tiles = prefill_tiles(segments, group)

    def longs(values, shape):
        return torch.tensor(values, dtype=torch.long).reshape(shape).to(device)

    n = len(segments)
    return PrefillPlan(
        seg_chunk=longs(chunks, (n, width)),
        seg_start=longs(starts, (n, width)),
        seg_pos=longs(positions, (n, width)),
        q_start=longs([s[1] for s in segments], (n,)),
        num_tokens=longs([s[2] for s in segments], (n,)),
        token_start=longs([s[0] for s in segments], (n,)),
        tiles=longs(tiles, (len(tiles), 3)),
        segments=list(segments),
        group=group,
    )
