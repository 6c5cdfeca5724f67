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

Steps are atomic (`journal.py`): what a step inserts or grows becomes findable by
later steps only once the caller commits it after its forward pass completed; a
failed step is rolled back.

Prefix retention (`retain_prefixes=True`): when the last sequence through a full
chunk leaves, the chunk stays in the tree with no owner (`retention.py`), so a
later request with the same prefix finds it; a leaving sequence's partly filled
last chunk stays too, as a leaf no one shares but a later insert copies its
matching slots from (the next turn of a conversation computes only its new
tokens). Retained chunks are evicted least recently used, leaves first, only when
an allocation finds no free chunk.
"""

from __future__ import annotations

from chunk_llama.kv.journal import StepJournal
from chunk_llama.kv.node import ChunkNode, GrowRecord, InsertRecord, PendingCopy, SeqPath
from chunk_llama.kv.pool import ChunkPool, KVCacheFull
from chunk_llama.kv.retention import Eviction, RetainedChunks


class PrefixTree(StepJournal, Eviction):
    """The forest of chunk paths of all live sequences, under one virtual root."""

    def __init__(self, pool: ChunkPool, *, retain_prefixes: bool = False):
        self.pool = pool
        self.chunk_size = pool.chunk_size
        self.retain_prefixes = retain_prefixes
        self.root = ChunkNode(-1, None)
        self._seqs: dict[int, SeqPath] = {}
        self._pending_copies: list[PendingCopy] = []
        self._retained = RetainedChunks()
        self._journal: list[InsertRecord | GrowRecord] | None = None  # None: no step open
        self._peaks_at_begin = (0, 0)
        # Bumped when sequences join or leave or grow by several tokens at once, and by
        # a rollback: a plan built before is stale. A decode step's new chunks only extend
        # one sequence's private list; they are reported by `take_chunk_events` instead.
        self.structure_version = 0
        self._chunk_events: list[tuple[int, int]] = []
        self.num_evicted = 0  # retained chunks given back to the pool
        self.num_revived = 0  # retained chunks a new sequence reused, shared or copied (prefix cache hits)
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

    @property
    def in_step(self) -> bool:
        return self._journal is not None

    def is_retained(self, chunk_id: int) -> bool:
        return chunk_id in self._retained

    def retained_ids(self) -> list[int]:
        """Retained chunk ids, least recently used first."""
        return self._retained.ids()

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

    def match_len(self, tokens: list[int], max_match: int | None = None) -> int:
        """How many leading tokens `insert(_, tokens, max_match)` would find cached (shared
        full chunks plus a copied partial match)."""
        max_match = self._clamp_match(tokens, max_match)
        node, matched = self._match_full(tokens, max_match)
        best = self._best_partial(node, tokens, matched, max_match)
        return matched + (best[1] if best else 0)

    def chunks_needed(self, tokens: list[int], max_match: int | None = None) -> int:
        """Available chunks (free or evictable) `insert(seq_id, tokens, max_match)` would take:
        its new chunks plus the retained chunks it would revive."""
        node, matched = self._match_full(tokens, self._clamp_match(tokens, max_match))
        return -(-(len(tokens) - matched) // self.chunk_size) + self._num_retained_on_path(node)

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
        seq = self._seqs[seq_id] = SeqPath()
        record = InsertRecord(seq_id, [], [])
        self._journal_append(record)
        matched_path = []
        while node is not self.root:
            matched_path.append(node)
            node = node.parent
        for shared in reversed(matched_path):  # share the matched full chunks, root first
            revived = self._retained.pop(shared.chunk_id)
            if revived is not None:
                record.revived.append(revived)
                self.num_revived += 1
            self.pool.incref(shared.chunk_id)
            seq.nodes.append(shared)
        seq.length = matched
        self._make_room(num_new_chunks, blocked)
        if best is not None:
            src, num_copied = best
            if src.chunk_id in self._retained:  # a copy source is a hit too, and now recently used
                record.touched.append((src, self._retained.stamp(src.chunk_id)))
                self._retained.touch(src.chunk_id)
                self.num_revived += 1
            parent = seq.nodes[-1] if seq.nodes else self.root
            seq.nodes.append(self._new_node(parent, tokens[matched : matched + num_copied]))
            seq.length += num_copied
            self._pending_copies.append(PendingCopy(src.chunk_id, seq.nodes[-1].chunk_id, num_copied))
        num_cached = seq.length
        self._grow(seq, tokens[num_cached:])
        self.structure_version += 1
        return num_cached

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
            self._journal_append(GrowRecord(seq_id, seq.length, len(seq.nodes)))
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
        self._journal_append(GrowRecord(seq_id, seq.length, len(seq.nodes)))
        self._grow(seq, tokens)
        self.structure_version += 1

    def remove(self, seq_id: int) -> None:
        """Release a sequence. Chunks no other sequence goes through are retained
        (when retention is on: full, findable chunks under a kept parent, and the
        partly filled last chunk as a leaf that later inserts copy their matching
        slots from, e.g. the next turn of a conversation) or freed."""
        if self._journal:  # a removal cannot be undone; an open step with nothing in it is fine
            raise RuntimeError(f"cannot remove sequence {seq_id} in a step with uncommitted changes")
        seq = self._seqs[seq_id]
        retained, freed = [], []
        parent_kept = True
        for node in seq.nodes:  # root first: a chunk is retained only under a kept parent
            if self.pool.ref_counts[node.chunk_id] > 1:
                continue
            full = len(node.tokens) == self.chunk_size and node.is_indexed()
            last_partial = node is seq.nodes[-1] and 0 < len(node.tokens) < self.chunk_size
            if parent_kept and self.retain_prefixes and (full or last_partial):
                retained.append(node)
            else:
                parent_kept = False
                freed.append(node)
        if self._pending_copies:
            gone = set().union(*(self._subtree_ids(node) for node in freed))
            if any(c.src in gone and c.dst not in gone for c in self._pending_copies):
                # a queued copy reads its source in the next forward: the source must outlive it
                raise RuntimeError(f"cannot remove sequence {seq_id}: it would free the source of a queued copy")
            # copies into the chunks that go are cancelled: their memory may serve someone else next
            self._pending_copies = [c for c in self._pending_copies if c.dst not in gone]
        del self._seqs[seq_id]
        for node in seq.nodes:
            self.pool.decref(node.chunk_id)
        for node in reversed(freed):
            self._release(node)
        for node in reversed(retained):  # deepest first: ancestors become the more recent
            self._retained.add(node)
        self.structure_version += 1

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
