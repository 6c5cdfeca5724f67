"""Decode plan (the kernel context): the tree flattened into index tensors.

Built when sequences join or leave and shared by every layer of a step. Between
rebuilds only lengths advance (on the device) and a sequence that starts a new
node gets one entry written into its private table. Sequences are ordered
depth-first by their paths, so the sequences under any node are one contiguous
range `[begin, end)` of query rows: the chunk-first phase takes a slice of Q.

The kernels read K/V by segment: a run of slots `[start, start + len)` of one chunk,
at consecutive positions. A path's consecutive nodes in one chunk with the same
sequences on them are one segment; most segments are whole chunks, a segment ends
inside a chunk where requests part (token-granular sharing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunk_llama.kv.node import ChunkNode
from chunk_llama.kv.tree import PrefixTree

PARTIAL_ROW_ALIGN = 16  # the CUDA chunk-first kernel writes 16-row tiles
NO_POSITION = 1 << 62  # private_pos past a sequence's last segment


@dataclass
class DecodePlan:
    """Index tensors for one query per sequence, sequences in depth-first order.

    shared_chunk_ids, shared_start, shared_len: [num_shared] the segments on the paths of
      >= 2 sequences: chunk, first slot, number of keys
    shared_pos: [num_shared] position of each shared segment's first key on its paths
    shared_begin, shared_end: [num_shared] the row range of the sequences under each
    private_chunk_ids, private_start, private_pos: [num_seqs, >= max_private] each
      sequence's own segments (chunk, first slot, position of the first key); unused
      entries have position NO_POSITION. A private segment runs to the next one's
      position, the last to the sequence's length.
    num_shared_tokens: [num_seqs] tokens of the sequence in shared segments
    seq_lens: [num_seqs] tokens of context per sequence (advanced in place)
    pair_shared, pair_row, pair_seq: [num_pairs] every (shared segment, sequence under it)
      with the row of the sequence inside the segment's range, grouped by sequence
    shared_depth: [num_shared] index of each shared segment among the shared segments of
      the paths through it
    seq_pair_ptr: [num_seqs + 1] sequence i's pairs are [seq_pair_ptr[i], seq_pair_ptr[i + 1]),
      in path order, so pair (segment s, sequence i) is seq_pair_ptr[i] + shared_depth[s]
    aligned: every segment is a whole chunk but each sequence's last (what the CUDA
      kernels take); device_index: their int32 copies (see `chunk_attn/params.h`), or None
    """

    seq_ids: list[int]
    shared_chunk_ids: torch.Tensor
    shared_start: torch.Tensor
    shared_len: torch.Tensor
    shared_pos: torch.Tensor
    shared_begin: torch.Tensor
    shared_end: torch.Tensor
    private_chunk_ids: torch.Tensor
    private_start: torch.Tensor
    private_pos: torch.Tensor
    num_shared_tokens: torch.Tensor
    seq_lens: torch.Tensor
    pair_shared: torch.Tensor
    pair_row: torch.Tensor
    pair_seq: torch.Tensor
    shared_depth: torch.Tensor
    seq_pair_ptr: torch.Tensor
    max_rows_per_shared: int
    structure_version: int
    chunk_size: int
    num_private: list[int]
    row_of: dict[int, int]
    aligned: bool = True
    device_index: dict[str, torch.Tensor] | None = None
    num_partial_rows: int = 0
    max_pairs_per_seq: int = 0
    max_private_tokens: int = 0  # host-side: sizes the CUDA split without reading the device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_shared(self) -> int:
        return int(self.shared_chunk_ids.numel())

    def advance(self) -> None:
        """Every sequence gained one token (a device op: no host synchronisation)."""
        self.seq_lens += 1
        self.max_private_tokens += 1
        if self.device_index is not None:
            self.device_index["seq_lens"] += 1

    def add_private_nodes(self, events: list[tuple[int, ChunkNode, int]]) -> None:
        """Record nodes appended to sequences' paths: (seq_id, node, position of its first token) each."""
        rows, cols, chunks, starts, positions = [], [], [], [], []
        for seq_id, node, position in events:
            row = self.row_of[seq_id]
            if node.start != 0 or node.parent.end != self.chunk_size:
                self.aligned = False  # it goes on in place, or after a node that ends inside a chunk
            rows.append(row)
            cols.append(self.num_private[row])
            chunks.append(node.chunk_id)
            starts.append(node.start)
            positions.append(position)
            self.num_private[row] += 1
        width = self.private_chunk_ids.shape[1]
        if max(self.num_private) > width:  # grow geometrically: rare, and never per step
            width = max(max(self.num_private), 2 * width)
            self.private_chunk_ids = _widen(self.private_chunk_ids, width, 0)
            self.private_start = _widen(self.private_start, width, 0)
            self.private_pos = _widen(self.private_pos, width, NO_POSITION)
            if self.device_index is not None:
                self.device_index["private_chunk_ids"] = _widen(self.device_index["private_chunk_ids"], width, 0)
        update = to_device([rows, cols, chunks, starts, positions], torch.long, self.seq_lens.device)
        self.private_chunk_ids[update[0], update[1]] = update[2]
        self.private_start[update[0], update[1]] = update[3]
        self.private_pos[update[0], update[1]] = update[4]
        if not self.aligned:
            self.device_index = None
        elif self.device_index is not None:
            self.device_index["private_chunk_ids"][update[0], update[1]] = update[2].int()


