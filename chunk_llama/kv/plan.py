"""Decode plan (the kernel context): the tree flattened into index tensors.

Built once per change of the tree's shape and shared by every layer of a step.
Sequences are ordered depth-first by their paths, so the sequences under any
chunk are one contiguous range `[begin, end)` of query rows; that is what lets the
chunk-first phase take a slice of Q instead of a gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunk_llama.kv.tree import PrefixTree


@dataclass
class DecodePlan:
    """Index tensors for one query per sequence, sequences in depth-first order.

    shared_chunk_ids: [num_shared] pool ids of chunks on the path of >= 2 sequences
    shared_begin, shared_end: [num_shared] the row range of the sequences under each
    private_chunk_ids: [num_seqs, max_private] each sequence's own chunks, padded with 0
    num_shared_tokens: [num_seqs] tokens of the sequence held in shared chunks
    seq_lens: [num_seqs] tokens of context per sequence (advanced in place)
    pair_shared, pair_row, pair_seq: [num_pairs] every (shared chunk, sequence under it)
      with the row of the sequence inside the chunk's range
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
    max_rows_per_shared: int
    tree_version: int
    chunk_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_shared(self) -> int:
        return int(self.shared_chunk_ids.numel())

    def advance(self) -> None:
        """Every sequence gained one token and no chunk was added."""
        self.seq_lens += 1


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
    tree: PrefixTree, seq_ids: list[int], device: torch.device | str = "cpu"
) -> DecodePlan:
    """Flatten the paths of `seq_ids` into a `DecodePlan` (sequences reordered)."""
    order = depth_first_order(tree, seq_ids)
    c = tree.chunk_size
    paths = [tree.path(s) for s in order]
    num_users: dict[int, int] = {}
    for path in paths:
        for node in path:
            num_users[node.chunk_id] = num_users.get(node.chunk_id, 0) + 1

    shared_index: dict[int, int] = {}
    shared_ids: list[int] = []
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
        for node in path[:num_shared]:
            index = shared_index.get(node.chunk_id)
            if index is None:
                index = shared_index[node.chunk_id] = len(shared_ids)
                shared_ids.append(node.chunk_id)
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

    max_private = max((len(p) for p in private), default=0)
    padded = [p + [0] * (max_private - len(p)) for p in private]

    def as_tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return DecodePlan(
        seq_ids=order,
        shared_chunk_ids=as_tensor(shared_ids),
        shared_begin=as_tensor(begin),
        shared_end=as_tensor(end),
        private_chunk_ids=as_tensor(padded).reshape(len(order), max_private),
        num_shared_tokens=as_tensor(num_shared_tokens),
        seq_lens=as_tensor([tree.seq_len(s) for s in order]),
        pair_shared=as_tensor(pair_shared),
        pair_row=as_tensor(pair_row),
        pair_seq=as_tensor(pair_seq),
        max_rows_per_shared=max((e - b for b, e in zip(begin, end)), default=0),
        tree_version=tree.version,
        chunk_size=c,
    )
