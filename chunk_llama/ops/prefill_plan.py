"""Per-step metadata of packed prefill attention, built once per forward, read by every layer.

A step prefills several sequences at once; their new tokens are rows of one flattened
query tensor. The plan says, per sequence, where its tokens sit in that tensor and in
the sequence, and which pool slots hold its K/V (cached prefix and new tokens alike),
as segments: runs of slots of one chunk at consecutive positions (`kv/plan.py`). It
cuts the work for the CPU kernel (`csrc/cpu/prefill.h`) in two phases:

- context items, the chunk-first idea applied to prefill: where the new tokens of
  several sequences all see the same nodes whole (their common prefix, cached or
  written by another sequence of this forward), those sequences' tokens, packed next to
  each other, form one run of query rows that attends to those nodes at once, each row
  leaving a partial (o, m, n);
- tiles: each sequence's rows start from their partials and attend to the rest of
  the sequence's keys (its own part of the path, causal on its new tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunk_llama.kv.plan import NO_POSITION
from chunk_llama.ops.cuda_prefill import VarlenContext, build_varlen_context

# csrc/cpu/params.h kRowsPerItem: the most query rows (tokens x GQA group) one kernel
# work item holds; the glue rejects wider tiles.
ROWS_PER_TILE = 128
# The widest register block of rows of any CPU variant (AVX-512: 2 vectors of 16).
BLOCK_ROWS = 32

Run = tuple[int, int, int, int]  # a path's node: (identity, chunk, first slot, number of tokens)


@dataclass
class PrefillPlan:
    """seg_chunk, seg_start, seg_pos: [num_seqs, max_segments + 1] each sequence's segments in
        order (chunk, first slot, position of the first key), padded with position
        NO_POSITION; a segment runs to the next one's position
    q_start, num_tokens, token_start: [num_seqs] position of the first new token in its
        sequence, count of new tokens, and row of the first in the flattened queries
    tiles: [num_tiles, 3] (seq, row_begin, row_end) ranges of query rows (row = token *
        group + head of the group), at most ROWS_PER_TILE each, most work first
    token_pos: [num_q_tokens] each query token's position in its sequence
    ctx_end: [num_seqs] positions before it are the context items' (0: none)
    ctx_chunk, ctx_start, ctx_len, ctx_pos: [num_ctx_segments] context segments
    ctx_items: [num_ctx_items, 5] (first context segment, count, row_begin, row_end,
        partial offset): global rows; the partial of token t is row partial offset + t
    seq_ctx_ptr: [num_seqs + 1], seq_ctx_offset: [...] each sequence's partial offsets
    segments: (token_start, q_start, num_tokens) per sequence, as Python ints (reference)
    varlen: the contexts as one packed varlen batch, for the CUDA prefill (None on the CPU)
    """

    seg_chunk: torch.Tensor
    seg_start: torch.Tensor
    seg_pos: torch.Tensor
    q_start: torch.Tensor
    num_tokens: torch.Tensor
    token_start: torch.Tensor
    tiles: torch.Tensor
    token_pos: torch.Tensor
    ctx_end: torch.Tensor
    ctx_chunk: torch.Tensor
    ctx_start: torch.Tensor
    ctx_len: torch.Tensor
    ctx_pos: torch.Tensor
    ctx_items: torch.Tensor
    seq_ctx_ptr: torch.Tensor
    seq_ctx_offset: torch.Tensor
    num_partial_rows: int
    segments: list[tuple[int, int, int]]
    group: int
    varlen: VarlenContext | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.segments)


def prefill_tiles(segments: list[tuple[int, int, int]], group: int, ctx_end: list[int] | None = None,
                  rows_per_tile: int = ROWS_PER_TILE) -> list[tuple[int, int, int]]:
    """(seq, row_begin, row_end) tiles, ordered by their work (rows x keys they walk),
    largest first, so that dynamic scheduling over them balances the threads."""
    tiles = []
    for seq, (_, q_start, num_tokens) in enumerate(segments):
        rows = num_tokens * group
        for begin in range(0, rows, rows_per_tile):
            end = min(rows, begin + rows_per_tile)
            keys = q_start + (end - 1) // group + 1 - (ctx_end[seq] if ctx_end else 0)  # to the last row's position
            tiles.append((-(end - begin) * keys, seq, begin, end))
    tiles.sort()
    return [(seq, begin, end) for _, seq, begin, end in tiles]


def _merged(runs: list[Run]) -> list[tuple[int, int, int]]:
    """A chunk's consecutive nodes as one (chunk, first slot, tokens) segment."""
    out: list[tuple[int, int, int]] = []
    for _, chunk, start, count in runs:
        if out and out[-1][0] == chunk and out[-1][1] + out[-1][2] == start:
            out[-1] = (chunk, out[-1][1], out[-1][2] + count)
        else:
            out.append((chunk, start, count))
    return out


