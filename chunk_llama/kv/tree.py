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
"""

from __future__ import annotations

from dataclasses import dataclass

from chunk_llama.kv.pool import ChunkPool, KVCacheFull


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

    def __repr__(self) -> str:
        return f"ChunkNode(id={self.chunk_id}, num_tokens={len(self.tokens)})"


@dataclass
class PendingCopy:
    """Copy slots `[0, num_tokens)` of chunk `src` into chunk `dst` (every layer)."""

    src: int
    dst: int
    num_tokens: int


class _SeqPath:
    __slots__ = ("nodes", "length")

    def __init__(self) -> None:
        self.nodes: list[ChunkNode] = []
        self.length = 0


class PrefixTree:
    """The forest of chunk paths of all live sequences, under one virtual root."""

    def __init__(self, pool: ChunkPool):
        self.pool = pool
        self.chunk_size = pool.chunk_size
        self.root = ChunkNode(-1, None)
        self._seqs: dict[int, _SeqPath] = {}
        self._pending_copies: list[PendingCopy] = []
        # Bumped when sequences join or leave or grow by several tokens at once: a
        # plan built before is stale. A decode step's new chunks only extend one
        # sequence's private list; they are reported by `take_chunk_events` instead.
        self.structure_version = 0
        self._chunk_events: list[tuple[int, int]] = []

    # ----------------------------------------------------------------- queries
    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    @property
    def seq_ids(self) -> list[int]:
        return list(self._seqs)

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
        """Free chunks `insert(seq_id, tokens, max_match)` would take."""
        _, matched = self._match_full(tokens, self._clamp_match(tokens, max_match))
        return -(-(len(tokens) - matched) // self.chunk_size)

    # -------------------------------------------------------------- mutations
    def insert(self, seq_id: int, tokens: list[int], max_match: int | None = None) -> int:
        """Add a sequence and return how many leading tokens already have K/V.

        Full matching chunks are shared by reference; a match ending inside a chunk
        gets those slots copied into the sequence's own chunk (queued, see module
        doc). Slots after the returned length must be written by the caller.
        At most `max_match` tokens are matched (e.g. `len(tokens) - 1` so that the
        last prompt token is computed and yields logits). Raises `KVCacheFull`
        without changing anything when the pool cannot hold the rest.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the tree")
        if not tokens:
            raise ValueError("cannot insert an empty sequence")
        max_match = self._clamp_match(tokens, max_match)
        node, matched = self._match_full(tokens, max_match)
        num_new_chunks = -(-(len(tokens) - matched) // self.chunk_size)
        if not self.pool.can_allocate(num_new_chunks):
            raise KVCacheFull(
                f"need {num_new_chunks} free chunks for sequence {seq_id}, "
                f"{self.pool.num_free} available"
            )
        best = self._best_partial(node, tokens, matched, max_match)
        seq = _SeqPath()
        walk = node
        while walk is not self.root:  # share the matched full chunks
            self.pool.incref(walk.chunk_id)
            seq.nodes.append(walk)
            walk = walk.parent
        seq.nodes.reverse()
        seq.length = matched
        self._seqs[seq_id] = seq
        if best is not None:
            src, num_copied = best
            new = self._new_node(node, tokens[matched : matched + num_copied])
            seq.nodes.append(new)
            seq.length += num_copied
            self._pending_copies.append(PendingCopy(src.chunk_id, new.chunk_id, num_copied))
            matched += num_copied
        self._grow(seq, tokens[seq.length :])
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
        num_new_chunks = sum(1 for seq in seqs if seq.length % c == 0)
        if not self.pool.can_allocate(num_new_chunks):
            raise KVCacheFull(
                f"need {num_new_chunks} free chunks to decode, {self.pool.num_free} available"
            )
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
        c = self.chunk_size
        room = (-seq.length) % c
        num_new_chunks = -(-max(0, len(tokens) - room) // c)
        if not self.pool.can_allocate(num_new_chunks):
            raise KVCacheFull(
                f"need {num_new_chunks} free chunks to extend sequence {seq_id}, "
                f"{self.pool.num_free} available"
            )
        self._grow(seq, tokens)
        self.structure_version += 1

    def remove(self, seq_id: int) -> None:
        """Release a sequence: chunks no other sequence goes through are freed."""
        seq = self._seqs.pop(seq_id)
        for node in reversed(seq.nodes):
            if self.pool.decref(node.chunk_id):
                self._detach(node)
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

    def _grow(self, seq: _SeqPath, tokens: list[int]) -> None:
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
        return node

    def _detach(self, node: ChunkNode) -> None:
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
