"""Retained chunks (chunks no live sequence uses, kept as a prefix cache: full ones
findable by content and shared again, a finished sequence's partly filled last chunk
as a leaf that inserts copy matching slots from) and their eviction (`Eviction`, a
mixin of `PrefixTree`).

Kept in least-recently-used order. A chunk is retained when its last sequence
leaves, and a sequence's chunks are retained deepest first, so an ancestor is
always more recent than its retained descendants: the oldest entries are leaves,
and one pass in LRU order can evict a leaf and later meet its parent as a leaf.
Every entry carries a stamp from a monotonic clock, so entries taken out by a step
that is rolled back go back to exactly their old places.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from chunk_llama.kv.node import ChunkNode
from chunk_llama.kv.pool import KVCacheFull


class RetainedChunks:
    """The LRU set of retained chunks (chunk id -> node), oldest first."""

    def __init__(self) -> None:
        self._lru: OrderedDict[int, tuple[ChunkNode, int]] = OrderedDict()
        self._clock = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, chunk_id: int) -> bool:
        return chunk_id in self._lru

    def ids(self) -> list[int]:
        """Chunk ids, least recently used first."""
        return list(self._lru)

    def node(self, chunk_id: int) -> ChunkNode:
        return self._lru[chunk_id][0]

    def stamp(self, chunk_id: int) -> int:
        return self._lru[chunk_id][1]

    def add(self, node: ChunkNode) -> None:
        """Retain a chunk as the most recently used."""
        self._clock += 1
        self._lru[node.chunk_id] = (node, self._clock)

    def pop(self, chunk_id: int) -> tuple[ChunkNode, int] | None:
        """Take a chunk out (revived or evicted); returns (node, stamp) or None if not retained."""
        return self._lru.pop(chunk_id, None)

    def touch(self, chunk_id: int) -> None:
        """Mark a retained chunk as just used. Only for a chunk whose ancestors are all
        live (none retained), so that ancestors stay more recent than descendants."""
        node, _ = self._lru.pop(chunk_id)
        self.add(node)

    def restore(self, entries: list[tuple[ChunkNode, int]]) -> None:
        """Put back entries taken out since their stamps were issued, in their old places."""
        if not entries:
            return
        for node, stamp in entries:
            self._lru[node.chunk_id] = (node, stamp)
        self._lru = OrderedDict(sorted(self._lru.items(), key=lambda item: item[1][1]))

    def evictable(self, blocked: set[int]) -> Iterator[ChunkNode]:
        """Leaves not in `blocked`, least recently used first. Evicting a yielded node
        before asking for the next may turn its parent into a leaf, met later in the pass."""
        for chunk_id in list(self._lru):
            entry = self._lru.get(chunk_id)
            if entry is not None and not entry[0].children and chunk_id not in blocked:
                yield entry[0]


class Eviction:
    """Mixin of `PrefixTree`: which retained chunks may go, making room by evicting them,
    and releasing chunks (with the retained chunks under them) back to the pool."""

    _retained: RetainedChunks

    def num_available(self) -> int:
        """Chunks an allocation can get: free ones plus evictable retained ones."""
        return self.pool.num_free + len(self._retained) - len(self._blocked())

    def evict_all(self) -> int:
        """Drop every retained chunk that nothing protects; returns how many."""
        before = len(self._retained)
        self._make_room(self.num_available(), self._blocked())
        return before - len(self._retained)

    def _blocked(self, *nodes: ChunkNode | None) -> set[int]:
        """Retained chunks that may not be evicted now: those on the paths to `nodes`
        and to the chunks queued copies read or write in the next forward pass."""
        ends = [i for c in self._pending_copies for i in (c.src, c.dst) if i in self._retained]
        starts = [n for n in nodes if n is not None] + [self._retained.node(i) for i in ends]
        blocked: set[int] = set()
        for node in starts:
            while node is not self.root and node.chunk_id in self._retained and node.chunk_id not in blocked:
                blocked.add(node.chunk_id)
                node = node.parent
        return blocked

    def _reserve(self, num_chunks: int, what: str) -> None:
        """Make `num_chunks` free (evicting) or raise `KVCacheFull` with nothing changed."""
        if num_chunks > self.pool.num_free:
            blocked = self._blocked()
            available = self.pool.num_free + len(self._retained) - len(blocked)
            if num_chunks > available:
                raise KVCacheFull(f"need {num_chunks} free chunks {what}, {available} available")
            self._make_room(num_chunks, blocked)

    def _make_room(self, num_chunks: int, blocked: set[int]) -> None:
        """Evict least recently used retained leaves until `num_chunks` are free (one pass)."""
        if self.pool.num_free >= num_chunks:
            return
        for victim in self._retained.evictable(blocked):
            self._retained.pop(victim.chunk_id)
            self._release(victim)
            self.num_evicted += 1
            if self.pool.num_free >= num_chunks:
                return
        raise RuntimeError("no evictable retained chunk although the capacity check passed")

    @staticmethod
    def _subtree_ids(node: ChunkNode) -> set[int]:
        """Chunk ids of a node and everything under it (what `_release` would free)."""
        ids, stack = set(), [node]
        while stack:
            node = stack.pop()
            ids.add(node.chunk_id)
            stack.extend(node.children.values())
        return ids

    def _unindex(self, node: ChunkNode) -> None:
        """Take a node out of its parent's content index (a duplicate sibling takes over)."""
        parent, key = node.parent, tuple(node.tokens)
        if parent.full_children.get(key) is not node:
            return
        del parent.full_children[key]
        for sibling in parent.children.values():
            if sibling is not node and len(sibling.tokens) == self.chunk_size and tuple(sibling.tokens) == key:
                parent.full_children[key] = sibling
                break

    def _release(self, node: ChunkNode) -> None:
        """Detach a chunk with no references from the tree and free it, with the
        retained chunks under it (they could never be matched again)."""
        for child in list(node.children.values()):
            if self._retained.pop(child.chunk_id) is None:  # no live sequence below a chunk at 0
                raise RuntimeError(f"releasing chunk {node.chunk_id} whose child {child.chunk_id} is in use")
            self.num_evicted += 1
            self._release(child)
        self._unindex(node)
        del node.parent.children[node.chunk_id]
        self.pool.free(node.chunk_id)
