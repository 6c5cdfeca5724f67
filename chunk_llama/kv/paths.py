"""Read-only queries of the prefix tree (`PathQueries`, a mixin of `PrefixTree`): which
sequences it holds, their paths, tokens and slots, its nodes, and the keys it is split by.

A tree holds one forest per key (what computed the K/V: None for the base weights, an
adapter's identity otherwise), each under a virtual root of its own; a sequence's path
runs from its key's root and never crosses into another's. Roots are kept in the order
their keys first came, the base's first, so a depth-first walk visits each key's
sequences together.
"""

from __future__ import annotations

from collections.abc import Hashable

from chunk_llama.kv.node import ChunkNode, SeqPath
from chunk_llama.kv.retention import RetainedChunks


class PathQueries:
    """What a sequence's path holds, read from the nodes (nothing here changes the tree)."""

    _seqs: dict[int, SeqPath]
    _roots: dict[Hashable, ChunkNode]
    _retained: RetainedChunks
    _journal: list | None

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

    @property
    def num_retained(self) -> int:
        return len(self._retained)

    @property
    def num_live_chunks(self) -> int:
        return self.pool.num_used - len(self._retained)

    @property
    def in_step(self) -> bool:
        return self._journal is not None

    def is_retained(self, chunk_id: int) -> bool:
        return chunk_id in self._retained

    def retained_ids(self) -> list[int]:
        """Retained chunk ids, least recently used first."""
        return self._retained.ids()

    def keys(self) -> list[Hashable]:
        """The keys the tree holds nodes of (or has a root for), in root order."""
        return list(self._roots)

    def key_of(self, seq_id: int) -> Hashable:
        """The key a sequence was inserted under (None: the base weights)."""
        return self._seqs[seq_id].key

    def roots(self) -> list[ChunkNode]:
        """The virtual roots, one per key, in order (the base's first)."""
        return list(self._roots.values())

    def nodes(self) -> list[ChunkNode]:
        """Every node under the roots, parents before children, roots in order."""
        return _under(self.roots())

    def nodes_under(self, key: Hashable) -> list[ChunkNode]:
        """Every node of one key's forest, parents before children."""
        return _under([self._roots[key]] if key in self._roots else [])

    def preorder(self) -> dict[int, int]:
        """id(node) -> its position in a depth-first walk of every root in order."""
        return {id(node): i for i, node in enumerate(self.nodes())}

    def retained_by_key(self) -> dict[Hashable, int]:
        """Retained chunks under each key that has some."""
        out: dict[Hashable, int] = {}
        heads = set(self._retained.ids())
        for key in self._roots:
            count = sum(1 for node in self.nodes_under(key) if node.start == 0 and node.chunk_id in heads)
            if count:
                out[key] = count
        return out

    def seq_len(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def path(self, seq_id: int) -> list[ChunkNode]:
        """The nodes of a sequence, root first (its key's virtual root excluded)."""
        nodes, node = [], self._seqs[seq_id].leaf
        while node.parent is not None:
            nodes.append(node)
            node = node.parent
        nodes.reverse()
        return nodes

    def tokens(self, seq_id: int) -> list[int]:
        """The token ids of a sequence, read back from its nodes."""
        return [token for node in self.path(seq_id) for token in node.tokens]

    def segments(self, seq_id: int) -> list[tuple[int, int, int]]:
        """(chunk id, first slot, number of tokens) of the sequence's runs of K/V, in order
        (a chunk's chain of nodes on the path is one run)."""
        out: list[tuple[int, int, int]] = []
        for node in self.path(seq_id):
            if out and out[-1][0] == node.chunk_id:
                chunk, start, count = out[-1]
                out[-1] = (chunk, start, count + len(node.tokens))
            else:
                out.append((node.chunk_id, node.start, len(node.tokens)))
        return out

    def chunk_ids(self, seq_id: int) -> list[int]:
        """The chunks a sequence's K/V are in, in order."""
        return [chunk for chunk, _, _ in self.segments(seq_id)]

    def slots(self, seq_id: int, start: int, end: int) -> tuple[list[int], list[int]]:
        """(chunk id, slot in chunk) of each position in `[start, end)` of a sequence."""
        chunks, offsets = [], []
        position = 0
        for chunk, first, count in self.segments(seq_id):
            lo, hi = max(start, position), min(end, position + count)
            chunks += [chunk] * max(0, hi - lo)
            offsets += range(first + lo - position, first + hi - position)
            position += count
        return chunks, offsets


def _under(roots: list[ChunkNode]) -> list[ChunkNode]:
    """The nodes below `roots`, depth first, parents before children."""
    out, stack = [], [child for root in reversed(roots) for child in reversed(root.children.values())]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(node.children.values()))
    return out
