"""Retained chunks (chunks no live sequence uses, kept as a prefix cache whose nodes a
later insert matches and shares again) and their eviction (`Eviction`, a mixin of
`PrefixTree`).

A chunk is retained when no live sequence goes through any of its nodes, i.e. through
its head (the node at slot 0: every other node of the chunk lies below it). A node
no one uses in a chunk that is still live is kept too, at no cost (its slots are
held anyway). Retained chunks are kept in least-recently-used order. A sequence's
chunks are retained deepest first, so an ancestor is always more recent than its
retained descendants: the oldest entries are leaves, and one pass in LRU order can
evict a leaf and later meet its parent as a leaf. Every entry carries a stamp from
a monotonic clock, so entries taken out by a step that is rolled back go back to
exactly their old places.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from chunk_llama.kv.node import ChunkNode
from chunk_llama.kv.pool import KVCacheFull


class RetainedChunks:
    """The LRU set of retained chunks (chunk id -> head node), oldest first."""

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

    def node_of(self, chunk_id: int) -> ChunkNode | None:
        entry = self._lru.get(chunk_id)
        return entry[0] if entry is not None else None

    def add(self, head: ChunkNode) -> None:
        """Retain a chunk as the most recently used."""
        self._clock += 1
        self._lru[head.chunk_id] = (head, self._clock)

    def replace(self, chunk_id: int, head: ChunkNode) -> None:
        """The chunk's head is another node now (a split, or its undoing); same place."""
        self._lru[chunk_id] = (head, self._lru[chunk_id][1])

    def pop(self, chunk_id: int) -> tuple[ChunkNode, int] | None:
        """Take a chunk out (revived or evicted); returns (head, stamp) or None if not retained."""
        return self._lru.pop(chunk_id, None)

    def restore(self, entries: list[tuple[ChunkNode, int]]) -> None:
        """Put back entries taken out since their stamps were issued, in their old places."""
        if not entries:
            return
        for head, stamp in entries:
            self._lru[head.chunk_id] = (head, stamp)
        self._lru = OrderedDict(sorted(self._lru.items(), key=lambda item: item[1][1]))

    def evictable(self, blocked: set[int]) -> Iterator[ChunkNode]:
        """Heads of leaf chunks (no node of the chunk has a child in another chunk) not in
        `blocked`, least recently used first. Evicting a yielded chunk before asking for
        the next may turn its parent's chunk into a leaf, met later in the pass."""
        for chunk_id in list(self._lru):
            entry = self._lru.get(chunk_id)
            if entry is not None and chunk_id not in blocked and _is_leaf_chunk(entry[0]):
                yield entry[0]


def _is_leaf_chunk(head: ChunkNode) -> bool:
    node = head
    while node is not None:
        inside = node.in_place_child()
        if len(node.children) > (inside is not None):
            return False
        node = inside
    return True


class Eviction:
    """Mixin of `PrefixTree`: which retained chunks may go, making room by evicting them
    (all, one key's, or as an allocation needs), releasing nodes (with the retained chunks
    under them) back to the pool, and forgetting what other weights computed."""

    _retained: RetainedChunks

    def num_available(self) -> int:
        """Chunks an allocation can get: free ones plus evictable retained ones."""
        return self.pool.num_free + len(self._retained)

    def evict_all(self) -> int:
        """Drop every retained chunk; returns how many."""
        before = len(self._retained)
        self._make_room(self.pool.num_free + len(self._retained), set())
        return before - len(self._retained)

    def forget_prefixes(self) -> int:
        """Make everything the tree holds unmatchable (the weights that computed its K/V
        changed): retained chunks are freed, live sequences keep their nodes to themselves
        and release them when they leave; later sequences start their own. Returns the
        chunks freed. Not inside a step (nothing here is journaled)."""
        if self._journal is not None:
            raise RuntimeError("forget_prefixes inside a step")
        freed = self.evict_all()
        for node in self.nodes():
            node.stale = True
        self.structure_version += 1
        return freed

    def forget_key(self, key: Hashable) -> int:
        """`forget_prefixes` for one key (the weights it names were written in place): its
        retained chunks are freed and its live nodes never matched again. Returns the chunks
        freed. Not inside a step."""
        if self._journal is not None:
            raise RuntimeError("forget_key inside a step")
        freed = self.evict_key(key)
        for node in self.nodes_under(key):
            node.stale = True
        self.structure_version += 1
        return freed

    def evict_key(self, key: Hashable) -> int:
        """Free the retained chunks of one key (an adapter unloaded: its cached prefixes
        go now rather than when the LRU reaches them); live sequences keep theirs. Returns
        the chunks freed."""
        before = len(self._retained)
        while True:
            heads = {n.chunk_id for n in self.nodes_under(key) if n.start == 0 and n.chunk_id in self._retained}
            others = set(self._retained.ids()) - heads
            leaves = list(self._retained.evictable(others))
            if not leaves:
                return before - len(self._retained)
            for head in leaves:
                self._retained.pop(head.chunk_id)
                self.num_evicted += 1
                self._release(head)

    def _blocked(self, node: ChunkNode | None) -> set[int]:
        """Retained chunks on the path to `node` (root excluded): an insert that shares
        them must not evict them to make room."""
        blocked: set[int] = set()
        while node is not None and node.parent is not None:  # (roots hold no chunk)
            if node.chunk_id in self._retained:
                blocked.add(node.chunk_id)
            node = node.parent
        return blocked

    def _reserve(self, num_chunks: int, what: str) -> None:
        """Make `num_chunks` free (evicting) or raise `KVCacheFull` with nothing changed."""
        if num_chunks > self.pool.num_free:
            available = self.pool.num_free + len(self._retained)
            if num_chunks > available:
                raise KVCacheFull(f"need {num_chunks} free chunks {what}, {available} available")
            self._make_room(num_chunks, set())

    def _make_room(self, num_chunks: int, blocked: set[int]) -> None:
        """Evict least recently used retained leaf chunks until `num_chunks` are free (one pass)."""
        if self.pool.num_free >= num_chunks:
            return
        for head in self._retained.evictable(blocked):
            self._retained.pop(head.chunk_id)
            self.num_evicted += 1
            self._release(head)
            if self.pool.num_free >= num_chunks:
                return
        raise RuntimeError("no evictable retained chunk although the capacity check passed")

    def _release(self, node: ChunkNode) -> None:
        """Detach a node no sequence uses from the tree, with everything under it (retained
        chunks, which could never be matched again, and unused nodes of its own chunk),
        and free its chunk if it is the chunk's head."""
        if node.num_seqs:
            raise RuntimeError(f"releasing {node}, which a live sequence uses")
        for child in list(node.children.values()):
            if child.start == 0 and self._retained.pop(child.chunk_id) is not None:
                self.num_evicted += 1
            self._release(child)
        parent = node.parent
        parent.remove_child(node)
        if node.start == 0:
            self.pool.free(node.chunk_id)
        if parent.parent is None and not parent.children and parent is not self.root:  # a key's emptied root
            self._roots = {key: root for key, root in self._roots.items() if root is not parent}
