"""Prefix tree of KV chunks, shared by all layers (the paper's PAKV).

A node is one chunk: up to `chunk_size` token ids and the pool id holding their
K/V. Full chunks are shared between the sequences that start with the same
tokens; a partially filled chunk always belongs to one sequence. The pool's
reference count of a chunk is the number of live sequences whose path runs
through it, so a path's counts never increase from root to leaf and every
sequence's path is a run of shared chunks followed by a run of private ones.

The tree only records token ids and chunk ids; the K/V values are written by the
attention layers. When a new sequence matches part of a chunk it cannot share
(the match ends inside it), the matched slots must be copied into the new
sequence's own chunk. The source slots may belong to a sequence prefilled in the
same forward pass, so the copy is queued (`take_pending_copies`) and performed by
the cache after each layer has written its new K/V.

Prefix retention (`retain_prefixes=True`): when the last sequence through a full
chunk leaves, the chunk stays in the tree with no owner, so a later request with
the same prefix finds it. Retained chunks are evicted least recently used, leaves
first, only when an allocation finds no free chunk.
"""

from __future__ import annotations

from collections import OrderedDict

from chunk_llama.kv.node import ChunkNode, PendingCopy, SeqPath
from chunk_llama.kv.pool import ChunkPool, KVCacheFull


