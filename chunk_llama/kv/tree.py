"""Prefix tree of KV chunks, shared by all layers (the paper's PAKV), token-granular.

A node is a run of token ids and the slots of one pool chunk holding their K/V
(`node.py`). Sequences that begin with the same tokens share the nodes of that
prefix, whatever its length: where a new sequence parts from the tree inside a
node, the node is split at that token (`_split`). The shared part keeps its slots,
the rest stays in place as its child, and the new sequence goes on in a chunk of its
own, so a common prefix is held once even where it ends inside a chunk, and nothing
is ever copied. A sequence extends its last node in place while no one else uses it;
otherwise its next tokens go on in the same chunk when the slots after that node are
unclaimed, else in a fresh chunk.

The tree only records token ids and slots; the K/V values are written by the
attention layers. Steps are atomic (`journal.py`): what a step inserts, grows or
splits becomes findable by later steps only once the caller commits it after its
forward pass completed; a failed step is rolled back.

With `token_granular=False` only whole chunks are shared (a prefix is matched chunk by
chunk, nothing is split), so every path is whole chunks and a partly filled last one:
what kernels that take whole chunks only need (the CUDA ones, so far).

Prefix retention (`retain_prefixes=True`): when the last sequence through a node
leaves, the node stays in the tree with no owner (`retention.py`), so a later request
with the same prefix finds it (the next turn of a conversation computes only its new
tokens). A chunk whose nodes are all unowned is a retained chunk: evicted least
recently used, leaves first, only when an allocation finds no free chunk.

Keys: K/V depend on the weights that computed them, not only on the tokens. Each
sequence is inserted under a key (None: the base weights; an adapter's identity, a hash
of its weights and config, otherwise) and matches only nodes inserted under the same key:
each key has a forest of its own under a virtual root (`paths.py`). Retained chunks of
every key are one LRU, so eviction takes the least recently used across keys;
`forget_key` frees one key's retained chunks.
"""

from __future__ import annotations

from collections.abc import Hashable

from chunk_llama.kv.journal import StepJournal
from chunk_llama.kv.node import ChunkNode, GrowRecord, InsertRecord, SeqPath, SplitRecord
from chunk_llama.kv.paths import PathQueries
from chunk_llama.kv.pool import ChunkPool, KVCacheFull
from chunk_llama.kv.retention import Eviction, RetainedChunks


class _Match:
    """Where a token list meets the tree: the nodes it shares whole, and the node it
    parts from inside (`partial`, after `partial_len` of its tokens), if any."""

    __slots__ = ("nodes", "length", "partial", "partial_len")

    def __init__(self, nodes: list[ChunkNode], length: int, partial: ChunkNode | None, partial_len: int):
        self.nodes, self.length, self.partial, self.partial_len = nodes, length, partial, partial_len

    @property
    def num_cached(self) -> int:
        return self.length + self.partial_len