def _widen(table: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    wider = table.new_full((table.shape[0], width), fill)
    wider[:, : table.shape[1]] = table
    return wider


def to_device(rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Host lists to device tensors with one copy, asynchronous from pinned memory on CUDA."""
    lengths = [len(r) for r in rows]
    flat = torch.tensor([x for r in rows for x in r], dtype=dtype)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(torch.split(flat, lengths))


def depth_first_order(tree: PrefixTree, seq_ids: list[int]) -> list[int]:
    """Sort sequences by their paths' preorder positions (a prefix sorts first)."""
    preorder: dict[int, int] = {}
    stack = list(reversed(tree.root.children.values()))
    while stack:
        node = stack.pop()
        preorder[id(node)] = len(preorder)
        stack.extend(reversed(node.children.values()))
    return sorted(seq_ids, key=lambda s: [preorder[id(n)] for n in tree.path(s)])


def path_segments(path: list[ChunkNode], users: dict[int, int]) -> list[tuple[list[ChunkNode], int]]:
    """A path's segments: runs of consecutive nodes in one chunk with as many users each
    (users of a node never exceed its parent's, so such a run has the same users), with
    that count."""
    segments: list[tuple[list[ChunkNode], int]] = []
    for node in path:
        count = users[id(node)]
        if segments and segments[-1][0][-1].chunk_id == node.chunk_id and segments[-1][1] == count:
            segments[-1][0].append(node)
        else:
            segments.append(([node], count))
    return segments


def build_decode_plan(
    tree: PrefixTree, seq_ids: list[int], device: torch.device | str = "cpu", group: int = 1
) -> DecodePlan:
    """Flatten the paths of `seq_ids` into a `DecodePlan` (sequences reordered).

    `group` (query heads per KV head) sizes the CUDA partial rows; on a CUDA device
    the int32 `device_index` is built too when the plan is chunk-aligned.
    """
    device = torch.device(device)
    order = depth_first_order(tree, seq_ids)
    c = tree.chunk_size
    paths = [tree.path(s) for s in order]
    users: dict[int, int] = {}
    for path in paths:
        for node in path:
            users[id(node)] = users.get(id(node), 0) + 1

    shared_index: dict[int, int] = {}
    shared = dict(chunk=[], start=[], len=[], pos=[], depth=[], begin=[], end=[])
    pair_shared: list[int] = []
    pair_row: list[int] = []
    pair_seq: list[int] = []
    private: list[list[tuple[int, int, int]]] = []  # (chunk, start, position) per sequence
    num_shared_tokens: list[int] = []
    seq_pair_ptr = [0]
    aligned = True
    for row, path in enumerate(paths):
        position, depth, own = 0, 0, []
        segments = path_segments(path, users)
        for i, (nodes, count) in enumerate(segments):
            length = sum(len(n.tokens) for n in nodes)
            first = nodes[0]
            if count > 1:
                index = shared_index.get(id(first))
                if index is None:
                    index = shared_index[id(first)] = len(shared["chunk"])
                    for name, value in zip(shared, (first.chunk_id, first.start, length, position, depth, row, row)):
                        shared[name].append(value)
                    aligned &= first.start == 0 and length == c
                if shared["end"][index] != row:
                    raise AssertionError("sequences under a shared node are not contiguous")
                shared["end"][index] = row + 1
                pair_shared.append(index)
                pair_row.append(row - shared["begin"][index])
                pair_seq.append(row)
                depth += 1
            else:
                own.append((first.chunk_id, first.start, position))
                aligned &= first.start == 0 and (length == c or i == len(segments) - 1)
            position += length
        private.append(own)
        num_shared_tokens.append(own[0][2] if own else position)
        seq_pair_ptr.append(seq_pair_ptr[-1] + depth)

    num_private = [len(p) for p in private]
    width = max(num_private, default=0) + 1  # at least one unused entry: its position ends the walk
    tables = [[], [], []]
    for own in private:
        pad = width - len(own)
        for table, column, fill in zip(tables, range(3), (0, 0, NO_POSITION)):
            table.extend([entry[column] for entry in own] + [fill] * pad)
    seq_lens = [tree.seq_len(s) for s in order]
    fields = [shared["chunk"], shared["start"], shared["len"], shared["pos"], shared["begin"], shared["end"],
              *tables, num_shared_tokens, seq_lens, pair_shared, pair_row, pair_seq, shared["depth"], seq_pair_ptr]
    t = to_device(fields, torch.long, device)
    n = len(order)
    plan = DecodePlan(
        seq_ids=order,
        shared_chunk_ids=t[0], shared_start=t[1], shared_len=t[2], shared_pos=t[3], shared_begin=t[4],
        shared_end=t[5],
        private_chunk_ids=t[6].reshape(n, width), private_start=t[7].reshape(n, width),
        private_pos=t[8].reshape(n, width),
        num_shared_tokens=t[9], seq_lens=t[10], pair_shared=t[11], pair_row=t[12], pair_seq=t[13],
        shared_depth=t[14], seq_pair_ptr=t[15],
        max_rows_per_shared=max((e - b for b, e in zip(shared["begin"], shared["end"])), default=0),
        structure_version=tree.structure_version,
        chunk_size=c,
        num_private=num_private,
        row_of={s: r for r, s in enumerate(order)},
        aligned=aligned,
        max_private_tokens=max((n - k for n, k in zip(seq_lens, num_shared_tokens)), default=0),
    )
    if device.type == "cuda" and aligned:
        _add_device_index(plan, shared, pair_shared, pair_row, tables[0], num_shared_tokens, seq_lens, seq_pair_ptr,
                          group, width)
    return plan


def _add_device_index(plan, shared, pair_shared, pair_row, private_ids, num_shared_tokens, seq_lens, seq_pair_ptr,
                      group, width) -> None:
    """The CUDA kernels' int32 copies of an aligned plan (shared chunk s holds positions
    shared_depth[s] * chunk_size ..): partial rows per KV head, each shared chunk's rows
    padded to 16, and a CSR list of each sequence's partial rows."""
    row_offset, total = [], 0
    for b, e in zip(shared["begin"], shared["end"]):
        row_offset.append(total)
        total += -(-(e - b) * group // PARTIAL_ROW_ALIGN) * PARTIAL_ROW_ALIGN
    partial_rows = [row_offset[s] + r * group for s, r in zip(pair_shared, pair_row)]
    names = ["shared_chunk_ids", "shared_begin", "shared_end", "shared_row_offset", "shared_depth",
             "private_chunk_ids", "num_shared_tokens", "seq_lens", "seq_partial_ptr", "seq_partial_rows"]
    values = [shared["chunk"], shared["begin"], shared["end"], row_offset, shared["depth"], private_ids,
              num_shared_tokens, seq_lens, seq_pair_ptr, partial_rows]
    plan.device_index = dict(zip(names, to_device(values, torch.int32, plan.seq_lens.device)))
    plan.device_index["private_chunk_ids"] = plan.device_index["private_chunk_ids"].reshape(plan.num_seqs, width)
    plan.num_partial_rows = total
    plan.max_pairs_per_seq = max((seq_pair_ptr[i + 1] - seq_pair_ptr[i] for i in range(plan.num_seqs)), default=0)
