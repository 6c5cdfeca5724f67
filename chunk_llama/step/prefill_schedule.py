"""The CPU prefill kernel's work for one step: context runs and tiles (host lists).

Where the new tokens of several sequences all see the same leading nodes whole (their
common prefix, cached or written by another sequence of this forward), those sequences'
tokens, packed next to each other, form one run of query rows that folds the whole blocks
of keys of that prefix at once (csrc/cpu/blocks.h: blocks of KEY_BLOCK keys at fixed
positions), each row leaving its state (o, m, n): the chunk-first idea applied to prefill.
Tiles then start each sequence's rows from that state and fold the rest of its blocks (its
own part of the path, causal on its new tokens). A row's blocks are folded in position
order either way, so its result does not depend on which sequences came with it.
"""

from __future__ import annotations

# csrc/cpu/params.h kRowsPerItem: the most query rows (tokens x GQA group) one kernel
# work item holds; the glue rejects wider tiles.
ROWS_PER_TILE = 128
# The widest register block of rows of any CPU variant (AVX-512: 2 vectors of 16).
BLOCK_ROWS = 32
# csrc/cpu/params.h kBlockKeys: the keys of one block; a context ends on a block's edge.
KEY_BLOCK = 64
# csrc/cpu/prefill_params.h kNoState: a context item that starts from nothing (offsets can be negative).
NO_STATE = -(1 << 62)

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
    """The context phase's work: for each sequence, the runs of its path's leading nodes that
    it reads together with its neighbours. A node qualifies for the sequences whose new tokens
    all come after it; those of them packed next to each other (consecutive in token order, 2
    or more, whose rows fill register blocks better together) read it together. A run is the
    nodes one such group reads in a row, from where the group of the run before it (a wider
    one) stopped, in whole blocks of keys: [first, end) with both multiples of KEY_BLOCK (a
    run within one block is dropped; its keys go to the next run, or the tiles). Returns
    [(sequences, level, first, end)], a run's level its index on its sequences' paths (it
    starts from the state the run before it left), and each sequence's ctx_end."""
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
        position, spans = 0, []  # (group, end) of each group's nodes along the path
        for node in paths[s]:
            readers_of_node = group_of.get((node[0], s))
            if readers_of_node is None:
                break
            if not spans or spans[-1][0] != readers_of_node:
                spans.append([readers_of_node, 0])
            position += node[3]
            spans[-1][1] = position
        first = 0
        for readers_of_span, end in spans:
            end = end // KEY_BLOCK * KEY_BLOCK
            if end <= first:  # within the block the run before it reached: its keys go on
                continue
            if (readers_of_span, first) not in seen:  # the group's first sequence makes the run
                seen.add((readers_of_span, first))
                runs.append((readers_of_span, sum(1 for r in runs if set(readers_of_span) <= set(r[0])), first, end))
            first = ctx_end[s] = end
    return runs, ctx_end


def context_work(runs, segments: list[Segment], group: int):
    """The context runs in items of at most ROWS_PER_TILE rows, level by level (a run starts
    from the states its sequences' run before it left). Returns the items (sequence whose path
    holds the keys, first block, end block, row_begin, row_end, partial offset of their states,
    partial offset of the states they start from or NO_STATE), the index of each level's first item
    (and the end), each sequence's partial offset (its last run's; none without a run), and
    the number of partial rows."""
    items: list[tuple[int, ...]] = []
    levels = [0]
    last_offset: dict[int, int] = {}  # sequence -> the partial offset of its run so far
    num_partial_rows = 0
    for level in sorted({run[1] for run in runs}):
        for seqs, _, first, end in (run for run in runs if run[1] == level):
            token_begin = segments[seqs[0]][0]
            token_end = segments[seqs[-1]][0] + segments[seqs[-1]][2]
            offset = num_partial_rows - token_begin
            num_partial_rows += token_end - token_begin
            start = last_offset.get(seqs[0], NO_STATE) if first else NO_STATE
            for row in range(token_begin * group, token_end * group, ROWS_PER_TILE):
                items.append((seqs[0], first // KEY_BLOCK, end // KEY_BLOCK, row,
                              min(token_end * group, row + ROWS_PER_TILE), offset, start))
            for s in seqs:
                last_offset[s] = offset
        levels.append(len(items))
    pieces_of = [[last_offset[s]] if s in last_offset else [] for s in range(len(segments))]
    return items, levels, pieces_of, num_partial_rows
