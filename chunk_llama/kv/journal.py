"""Step atomicity for the prefix tree: a journal of one step's inserts and growths.

Between `begin_step()` and `commit()` every insert and growth is journaled. The
forward pass that writes their K/V either completes, and the caller commits (only
then may later steps match, retain or revive the new chunks), or fails, and
`rollback()` undoes the step in reverse order: sequences, chunks, reference counts,
pending copies, LRU order and counters are as they were at `begin_step()`, except
retained chunks evicted to make room, which stay evicted (the failed step may have
overwritten their memory). Sequences inserted in the same step share each other's
new chunks, so a common prefix is computed once: the same forward writes them, and
undoing in reverse order releases the sharer before the chunk. `remove` is refused
once a step has uncommitted changes (it could not be undone); nothing needs it there.
"""

from __future__ import annotations

from chunk_llama.kv.node import GrowRecord, InsertRecord


class StepJournal:
    """Mixin of `PrefixTree`: begin_step / commit / savepoint / rollback."""

    _journal: list[InsertRecord | GrowRecord] | None

    def begin_step(self) -> None:
        """Start journaling: what follows is undone by `rollback()` unless committed."""
        if self._journal is not None:
            raise RuntimeError("a step is already open: commit or roll it back first")
        self._journal = []
        self._peaks_at_begin = (self.peak_live_chunks, self.pool.peak_used)

    def commit(self) -> None:
        """The step's forward completed: every chunk it touched holds its K/V in every layer."""
        if self._pending_copies:
            raise RuntimeError("commit with queued copies that no forward pass performed")
        self._journal = None

    def savepoint(self) -> tuple[int, int]:
        """A mark inside the open step that `rollback(savepoint)` returns to."""
        if self._journal is None:
            raise RuntimeError("savepoint outside a step")
        return len(self._journal), len(self._pending_copies)

    def rollback(self, savepoint: tuple[int, int] | None = None) -> None:
        """Undo the open step (or what followed `savepoint`); a no-op with no step open."""
        if self._journal is None:
            return
        num_kept, num_copies_kept = savepoint or (0, 0)
        if len(self._journal) > num_kept:
            self.structure_version += 1  # a plan built meanwhile is stale
        while len(self._journal) > num_kept:
            record = self._journal.pop()
            if isinstance(record, InsertRecord):
                self._undo_insert(record)
            else:
                self._undo_grow(record)
        del self._pending_copies[num_copies_kept:]
        if savepoint is None:
            self._chunk_events.clear()
            self.peak_live_chunks, self.pool.peak_used = self._peaks_at_begin
            self._journal = None

    def _journal_append(self, record: InsertRecord | GrowRecord) -> None:
        if self._journal is not None:
            self._journal.append(record)

    def _undo_insert(self, record: InsertRecord) -> None:
        seq = self._seqs.pop(record.seq_id)
        revived = {node.chunk_id for node, _ in record.revived}
        for node in reversed(seq.nodes):
            if self.pool.decref(node.chunk_id) == 0 and node.chunk_id not in revived:
                self._release(node)  # created by this insert
        # a copy source no one held may have been evicted since: it stays evicted
        touched = [(node, stamp) for node, stamp in record.touched if node.parent.children.get(node.chunk_id) is node]
        self._retained.restore(record.revived + touched)
        self.num_revived -= len(record.revived) + len(record.touched)

    def _undo_grow(self, record: GrowRecord) -> None:
        seq = self._seqs[record.seq_id]
        while len(seq.nodes) > record.num_nodes:  # chunks this growth started
            node = seq.nodes.pop()
            self.pool.decref(node.chunk_id)
            self._release(node)
        if seq.nodes:
            last = seq.nodes[-1]
            keep = record.length - (record.num_nodes - 1) * self.chunk_size
            if keep < len(last.tokens):  # the growth filled this chunk part of the way, or to full
                self._unindex(last)
                del last.tokens[keep:]
        seq.length = record.length