class PrefixTree(PathQueries, StepJournal, Eviction):
    """The forests of the paths of all live sequences, one under a virtual root per key."""

    def __init__(self, pool: ChunkPool, *, retain_prefixes: bool = False, token_granular: bool = True):
        self.pool = pool
        self.chunk_size = pool.chunk_size
        self.retain_prefixes = retain_prefixes
        self.token_granular = token_granular
        self.root = ChunkNode(-1, 0, None)  # the base weights' (key None)
        self._roots: dict[Hashable, ChunkNode] = {None: self.root}
        self._seqs: dict[int, SeqPath] = {}
        self._retained = RetainedChunks()
        self._journal: list[InsertRecord | GrowRecord | SplitRecord] | None = None  # None: no step open
        self._peaks_at_begin = (0, 0)
        # Bumped when sequences join or leave or grow by several tokens at once, and by
        # a rollback: a plan built before is stale. A decode step's new nodes only extend
        # one sequence's private list; they are reported by `take_node_events` instead.
        self.structure_version = 0
        self._node_events: list[tuple[int, ChunkNode, int]] = []
        self.num_evicted = 0  # retained chunks given back to the pool
        self.num_revived = 0  # retained chunks a new sequence reused (prefix cache hits)
        self.peak_live_chunks = 0  # chunks held by live sequences, at most at once

    # ----------------------------------------------------------------- queries
    def take_node_events(self) -> list[tuple[int, ChunkNode, int]]:
        """(seq_id, node, position of its first token) of nodes `append` started since the last call."""
        events, self._node_events = self._node_events, []
        return events

    def match_len(self, tokens: list[int], max_match: int | None = None, key: Hashable = None) -> int:
        """How many leading tokens `insert(_, tokens, max_match, key)` would find cached."""
        return self._match(tokens, self._clamp_match(tokens, max_match), key).num_cached

    def chunks_needed(self, tokens: list[int], max_match: int | None = None, key: Hashable = None) -> int:
        """Available chunks (free or evictable) `insert(seq_id, tokens, max_match, key)` would
        take: its new chunks plus the retained chunks it would revive."""
        match = self._match(tokens, self._clamp_match(tokens, max_match), key)
        return self._new_chunks(match, len(tokens)) + len(self._retained_on(match))

    # -------------------------------------------------------------- mutations
    def insert(self, seq_id: int, tokens: list[int], max_match: int | None = None, key: Hashable = None) -> int:
        """Add a sequence under `key` (what computes its K/V; None: the base weights) and
        return how many leading tokens already have K/V.

        Matching nodes of the same key (live or retained, whole or up to the token where the sequence
        parts from them) are shared. Slots after the returned length must be written by
        the caller. At most `max_match` tokens are matched (e.g. `len(tokens) - 1` so
        that the last prompt token is computed and yields logits). Raises `KVCacheFull`
        without changing anything when the pool cannot hold the rest.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already in the tree")
        if not tokens:
            raise ValueError("cannot insert an empty sequence")
        match = self._match(tokens, self._clamp_match(tokens, max_match), key)
        num_new_chunks = self._new_chunks(match, len(tokens))
        blocked = self._retained_on(match)
        available = self.pool.num_free + len(self._retained) - len(blocked)
        if num_new_chunks > available:
            raise KVCacheFull(f"need {num_new_chunks} free chunks for sequence {seq_id}, {available} available")
        shared = list(match.nodes)
        if match.partial is not None:
            shared.append(self._split(match.partial, match.partial_len))
        record = InsertRecord(seq_id, len(shared), [])
        self._journal_append(record)
        for node in shared:  # root first
            if node.start == 0:
                revived = self._retained.pop(node.chunk_id)
                if revived is not None:
                    record.revived.append(revived)
                    self.num_revived += 1
            node.num_seqs += 1
        self.peak_live_chunks = max(self.peak_live_chunks, self.num_live_chunks)
        self._make_room(num_new_chunks, blocked)  # (may drop an emptied root: looked up after it)
        leaf = shared[-1] if shared else self._root(key)
        seq = self._seqs[seq_id] = SeqPath(leaf, match.num_cached, key)
        self._grow(seq, tokens[match.num_cached :])
        self.structure_version += 1
        return match.num_cached

    def append(self, seq_ids: list[int], tokens: list[int]) -> tuple[list[int], list[int]]:
        """Append one token to each sequence; returns the (chunk ids, slots) to write.

        Raises `KVCacheFull` without changing anything when new chunks are needed
        and the pool has too few.
        """
        if len(seq_ids) != len(tokens):
            raise ValueError(f"{len(seq_ids)} sequences but {len(tokens)} tokens")
        seqs = [self._seqs[s] for s in seq_ids]
        self._reserve(self._fresh_chunks_to_grow(seqs, [1] * len(seqs)), "to decode")
        chunk_ids, slots = [], []
        for seq_id, seq, token in zip(seq_ids, seqs, tokens):
            leaf = seq.leaf
            self._journal_append(GrowRecord(seq_id, seq.length, leaf, len(leaf.tokens)))
            self._grow(seq, [token])
            if seq.leaf is not leaf:
                self._node_events.append((seq_id, seq.leaf, seq.length - 1))
            chunk_ids.append(seq.leaf.chunk_id)
            slots.append(seq.leaf.end - 1)
        return chunk_ids, slots

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append several tokens to one sequence (atomic like `append`)."""
        seq = self._seqs[seq_id]
        self._reserve(self._fresh_chunks_to_grow([seq], [len(tokens)]), f"to extend sequence {seq_id}")
        self._journal_append(GrowRecord(seq_id, seq.length, seq.leaf, len(seq.leaf.tokens)))
        self._grow(seq, tokens)
        self.structure_version += 1

    def remove(self, seq_id: int) -> None:
        """Release a sequence. Nodes no other sequence goes through are retained (when
        retention is on) or released, deepest first."""
        if self._journal:  # a removal cannot be undone; an open step with nothing in it is fine
            raise RuntimeError(f"cannot remove sequence {seq_id} in a step with uncommitted changes")
        path = self.path(seq_id)
        del self._seqs[seq_id]
        unowned = []
        for node in path:
            node.num_seqs -= 1
            if node.num_seqs == 0:
                unowned.append(node)
        for node in reversed(unowned):  # deepest first: ancestors become the more recent
            if not self.retain_prefixes or node.stale:
                self._release(node)
            elif node.start == 0:  # the chunk's head: no one uses any node of the chunk now
                self._retained.add(node)
        self.structure_version += 1

    # ---------------------------------------------------------------- helpers
    def _root(self, key: Hashable) -> ChunkNode:
        """`key`'s virtual root, made on its first sequence (an emptied one goes: `_release`)."""
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = ChunkNode(-1, 0, None)
        return root

    @staticmethod
    def _clamp_match(tokens: list[int], max_match: int | None) -> int:
        return len(tokens) if max_match is None else max(0, min(max_match, len(tokens)))

    def _match(self, tokens: list[int], max_match: int, key: Hashable) -> _Match:
        """Walk `key`'s forest along tokens[:max_match]: at each node, the child sharing the
        longest run with what is left (children are found by their first token). Not
        token-granular: whole chunks only, matched whole."""
        node, matched, nodes = self._roots.get(key), 0, []
        if node is None:
            return _Match(nodes, 0, None, 0)
        c = self.chunk_size
        while matched < max_match:
            best, best_len = None, 0
            for child in node.by_token.get(tokens[matched], ()):
                if child.stale or (not self.token_granular and (len(child.tokens) < c or matched + c > max_match)):
                    continue
                n, limit = 1, min(len(child.tokens), max_match - matched)
                while n < limit and child.tokens[n] == tokens[matched + n]:
                    n += 1
                if n > best_len:
                    best, best_len = child, n
            if best is None or (not self.token_granular and best_len < c):
                break
            if best_len < len(best.tokens):
                return _Match(nodes, matched, best, best_len)
            nodes.append(best)
            node, matched = best, matched + best_len
        return _Match(nodes, matched, None, 0)

    def _new_chunks(self, match: _Match, num_tokens: int) -> int:
        """Fresh chunks an insert of `num_tokens` tokens matched as `match` takes."""
        num_own = num_tokens - match.num_cached
        room = 0  # after a split the slots behind the shared part hold the rest of the node
        if match.partial is None and match.nodes:
            room = self._room_after(match.nodes[-1])
        return -(-max(0, num_own - room) // self.chunk_size)

    def _room_after(self, node: ChunkNode) -> int:
        """Unclaimed slots behind a node in its chunk, where a new child can go in place."""
        if node.parent is None or node.in_place_child() is not None:  # (a root holds no slots)
            return 0
        return self.chunk_size - node.end

    def _fresh_chunks_to_grow(self, seqs: list[SeqPath], counts: list[int]) -> int:
        """Fresh chunks growing each sequence by its count takes, in order (two sequences
        ending at the same node: the first to grow takes the slots behind it)."""
        claimed: set[tuple[int, int]] = set()
        total = 0
        for seq, count in zip(seqs, counts):
            leaf, room = seq.leaf, 0
            if self._extends_in_place(leaf):
                room = self.chunk_size - leaf.end
            elif leaf.key not in claimed:
                room = self._room_after(leaf)
                claimed.add(leaf.key)
            total += -(-max(0, count - room) // self.chunk_size)
        return total

    def _extends_in_place(self, node: ChunkNode) -> bool:
        """Whether a sequence ending at `node` may add its tokens to the node itself: no one
        else uses it and nothing hangs below it (a node others share or reach is immutable)."""
        return node.parent is not None and node.num_seqs == 1 and not node.children and node.end < self.chunk_size

    def _retained_on(self, match: _Match) -> set[int]:
        """Retained chunks on the path of a match: an insert revives them, so they may not
        be evicted to make room for it."""
        deepest = match.partial or (match.nodes[-1] if match.nodes else None)
        return self._blocked(deepest)

    def _split(self, node: ChunkNode, length: int) -> ChunkNode:
        """Split `node` after its first `length` tokens; returns the new node holding them
        (in the node's place, same slots). The node keeps the rest in place, as its child."""
        head = ChunkNode(node.chunk_id, node.start, node.parent)
        head.tokens = node.tokens[:length]
        head.num_seqs = node.num_seqs
        node.parent.replace_child(node, head)
        if node.start == 0 and self._retained.node_of(node.chunk_id) is node:
            self._retained.replace(node.chunk_id, head)
        node.start += length
        del node.tokens[:length]
        node.parent = head
        head.add_child(node)
        self._journal_append(SplitRecord(head, node))
        return head

    def _grow(self, seq: SeqPath, tokens: list[int]) -> None:
        """Append tokens to a sequence (capacity checked by the caller)."""
        c = self.chunk_size
        i = 0
        while i < len(tokens):
            leaf = seq.leaf
            if not self._extends_in_place(leaf):
                node = self._new_node(leaf, tokens[i], in_place=self._room_after(leaf) > 0)
                node.num_seqs = 1
                seq.leaf = leaf = node
                i += 1
                seq.length += 1
            take = min(c - leaf.end, len(tokens) - i)
            leaf.tokens.extend(tokens[i : i + take])
            seq.length += take
            i += take

    def _new_node(self, parent: ChunkNode, first_token: int, in_place: bool) -> ChunkNode:
        """A child of `parent` holding `first_token`: in the parent's chunk behind it, or at
        the start of a fresh chunk."""
        if in_place:
            node = ChunkNode(parent.chunk_id, parent.end, parent)
        else:
            node = ChunkNode(self.pool.allocate(), 0, parent)
        node.tokens = [first_token]
        parent.add_child(node)
        self.peak_live_chunks = max(self.peak_live_chunks, self.num_live_chunks)
        return node
