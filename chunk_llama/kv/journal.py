"""Step atomicity for the prefix tree: a journal of one step's inserts, growths and splits.

Between `begin_step()` and `commit()` every insert, growth and split is journaled.
The forward pass that writes their K/V either completes, and the caller commits (only
then may later steps match, retain or revive the new nodes), or fails, and
`rollback()` undoes the step in reverse order: sequences, nodes, splits, LRU order and
counters are as they were at `begin_step()`, except retained chunks evicted to make
room, which stay evicted (the failed step may have overwritten their memory).
Sequences inserted in the same step share each other's new nodes, so a common prefix
is computed once: the same forward writes them, and undoing in reverse order releases
the sharer before the node. `remove` is refused once a step has uncommitted changes
(it could not be undone); nothing needs it there.
"""

from __future__ import annotations

from chunk_llama.kv.node import GrowRecord, InsertRecord, SplitRecord


class StepJournal:
    """Mixin of `PrefixTree`: begin_step / commit / savepoint / rollback."""

    _journal: list[InsertRecord | GrowRecord | SplitRecord] | None

    def begin_step(self) -> None:
        """Start journaling: what follows is undone by `rollback()` unless committed."""
        if self._journal is not None:
            raise RuntimeError("a step is already open: commit or roll it back first")
        self._journal = []
        self._peaks_at_begin = (self.peak_live_chunks, self.pool.peak_used)

    def commit(self) -> None:
        """The step's forward completed: every node it touched holds its K/V in every layer."""
        self._journal = None

    def savepoint(self) -> int:
        """A mark inside the open step that `rollback(savepoint)` returns to."""
        if self._journal is None:
            raise RuntimeError("savepoint outside a step")
        return len(self._journal)

    def rollback(self, savepoint: int | None = None) -> None:
        """Undo the open step (or what followed `savepoint`); a no-op with no step open."""
        if self._journal is None:
            return
        num_kept = savepoint or 0
        if len(self._journal) > num_kept:
            self.structure_version += 1  # a plan built meanwhile is stale
        while len(self._journal) > num_kept:
            record = self._journal.pop()
            if isinstance(record, InsertRecord):
                self._undo_insert(record)
            elif isinstance(record, GrowRecord):
                self._undo_grow(record)
            else:
                self._undo_split(record)
        if savepoint is None:
            self._node_events.clear()
            self.peak_live_chunks, self.pool.peak_used = self._peaks_at_begin
            self._journal = None

    def _journal_append(self, record: InsertRecord | GrowRecord | SplitRecord) -> None:
        if self._journal is not None:
            self._journal.append(record)

    def _undo_insert(self, record: InsertRecord) -> None:
        path = self.path(record.seq_id)
        del self._seqs[record.seq_id]
        for node in path:
            node.num_seqs -= 1
        for node in reversed(path[record.num_shared :]):  # the nodes the insert started
            self._release(node)
        self._retained.restore(record.revived)
        self.num_revived -= len(record.revived)

    def _undo_grow(self, record: GrowRecord) -> None:
        seq = self._seqs[record.seq_id]
        while seq.leaf is not record.leaf:  # nodes this growth started
            node = seq.leaf
            seq.leaf = node.parent
            node.num_seqs -= 1
            self._release(node)
        del record.leaf.tokens[record.leaf_tokens :]
        seq.length = record.length

    def _undo_split(self, record: SplitRecord) -> None:
        """Merge the split-off head back into its node (everything that used the head
        alone was undone before)."""
        head, node = record.head, record.node
        if list(head.children.values()) != [node] or head.num_seqs != node.num_seqs:
            raise RuntimeError(f"undoing the split of {node}: {head} is still used on its own")
        head.remove_child(node)
        node.tokens[:0] = head.tokens
        node.start = head.start
        node.parent = head.parent
        head.parent.replace_child(head, node)
        if self._retained.node_of(node.chunk_id) is head:
            self._retained.replace(node.chunk_id, node)
