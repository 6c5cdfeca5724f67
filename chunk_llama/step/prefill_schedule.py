"""The CPU prefill kernel's work for one step: context runs and tiles (host lists).

Where the new tokens of several sequences all see the same nodes whole (their common
prefix, cached or written by another sequence of this forward), those sequences'
tokens, packed next to each other, form one run of query rows that attends to those
nodes at once, each row leaving a partial (o, m, n): the chunk-first idea applied to
prefill. Tiles then start each sequence's rows from their partials and walk the rest
of its keys (its own part of the path, causal on its new tokens).
"""

from __future__ import annotations

# csrc/cpu/params.h kRowsPerItem: the most query rows (tokens x GQA group) one kernel
# work item holds; the glue rejects wider tiles.
ROWS_PER_TILE = 128
# The widest register block of rows of any CPU variant (AVX-512: 2 vectors of 16).
BLOCK_ROWS = 32

Run = tuple[int, int, int, int]  # a path's node: (identity, chunk, first slot, number of tokens)
Segment = tuple[int, int, int]  # a sequence in the step: (token_start, q_start, num_tokens)


def merged(runs: list[Run]) -> list[tuple[int, int, int]]:
    """A chunk's consecutive nodes as one (chunk, first slot, tokens) segment."""
    out: list[tuple[int, int, int]] = []
    for _, chunk, start, count in runs:
        if out and out[-1][0] == chunk and out[-1][1] + out[-1][2] == start:
            out[-1] = (chunk, out[-1][1], out[-1][2] + count)
        else:
            out.append((chunk, start, count))
    return out


def prefill_tiles(segments: list[Segment], group: int, ctx_end: list[int] | None = None,
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


def _packs_better(seqs: list[int], segments: list[Segment], group: int) -> bool:
    """Whether reading together saves work: the kernel is compute-bound, so what the context
    phase saves is the register blocks that a sequence's few rows leave partly empty
    (16 sequences x 4 new tokens, 9/3 heads: 1.5x faster; x 64 tokens, whose tiles are
    full: 0.96x, the cost of the partials)."""
    rows = [segments[s][2] * group for s in seqs]
    return -(-sum(rows) // BLOCK_ROWS) <= 0.9 * sum(-(-r // BLOCK_ROWS) for r in rows)


def context_runs(paths: list[list[Run]], segments: list[Segment], group: int):
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
            readers_of_node = group_of.get((node[0], s))
            if readers_of_node is None:
                break
            if current is None or current[0] != readers_of_node:
                current = (readers_of_node, [], position)
                if (readers_of_node, node[0]) not in seen:  # the group's first sequence makes the run
                    seen.add((readers_of_node, node[0]))
                    runs.append(current)
            current[1].append(node)
            position += node[3]
        ctx_end[s] = position
    return runs, ctx_end


def context_work(runs, segments: list[Segment], group: int, num_kv_heads: int, num_threads: int):
    """The context runs cut into pieces (enough items for `num_threads`) and items of at
    most ROWS_PER_TILE rows. Returns the context segments (chunk, first slot, keys,
    position), the items (first segment, count, row_begin, row_end, partial offset), each
    sequence's partial offsets, and the number of partial rows."""
    ctx_segments: list[tuple[int, int, int, int]] = []
    items: list[tuple[int, int, int, int, int]] = []
    pieces_of: list[list[int]] = [[] for _ in segments]
    num_partial_rows = 0
    target_items = 8 * num_threads  # enough to balance the threads
    for seqs, nodes, first_position in runs:
        first_seg = len(ctx_segments)
        position = first_position
        for chunk, start, count in merged(nodes):
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
    return ctx_segments, items, pieces_of, num_partial_rows
