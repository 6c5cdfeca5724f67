"""Decode plan (the kernel context): the tree flattened into index tensors.

Built when sequences join or leave and shared by every layer of a step. Between
rebuilds only lengths advance (on the device) and a sequence that starts a new
chunk gets one entry written into its private-chunk table. Sequences are ordered
depth-first by their paths, so the sequences under any chunk are one contiguous
range `[begin, end)` of query rows: the chunk-first phase takes a slice of Q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunk_llama.kv.tree import PrefixTree

PARTIAL_ROW_ALIGN = 16  # the CUDA chunk-first kernel writes 16-row tiles


@dataclass
class DecodePlan:
    """Index tensors for one query per sequence, sequences in depth-first order.

    shared_chunk_ids: [num_shared] pool ids of chunks on the path of >= 2 sequences
    shared_begin, shared_end: [num_shared] the row range of the sequences under each
    private_chunk_ids: [num_seqs, >= max_private] each sequence's own chunks, padded with 0
    num_shared_tokens: [num_seqs] tokens of the sequence held in shared chunks
    seq_lens: [num_seqs] tokens of context per sequence (advanced in place)
    pair_shared, pair_row, pair_seq: [num_pairs] every (shared chunk, sequence under it)
      with the row of the sequence inside the chunk's range, grouped by sequence
    shared_depth: [num_shared] position of each shared chunk on the paths through it
    seq_pair_ptr: [num_seqs + 1] sequence i's pairs are [seq_pair_ptr[i], seq_pair_ptr[i + 1]),
      in path order, so pair (chunk s, sequence i) is seq_pair_ptr[i] + shared_depth[s]
    device_index: int32 copies for the CUDA kernels (see `chunk_attn/params.h`), or None
    """

    seq_ids: list[int]
    shared_chunk_ids: torch.Tensor
    shared_begin: torch.Tensor
    shared_end: torch.Tensor
    private_chunk_ids: torch.Tensor
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

    def add_private_chunks(self, events: list[tuple[int, int]]) -> None:
        """Record chunks appended to sequences' private tails: (seq_id, chunk_id) each."""
        rows, cols, ids = [], [], []
        for seq_id, chunk_id in events:
            row = self.row_of[seq_id]
            rows.append(row)
            cols.append(self.num_private[row])
            ids.append(chunk_id)
            self.num_private[row] += 1
        width = self.private_chunk_ids.shape[1]
        if max(self.num_private) > width:  # grow geometrically: rare, and never per step
            self.private_chunk_ids = _widen(self.private_chunk_ids, max(max(self.num_private), 2 * width))
            if self.device_index is not None:
                self.device_index["private_chunk_ids"] = _widen(
                    self.device_index["private_chunk_ids"], self.private_chunk_ids.shape[1]
                )
        update = to_device([rows, cols, ids], torch.long, self.seq_lens.device)
        self.private_chunk_ids[update[0], update[1]] = update[2]
        if self.device_index is not None:
            self.device_index["private_chunk_ids"][update[0], update[1]] = update[2].int()


def _widen(table: torch.Tensor, width: int) -> torch.Tensor:
    wider = table.new_zeros(table.shape[0], width)
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
        preorder[node.chunk_id] = len(preorder)
        stack.extend(reversed(node.children.values()))
    return sorted(seq_ids, key=lambda s: [preorder[n.chunk_id] for n in tree.path(s)])


