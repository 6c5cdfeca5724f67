"""The records the prefix tree is made of: chunk nodes, sequence paths, pending copies,
and the journal entries that let a failed step be rolled back."""

from __future__ import annotations

from dataclasses import dataclass


class ChunkNode:
    """One chunk of the tree. The root is virtual (`chunk_id == -1`, no tokens)."""

    __slots__ = ("chunk_id", "tokens", "parent", "children", "full_children")

    def __init__(self, chunk_id: int, parent: "ChunkNode | None"):
        self.chunk_id = chunk_id
        self.tokens: list[int] = []
        self.parent = parent
        # Every child, by chunk id (insertion ordered, so iteration is deterministic).
        self.children: dict[int, ChunkNode] = {}
        # Full children by token content: the index used to share chunks.
        self.full_children: dict[tuple[int, ...], ChunkNode] = {}

    def is_indexed(self) -> bool:
        """Whether a lookup by content finds this node (a duplicate full chunk is not found)."""
        return self.parent.full_children.get(tuple(self.tokens)) is self

    def __repr__(self) -> str:
        return f"ChunkNode(id={self.chunk_id}, num_tokens={len(self.tokens)})"


@dataclass
class PendingCopy:
    """Copy slots `[0, num_tokens)` of chunk `src` into chunk `dst` (every layer)."""

    src: int
    dst: int
    num_tokens: int


class SeqPath:
    """A live sequence: its chunks root first, and how many tokens they hold."""

    __slots__ = ("nodes", "length")

    def __init__(self) -> None:
        self.nodes: list[ChunkNode] = []
        self.length = 0


@dataclass
class InsertRecord:
    """Journal: sequence `seq_id` was inserted. `revived` are the retained chunks it took
    out of the prefix cache and `touched` the retained copy sources it refreshed,
    each with its LRU stamp from before, so a rollback puts them back in place."""

    seq_id: int
    revived: list[tuple[ChunkNode, int]]
    touched: list[tuple[ChunkNode, int]]


@dataclass
class GrowRecord:
    """Journal: sequence `seq_id` grew from `length` tokens held in `num_nodes` chunks."""

    seq_id: int
    length: int
    num_nodes: int