def _packs_better(seqs: list[int], segments: list[tuple[int, int, int]], group: int) -> bool:
    """Whether reading together saves work: the kernel is compute-bound, so what the context
    phase saves is the register blocks that a sequence's few rows leave partly empty
    (16 sequences x 4 new tokens, 9/3 heads: 1.5x faster; x 64 tokens, whose tiles are
    full: 0.96x, the cost of the partials)."""
    rows = [segments[s][2] * group for s in seqs]
    return -(-sum(rows) // BLOCK_ROWS) <= 0.9 * sum(-(-r // BLOCK_ROWS) for r in rows)


def _context_runs(paths: list[list[Run]], segments: list[tuple[int, int, int]], group: int):
    """The context phase's work: for each sequence, the runs of its path's leading nodes
    that it reads together with its neighbours. A node qualifies for the sequences whose
    new tokens all come after it; those of them packed next to each other (consecutive
    in token order, 2 or more, whose rows fill register blocks better together) read it
    together. Returns [(sequences, nodes, first position)] and each sequence's ctx_end."""
    order = sorted(range(len(segments)), key=lambda s: segments[s][0])
    next_of = {a: b for a, b in zip(order, order[1:]) if segments[a][0] + segments[a][2] == segments[b][0]}
    readers: dict[int, list[int]] = {}  # node identity -> sequences whose new tokens see it whole
    for s in order:
        position = 0
        for key, _, _, count in paths[s]:
            position += count
            if segments[s][1] < position:
                break
            readers.setdefault(key, []).append(s)
    group_of: dict[tuple[int, int], tuple[int, ...]] = {}  # (node, sequence) -> its neighbours reading it
    for key, seqs in readers.items():
        run = [seqs[0]]
        for s in seqs[1:] + [None]:
            if s is not None and next_of.get(run[-1]) == s:
                run.append(s)
                continue
            if len(run) > 1 and _packs_better(run, segments, group):
                group_of.update({(key, r): tuple(run) for r in run})
            run = [s]
    ctx_end = [0] * len(segments)
    runs, seen = [], set()
    for s in order:
        position, current = 0, None
        for node in paths[s]:
            group = group_of.get((node[0], s))
            if group is None:
                break
            if current is None or current[0] != group:
                current = (group, [], position)
                if (group, node[0]) not in seen:  # the group's first sequence makes the run
                    seen.add((group, node[0]))
                    runs.append(current)
            current[1].append(node)
            position += node[3]
        ctx_end[s] = position
    return runs, ctx_end


def build_prefill_plan(paths: list[list[Run]], segments: list[tuple[int, int, int]], group: int,
                       num_q_tokens: int | None = None, num_kv_heads: int = 1, shared_context: bool = True,
                       device: torch.device | str = "cpu", chunk_size: int | None = None) -> PrefillPlan:
    """paths: each sequence's nodes (identity, chunk, first slot, tokens), as
    `PrefixTree.path` gives them (the same identity on two paths: the same K/V);
    segments: (token_start, q_start, num_tokens) each; num_q_tokens: rows of the query
    tensor (default: the last sequence's end); shared_context: False leaves every
    sequence's keys to its own tiles (no context phase). On a CUDA device the plan also
    holds the varlen batch of the CUDA prefill, which has no context phase (with the
    pool's `chunk_size` it gathers whole chunks where it can)."""
    kv_segments = [_merged(path) for path in paths]
    on_cuda = torch.device(device).type == "cuda"
    shared_context = shared_context and not on_cuda
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
    if num_q_tokens is None:
        num_q_tokens = max((t + n for t, _, n in segments), default=0)
    token_pos = [0] * num_q_tokens
    for token_start, q_start, num_tokens in segments:
        token_pos[token_start : token_start + num_tokens] = range(q_start, q_start + num_tokens)

    runs, ctx_end = _context_runs(paths, segments, group) if shared_context else ([], [0] * len(segments))
    ctx_segments: list[tuple[int, int, int, int]] = []  # chunk, first slot, keys, position
    items: list[tuple[int, int, int, int, int]] = []
    pieces_of: list[list[int]] = [[] for _ in segments]
    num_partial_rows = 0
    target_items = 8 * torch.get_num_threads()  # enough to balance the threads
    for seqs, nodes, first_position in runs:
        first_seg = len(ctx_segments)
        position = first_position
        for chunk, start, count in _merged(nodes):
            ctx_segments.append((chunk, start, count, position))
            position += count
        num_segments = len(ctx_segments) - first_seg
        token_begin = segments[seqs[0]][0]
        token_end = segments[seqs[-1]][0] + segments[seqs[-1]][2]
        row_items = -(-(token_end - token_begin) * group // ROWS_PER_TILE)
        num_pieces = min(num_segments, max(1, target_items // (row_items * num_kv_heads)))
        for i in range(num_pieces):
            lo = first_seg + num_segments * i // num_pieces
            hi = first_seg + num_segments * (i + 1) // num_pieces
            offset = num_partial_rows - token_begin
            num_partial_rows += token_end - token_begin
            for row in range(token_begin * group, token_end * group, ROWS_PER_TILE):
                items.append((lo, hi - lo, row, min(token_end * group, row + ROWS_PER_TILE), offset))
            for s in seqs:
                pieces_of[s].append(offset)
    seq_ctx_ptr = [0]
    for offsets in pieces_of:
        seq_ctx_ptr.append(seq_ctx_ptr[-1] + len(offsets))
    tiles = prefill_tiles(segments, group, ctx_end)

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
        token_pos=longs(token_pos, (num_q_tokens,)),
        ctx_end=longs(ctx_end, (n,)),
        ctx_chunk=longs([c[0] for c in ctx_segments], (len(ctx_segments),)),
        ctx_start=longs([c[1] for c in ctx_segments], (len(ctx_segments),)),
        ctx_len=longs([c[2] for c in ctx_segments], (len(ctx_segments),)),
        ctx_pos=longs([c[3] for c in ctx_segments], (len(ctx_segments),)),
        ctx_items=longs(items, (len(items), 5)),
        seq_ctx_ptr=longs(seq_ctx_ptr, (n + 1,)),
        seq_ctx_offset=longs([o for offsets in pieces_of for o in offsets], (seq_ctx_ptr[-1],)),
        num_partial_rows=num_partial_rows,
        segments=list(segments),
        group=group,
        varlen=build_varlen_context(kv_segments, segments, chunk_size, device) if on_cuda else None,
    )