def build_decode_plan(
    tree: PrefixTree, seq_ids: list[int], device: torch.device | str = "cpu", group: int = 1
) -> DecodePlan:
    """Flatten the paths of `seq_ids` into a `DecodePlan` (sequences reordered).

    `group` (query heads per KV head) sizes the CUDA partial rows; on a CUDA device
    the int32 `device_index` is built too.
    """
    device = torch.device(device)
    order = depth_first_order(tree, seq_ids)
    c = tree.chunk_size
    paths = [tree.path(s) for s in order]
    num_users: dict[int, int] = {}
    for path in paths:
        for node in path:
            num_users[node.chunk_id] = num_users.get(node.chunk_id, 0) + 1

    shared_index: dict[int, int] = {}
    shared_ids: list[int] = []
    shared_depth: list[int] = []
    begin: list[int] = []
    end: list[int] = []
    pair_shared: list[int] = []
    pair_row: list[int] = []
    pair_seq: list[int] = []
    private: list[list[int]] = []
    num_shared_tokens: list[int] = []
    for row, path in enumerate(paths):
        num_shared = 0
        while num_shared < len(path) and num_users[path[num_shared].chunk_id] > 1:
            num_shared += 1
        for depth, node in enumerate(path[:num_shared]):
            index = shared_index.get(node.chunk_id)
            if index is None:
                index = shared_index[node.chunk_id] = len(shared_ids)
                shared_ids.append(node.chunk_id)
                shared_depth.append(depth)
                begin.append(row)
                end.append(row)
            if end[index] != row:
                raise AssertionError("sequences under a shared chunk are not contiguous")
            end[index] = row + 1
            pair_shared.append(index)
            pair_row.append(row - begin[index])
            pair_seq.append(row)
        private.append([node.chunk_id for node in path[num_shared:]])
        num_shared_tokens.append(num_shared * c)

    num_private = [len(p) for p in private]
    width = max(num_private, default=0)
    padded = [x for p in private for x in p + [0] * (width - len(p))]
    seq_lens = [tree.seq_len(s) for s in order]
    seq_pair_ptr = [0]
    for n_shared in num_shared_tokens:
        seq_pair_ptr.append(seq_pair_ptr[-1] + n_shared // c)
    fields = [shared_ids, begin, end, padded, num_shared_tokens, seq_lens, pair_shared, pair_row, pair_seq,
              shared_depth, seq_pair_ptr]
    t = to_device(fields, torch.long, device)
    plan = DecodePlan(
        seq_ids=order,
        shared_chunk_ids=t[0],
        shared_begin=t[1],
        shared_end=t[2],
        private_chunk_ids=t[3].reshape(len(order), width),
        num_shared_tokens=t[4],
        seq_lens=t[5],
        pair_shared=t[6],
        pair_row=t[7],
        pair_seq=t[8],
        shared_depth=t[9],
        seq_pair_ptr=t[10],
        max_rows_per_shared=max((e - b for b, e in zip(begin, end)), default=0),
        structure_version=tree.structure_version,
        chunk_size=c,
        num_private=num_private,
        row_of={s: r for r, s in enumerate(order)},
        max_private_tokens=max((n - k for n, k in zip(seq_lens, num_shared_tokens)), default=0),
    )
    if device.type == "cuda":
        # Partial rows per KV head: chunk s owns rows [row_offset[s], +(end-begin)*group) padded to 16.
        row_offset, total = [], 0
        for b, e in zip(begin, end):
            row_offset.append(total)
            total += -(-(e - b) * group // PARTIAL_ROW_ALIGN) * PARTIAL_ROW_ALIGN
        partial_rows = [row_offset[s] + r * group for s, r in zip(pair_shared, pair_row)]
        names = ["shared_chunk_ids", "shared_begin", "shared_end", "shared_row_offset", "shared_depth",
                 "private_chunk_ids", "num_shared_tokens", "seq_lens", "seq_partial_ptr", "seq_partial_rows"]
        values = [shared_ids, begin, end, row_offset, shared_depth, padded, num_shared_tokens, seq_lens, seq_pair_ptr,
                  partial_rows]
        plan.device_index = dict(zip(names, to_device(values, torch.int32, device)))
        plan.device_index["private_chunk_ids"] = plan.device_index["private_chunk_ids"].reshape(len(order), width)
        plan.num_partial_rows = total
        plan.max_pairs_per_seq = max(n_shared // c for n_shared in num_shared_tokens) if order else 0
    return plan
