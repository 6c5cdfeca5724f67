"""The records the prefix tree is made of: nodes, sequence paths, and the journal
entries that let a failed step be rolled back."""

from __future__ import annotations

from dataclasses import dataclass


class ChunkNode:
    """A run of tokens whose K/V sit in slots `[start, end)` of one pool chunk.

    A chunk holds a chain of nodes from slot 0: its head (`start == 0`), then at most
    one in-place child of each node (a child in the same chunk, starting where its
    parent ends), and so on. Such a chain appears where requests diverge inside a
    chunk: the node is split at the token where they part, the shared part keeps the
    slots it had, and the rest stays in place as its child. A root is virtual
    (`chunk_id == -1`, no tokens, no parent): one per key of the tree.
    """

    __slots__ = ("chunk_id", "start", "tokens", "parent", "children", "by_token", "num_seqs", "stale")

    def __init__(self, chunk_id: int, start: int, parent: "ChunkNode | None"):
        self.chunk_id = chunk_id
        self.start = start
        self.tokens: list[int] = []
        self.parent = parent
        # Children by `key` (insertion ordered: iteration is deterministic), and the
        # same children by their first token: the index lookups by content use.
        self.children: dict[tuple[int, int], ChunkNode] = {}
        self.by_token: dict[int, list[ChunkNode]] = {}
        self.num_seqs = 0  # live sequences whose path runs through this node
        self.stale = False  # computed under weights that changed since: never matched again

    @property
    def key(self) -> tuple[int, int]:
        return self.chunk_id, self.start

    @property
    def end(self) -> int:
        """The slot after the node's last token."""
        return self.start + len(self.tokens)

    def add_child(self, child: "ChunkNode") -> None:
        self.children[child.key] = child
        self.by_token.setdefault(child.tokens[0], []).append(child)

    def remove_child(self, child: "ChunkNode") -> None:
        del self.children[child.key]
        same = self.by_token[child.tokens[0]]
        same.remove(child)
        if not same:
            del self.by_token[child.tokens[0]]

    def replace_child(self, old: "ChunkNode", new: "ChunkNode") -> None:
        """Put `new` where `old` was (same key and first token: a split or its undoing)."""
        self.children[old.key] = new
        same = self.by_token[old.tokens[0]]
        same[same.index(old)] = new

    def in_place_child(self) -> "ChunkNode | None":
        """The child that continues in this node's chunk, if any."""
        return self.children.get((self.chunk_id, self.end))

    def __repr__(self) -> str:
        return f"ChunkNode(chunk={self.chunk_id}, slots={self.start}..{self.end}, seqs={self.num_seqs})"


class SeqPath:
    """A live sequence: the last node of its path, how many tokens the path holds, and the
    key it was inserted under (what computes its K/V)."""

    __slots__ = ("leaf", "length", "key")

    def __init__(self, leaf: ChunkNode, length: int, key=None) -> None:
        self.leaf = leaf
        self.length = length
        self.key = key


@dataclass
class InsertRecord:
    """Journal: sequence `seq_id` was inserted, sharing the first `num_shared` nodes of its
    path (the rest it started). `revived` are the retained chunks it took out of the
    prefix cache, each with its LRU stamp from before, so a rollback puts them back in place."""

    seq_id: int
    num_shared: int
    revived: list[tuple[ChunkNode, int]]


@dataclass
class GrowRecord:
    """Journal: sequence `seq_id` grew from `length` tokens, its last node then `leaf`
    holding `leaf_tokens` of them."""

    seq_id: int
    length: int
    leaf: ChunkNode
    leaf_tokens: int


@dataclass
class SplitRecord:
    """Journal: `head` was split off the front of `node` (which kept the rest)."""

    head: ChunkNode
    node: ChunkNode
