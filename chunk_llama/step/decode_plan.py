"""Decode plan: the tree flattened into the index arrays the decode kernels read.

Built when sequences join or leave and shared by every layer of a step. Between
rebuilds only lengths advance (on the device) and a sequence that starts a new
node gets one entry written into its private table. Sequences are ordered
depth-first by their paths, so the sequences under any node are one contiguous
range `[begin, end)` of query rows: the chunk-first phase takes a slice of Q.

The kernels read K/V by segment: a run of slots `[start, start + len)` of one chunk,
at consecutive positions. A path's consecutive nodes in one chunk with the same
sequences on them are one segment; most segments are whole chunks, a segment ends
inside a chunk where requests part (token-granular sharing).

Every array lives in one int64 tensor (`index`, at a fixed address between rebuilds
when the builder passes its `StaticBuffers`); `layout` is what the CPU kernel takes
with it (`csrc/cpu/plan_layout.h`). A chunk-aligned plan on a GPU also holds the CUDA
kernels' int32 arrays (`cuda_index`, `cuda_layout`: `cuda_plan.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chunk_llama.kv.node import ChunkNode
from chunk_llama.kv.tree import PrefixTree
from chunk_llama.step.buffers import StaticBuffers, pack, to_device
from chunk_llama.step.cuda_plan import CUDA_COUNTS, add_cuda_index

NO_POSITION = 1 << 62  # private_pos past a sequence's last segment (csrc: kNoPosition)

# The arrays the CPU decode op reads, in the order of csrc/cpu/plan_layout.h (DecodeLayout).
DECODE_ARRAYS = ("shared_chunk_ids", "shared_start", "shared_len", "shared_pos", "shared_begin", "shared_end",
                 "shared_depth", "private_chunk_ids", "private_start", "private_pos", "num_shared_tokens",
                 "seq_lens", "seq_pair_ptr")
# The reference's arrays besides them: every (shared segment, sequence under it) pair.
PAIR_ARRAYS = ("pair_shared", "pair_row", "pair_seq")
PRIVATE_TABLES = ("private_chunk_ids", "private_start", "private_pos")


@dataclass
class DecodePlan:
    """Index arrays for one query per sequence, sequences in depth-first order; each a
    view of `index`.

    shared_chunk_ids, shared_start, shared_len: [num_shared] the segments on the paths of
      >= 2 sequences: chunk, first slot, number of keys
    shared_pos: [num_shared] position of each shared segment's first key on its paths
    shared_begin, shared_end: [num_shared] the row range of the sequences under each
    shared_depth: [num_shared] index of each shared segment among the shared segments of
      the paths through it
    private_chunk_ids, private_start, private_pos: [num_seqs, width] each sequence's own
      segments (chunk, first slot, position of the first key); unused entries have
      position NO_POSITION. A private segment runs to the next one's position, the last
      to the sequence's length.
    num_shared_tokens: [num_seqs] tokens of the sequence in shared segments
    seq_lens: [num_seqs] tokens of context per sequence (advanced in place)
    seq_pair_ptr: [num_seqs + 1] sequence i's pairs are [seq_pair_ptr[i], seq_pair_ptr[i + 1]),
      in path order, so pair (segment s, sequence i) is seq_pair_ptr[i] + shared_depth[s]
    pair_shared, pair_row, pair_seq: [num_pairs] every (shared segment, sequence under it)
      with the row of the sequence inside the segment's range, grouped by sequence
    aligned: every segment is a whole chunk but each sequence's last (what the CUDA
      kernels take); then, on a GPU, `cuda_index` / `cuda_layout` hold their arrays
    """

    seq_ids: list[int]
    arrays: dict[str, list[int]]  # host copies (the private tables flattened row by row)
    width: int
    max_rows_per_shared: int
    structure_version: int
    chunk_size: int
    num_private: list[int]
    row_of: dict[int, int]
    device: torch.device
    group: int = 1
    aligned: bool = True
    buffers: StaticBuffers | None = None
    index: torch.Tensor = field(init=False)
    layout: list[int] = field(init=False)
    cuda_index: torch.Tensor | None = None
    cuda_layout: list[int] | None = None
    cuda_arrays: dict[str, torch.Tensor] = field(default_factory=dict)  # views of cuda_index
    max_private_tokens: int = 0  # host-side: sizes the CUDA split without reading the device
    num_advances: int = 0  # tokens every sequence gained since the host arrays were made

    def __post_init__(self):
        self._pack()

    def _pack(self) -> None:
        """All arrays into `index`, and a view of it for each."""
        self.index, offsets = pack({k: self.arrays[k] for k in DECODE_ARRAYS + PAIR_ARRAYS}, torch.long,
                                   self.device, self.buffers, "decode_plan")
        n = self.num_seqs
        for name in DECODE_ARRAYS + PAIR_ARRAYS:
            view = self.index[offsets[name]: offsets[name] + len(self.arrays[name])]
            setattr(self, name, view.view(n, self.width) if name in PRIVATE_TABLES else view)
        self.layout = [n, self.num_shared, self.width] + [offsets[name] for name in DECODE_ARRAYS]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_shared(self) -> int:
        return len(self.arrays["shared_chunk_ids"])

    @property
    def num_pairs(self) -> int:
        return len(self.arrays["pair_seq"])

    def to(self, device: torch.device | str) -> "DecodePlan":
        """A copy of this plan on `device` (its arrays repacked there; for the layers of a model
        split over devices). The copy is read, never advanced."""
        device = torch.device(device)
        arrays = dict(self.arrays, seq_lens=[n + self.num_advances for n in self.arrays["seq_lens"]])
        plan = DecodePlan(seq_ids=self.seq_ids, arrays=arrays, width=self.width,
                          max_rows_per_shared=self.max_rows_per_shared, structure_version=self.structure_version,
                          chunk_size=self.chunk_size, num_private=list(self.num_private), row_of=self.row_of,
                          device=device, group=self.group, aligned=self.aligned,
                          max_private_tokens=self.max_private_tokens)
        if device.type == "cuda" and plan.aligned:
            add_cuda_index(plan)
        return plan

    def advance(self) -> None:
        """Every sequence gained one token (a device op: no host synchronisation)."""
        self.seq_lens += 1
        self.max_private_tokens += 1
        self.num_advances += 1
        if self.cuda_index is not None:
            self.cuda_arrays["seq_lens"] += 1
            self.cuda_layout[CUDA_COUNTS.index("max_private_tokens")] = self.max_private_tokens

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
        if max(self.num_private) > self.width:  # grow geometrically: rare, and never per step
            self._widen(max(max(self.num_private), 2 * self.width))
        update = to_device([rows, cols, chunks, starts, positions], torch.long, self.device)
        for name, values in zip(PRIVATE_TABLES, update[2:]):
            getattr(self, name)[update[0], update[1]] = values
        for row, col, *values in zip(rows, cols, chunks, starts, positions):
            for name, value in zip(PRIVATE_TABLES, values):
                self.arrays[name][row * self.width + col] = value
        if not self.aligned:
            self.cuda_index = self.cuda_layout = None
            self.cuda_arrays = {}
        elif self.cuda_index is not None:
            self.cuda_arrays["private_chunk_ids"].view(self.num_seqs, self.width)[update[0], update[1]] = \
                update[2].int()

    def _widen(self, width: int) -> None:
        """Private tables of `width` entries per sequence, repacked from the host arrays."""
        self.arrays["seq_lens"] = [n + self.num_advances for n in self.arrays["seq_lens"]]
        self.num_advances = 0
        for name, fill in zip(PRIVATE_TABLES, (0, 0, NO_POSITION)):
            old = self.arrays[name]
            self.arrays[name] = [row[i] if i < self.width else fill
                                 for r in range(self.num_seqs) for row in [old[r * self.width: (r + 1) * self.width]]
                                 for i in range(width)]
        self.width = width
        self._pack()
        if self.cuda_index is not None:
            add_cuda_index(self)


def depth_first_order(tree: PrefixTree, seq_ids: list[int]) -> list[int]:
    """Sort sequences by their paths' preorder positions (a prefix sorts first; the keys'
    forests one after another, so the sequences of one key are one range of rows too)."""
    preorder = tree.preorder()
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


def build_decode_plan(tree: PrefixTree, seq_ids: list[int], device: torch.device | str = "cpu", group: int = 1,
                      buffers: StaticBuffers | None = None) -> DecodePlan:
    """Flatten the paths of `seq_ids` into a `DecodePlan` (sequences reordered).

    `group` (query heads per KV head) sizes the CUDA partial rows; on a CUDA device
    the int32 arrays are built too when the plan is chunk-aligned. `buffers`: where the
    index lives (the step builder's, at a fixed address), else a new tensor.
    """
    device = torch.device(device)
    order = depth_first_order(tree, seq_ids)
    c = tree.chunk_size
    paths = [tree.path(s) for s in order]
    users: dict[int, int] = {}
    for path in paths:
        for node in path:
            users[id(node)] = users.get(id(node), 0) + 1

    a: dict[str, list[int]] = {name: [] for name in DECODE_ARRAYS + PAIR_ARRAYS}
    shared_index: dict[int, int] = {}
    private: list[list[tuple[int, int, int]]] = []  # (chunk, start, position) per sequence
    a["seq_pair_ptr"].append(0)
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
                    index = shared_index[id(first)] = len(a["shared_chunk_ids"])
                    for name, value in zip(DECODE_ARRAYS[:7], (first.chunk_id, first.start, length, position, row,
                                                               row, depth)):
                        a[name].append(value)
                    aligned &= first.start == 0 and length == c
                if a["shared_end"][index] != row:
                    raise AssertionError("sequences under a shared node are not contiguous")
                a["shared_end"][index] = row + 1
                a["pair_shared"].append(index)
                a["pair_row"].append(row - a["shared_begin"][index])
                a["pair_seq"].append(row)
                depth += 1
            else:
                own.append((first.chunk_id, first.start, position))
                aligned &= first.start == 0 and (length == c or i == len(segments) - 1)
            position += length
        private.append(own)
        a["num_shared_tokens"].append(own[0][2] if own else position)
        a["seq_pair_ptr"].append(a["seq_pair_ptr"][-1] + depth)

    num_private = [len(p) for p in private]
    width = max(num_private, default=0) + 1  # at least one unused entry: its position ends the walk
    for own in private:
        pad = width - len(own)
        for name, column, fill in zip(PRIVATE_TABLES, range(3), (0, 0, NO_POSITION)):
            a[name].extend([entry[column] for entry in own] + [fill] * pad)
    a["seq_lens"] = [tree.seq_len(s) for s in order]
    plan = DecodePlan(
        seq_ids=order, arrays=a, width=width,
        max_rows_per_shared=max((e - b for b, e in zip(a["shared_begin"], a["shared_end"])), default=0),
        structure_version=tree.structure_version, chunk_size=c, num_private=num_private,
        row_of={s: r for r, s in enumerate(order)}, device=device, group=group, aligned=aligned, buffers=buffers,
        max_private_tokens=max((n - k for n, k in zip(a["seq_lens"], a["num_shared_tokens"])), default=0),
    )
    if device.type == "cuda" and aligned:
        add_cuda_index(plan)
    return plan