class PrefixTree:
    """The forest of chunk paths of all live sequences, under one virtual root."""

    def __init__(self, pool: ChunkPool, *, retain_prefixes: bool = False):
        self.pool = pool
        self.chunk_size = pool.chunk_size
        self.retain_prefixes = retain_prefixes
        self.root = ChunkNode(-1, None)
        self._seqs: dict[int, SeqPath] = {}
        self._pending_copies: list[PendingCopy] = []
        # Retained chunks, least recently used first. A node is added after its
        # descendants, so the oldest entries are leaves.
        self._retained: OrderedDict[int, ChunkNode] = OrderedDict()
        # Bumped when sequences join or leave or grow by several tokens at once: a
        # plan built before is stale. A decode step's new chunks only extend one
        # sequence's private list; they are reported by `take_chunk_events` instead.
        self.structure_version = 0
        self._chunk_events: list[tuple[int, int]] = []
        self.num_evicted = 0  # retained chunks given back to the pool
        self.num_revived = 0  # retained chunks a new sequence matched (prefix cache hits)
        self.peak_live_chunks = 0  # chunks held by live sequences, at most at once

    # ----------------------------------------------------------------- queries
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

    def is_retained(self, chunk_id: int) -> bool:
        return chunk_id in self._retained

    def retained_ids(self) -> list[int]:
        """Retained chunk ids, least recently used first."""
        return list(self._retained)

    def nodes(self) -> list[ChunkNode]:
        """Every node under the root, parents before children."""
        out, stack = [], list(reversed(self.root.children.values()))
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children.values()))
        return out

    def seq_len(self, seq_id: int) -> int:
        return self._seqs[seq_id].length

    def path(self, seq_id: int) -> list[ChunkNode]:
        """The chunks of a sequence, root first (do not modify)."""
        return self._seqs[seq_id].nodes

    def chunk_ids(self, seq_id: int) -> list[int]:
        return [node.chunk_id for node in self._seqs[seq_id].nodes]

    def tokens(self, seq_id: int) -> list[int]:
        """The token ids of a sequence, read back from its chunks."""
        out: list[int] = []
        for node in self._seqs[seq_id].nodes:
            out.extend(node.tokens)
        return out

    def slots(self, seq_id: int, start: int, end: int) -> tuple[list[int], list[int]]:
        """(chunk id, offset in chunk) of each position in `[start, end)` of a sequence."""
        nodes = self._seqs[seq_id].nodes
        c = self.chunk_size
        positions = range(start, end)
        return [nodes[p // c].chunk_id for p in positions], [p % c for p in positions]

    def take_chunk_events(self) -> list[tuple[int, int]]:
        """(seq_id, chunk_id) of chunks `append` added since the last call."""
        events, self._chunk_events = self._chunk_events, []
        return events

    def take_pending_copies(self) -> list[PendingCopy]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def match_len(self, tokens: list[int]) -> int:
        """Length of the longest prefix of `tokens` whose K/V the tree holds."""
        node, matched = self._match_full(tokens, len(tokens))
        best = self._best_partial(node, tokens, matched, len(tokens))
        return matched + (best[1] if best else 0)

    def chunks_needed(self, tokens: list[int], max_match: int | None = None) -> int:
        """Available chunks (free or evictable) `insert(seq_id, tokens, max_match)` would take:
        its new chunks plus the retained chunks it would revive."""
        node, matched = self._match_full(tokens, self._clamp_match(tokens, max_match))
        return -(-(len(tokens) - matched) // self.chunk_size) + self._num_retained_on_path(node)

    def num_available(self) -> int:
        """Chunks an allocation can get: free ones plus evictable retained ones."""
        return self.pool.num_free + len(self._retained) - len(self._blocked())

    # -------------------------------------------------------------- mutations
    def insert(self, seq_id: int, tokens: list[int], max_match: int | None = None) -> int:
        """Add a sequence and return how many leading tokens already have K/V.

        Full matching chunks (live or retained) are shared by reference; a match
        ending inside a chunk gets those slots copied into the sequence's own chunk
        (queued, see module doc). Slots after the returned length must be written
        by the caller. At most `max_match` tokens are matched (e.g. `len(tokens) - 1`
        so that the last prompt token is computed and yields logits). Raises
        `KVCacheFull` without changing anything when the pool cannot hold the rest.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the tree")
        if not tokens:
            raise ValueError("cannot insert an empty sequence")
        max_match = self._clamp_match(tokens, max_match)
        node, matched = self._match_full(tokens, max_match)
        num_new_chunks = -(-(len(tokens) - matched) // self.chunk_size)
        best = self._best_partial(node, tokens, matched, max_match)
        blocked = self._blocked(node, best[0] if best else None)
        available = self.pool.num_free + len(self._retained) - len(blocked)
        if num_new_chunks > available:
            raise KVCacheFull(f"need {num_new_chunks} free chunks for sequence {seq_id}, {available} available")
        seq = SeqPath()
        walk = node
        while walk is not self.root:  # share the matched full chunks
            self._acquire(walk)
            seq.nodes.append(walk)
            walk = walk.parent
        seq.nodes.reverse()
        seq.length = matched
        self._seqs[seq_id] = seq
        self._make_room(num_new_chunks, blocked)
        if best is not None:
            src, num_copied = best
            new = self._new_node(node, tokens[matched : matched + num_copied])
            seq.nodes.append(new)
            seq.length += num_copied
            self._pending_copies.append(PendingCopy(src.chunk_id, new.chunk_id, num_copied))
            matched += num_copied
        self._grow(seq, tokens[seq.length :])
        self.peak_live_chunks = max(self.peak_live_chunks, self.num_live_chunks)
        self.structure_version += 1
        return matched

    def append(self, seq_ids: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
        """Append one token to each sequence; returns the (chunk ids, offsets) to write.

        Raises `KVCacheFull` without changing anything when new chunks are needed
        and the pool has too few.
        """
        if len(seq_ids) != len(tokens):
            raise ValueError(f"{len(seq_ids)} sequences but {len(tokens)} tokens")
        c = self.chunk_size
        seqs = [self._seqs[s] for s in seq_ids]
        self._reserve(sum(1 for seq in seqs if seq.length % c == 0), "to decode")
        chunk_ids, offsets = [], []
        for seq_id, seq, token in zip(seq_ids, seqs, tokens):
            offset = seq.length % c
            self._grow(seq, [token])
            chunk_ids.append(seq.nodes[-1].chunk_id)
            offsets.append(offset)
            if offset == 0:
                self._chunk_events.append((seq_id, seq.nodes[-1].chunk_id))
        return chunk_ids, offsets

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append several tokens to one sequence (atomic like `append`)."""
        seq = self._seqs[seq_id]
        room = (-seq.length) % self.chunk_size
        self._reserve(-(-max(0, len(tokens) - room) // self.chunk_size), f"to extend sequence {seq_id}")
        self._grow(seq, tokens)
        self.structure_version += 1

    def remove(self, seq_id: int) -> None:
        """Release a sequence. Chunks no other sequence goes through are retained
        (full, findable chunks under a kept parent, when retention is on) or freed."""
        seq = self._seqs.pop(seq_id)
        retained, freed = [], []
        parent_kept = True
        for node in seq.nodes:  # root first: a chunk is retained only under a kept parent
            if self.pool.decref(node.chunk_id) > 0:
                continue
            if (
                parent_kept
                and self.retain_prefixes
                and len(node.tokens) == self.chunk_size
                and node.is_indexed()
            ):
                retained.append(node)
            else:
                parent_kept = False
                freed.append(node)
        for node in reversed(freed):
            self._release(node)
        for node in reversed(retained):  # deepest first: ancestors become the more recent
            self._retained[node.chunk_id] = node
        self.structure_version += 1

    def evict_all(self) -> int:
        """Drop every retained chunk that nothing protects; returns how many."""
        before = len(self._retained)
        self._make_room(self.num_available(), self._blocked())
        return before - len(self._retained)

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _clamp_match(tokens: list[int], max_match: int | None) -> int:
        return len(tokens) if max_match is None else max(0, min(max_match, len(tokens)))

    def _match_full(self, tokens: list[int], max_match: int) -> tuple[ChunkNode, int]:
        c = self.chunk_size
        node, matched = self.root, 0
        while matched + c <= max_match:
            child = node.full_children.get(tuple(tokens[matched : matched + c]))
            if child is None:
                break
            node, matched = child, matched + c
        return node, matched

    def _best_partial(
        self, node: ChunkNode, tokens: list[int], matched: int, max_match: int
    ) -> tuple[ChunkNode, int] | None:
        """The child of `node` sharing the longest run with tokens[matched:max_match]."""
        want = tokens[matched : min(max_match, matched + self.chunk_size)]
        if not want:
            return None
        best, best_len = None, 0
        for child in node.children.values():
            n = 0
            for a, b in zip(child.tokens, want):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = child, n
        return (best, best_len) if best is not None else None

    def _num_retained_on_path(self, node: ChunkNode) -> int:
        count = 0
        while node is not self.root:
            count += node.chunk_id in self._retained
            node = node.parent
        return count

    def _blocked(self, *nodes: ChunkNode | None) -> set[int]:
        """Retained chunks that may not be evicted now: those on the paths to `nodes`
        and to the sources of queued copies (read by the next forward pass)."""
        sources = [self._retained[c.src] for c in self._pending_copies if c.src in self._retained]
        starts = [n for n in nodes if n is not None] + sources
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
        """Evict least recently used retained leaves until `num_chunks` are free."""
        while self.pool.num_free < num_chunks:
            victim = next(
                (n for n in self._retained.values() if not n.children and n.chunk_id not in blocked), None
            )
            if victim is None:
                raise RuntimeError("no evictable retained chunk although the capacity check passed")
            del self._retained[victim.chunk_id]
            self._release(victim)
            self.num_evicted += 1

    def _acquire(self, node: ChunkNode) -> None:
        """Add a sequence to a matched chunk, reviving it if it was retained."""
        if self._retained.pop(node.chunk_id, None) is not None:
            self.num_revived += 1
        self.pool.incref(node.chunk_id)

    def _grow(self, seq: SeqPath, tokens: list[int]) -> None:
        """Append tokens to a sequence's private tail (capacity checked by caller)."""
        c = self.chunk_size
        i = 0
        while i < len(tokens):
            if seq.length % c == 0:
                parent = seq.nodes[-1] if seq.nodes else self.root
                seq.nodes.append(self._new_node(parent, []))
            last = seq.nodes[-1]
            take = min(c - len(last.tokens), len(tokens) - i)
            last.tokens.extend(tokens[i : i + take])
            seq.length += take
            i += take
            if len(last.tokens) == c:
                last.parent.full_children.setdefault(tuple(last.tokens), last)

    def _new_node(self, parent: ChunkNode, tokens: list[int]) -> ChunkNode:
        node = ChunkNode(self.pool.allocate(), parent)
        node.tokens = list(tokens)
        parent.children[node.chunk_id] = node
        if len(node.tokens) == self.chunk_size:
            parent.full_children.setdefault(tuple(node.tokens), node)
        self.peak_live_chunks = max(self.peak_live_chunks, self.num_live_chunks)
        return node

    def _release(self, node: ChunkNode) -> None:
        """Detach a chunk with no references from the tree and free it, with the
        retained chunks under it (they could never be matched again)."""
        for child in list(node.children.values()):
            del self._retained[child.chunk_id]  # no live sequence below a chunk at 0
            self.num_evicted += 1
            self._release(child)
        parent = node.parent
        del parent.children[node.chunk_id]
        key = tuple(node.tokens)
        if parent.full_children.get(key) is node:
            del parent.full_children[key]
            # Another full child with the same tokens can take over the index.
            for sibling in parent.children.values():
                if len(sibling.tokens) == self.chunk_size and tuple(sibling.tokens) == key:
                    parent.full_children[key] = sibling
                    break
        self.pool.free(node.chunk_id)
