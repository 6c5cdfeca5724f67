"""Admission and preemption: who runs this step, under the batch and memory limits."""

from __future__ import annotations

from collections import deque

from chunk_llama.engine.request import Sequence
from chunk_llama.hf.cache import ChunkCache
from chunk_llama.kv import KVCacheFull


def arrival_order(seq: Sequence) -> tuple[int, int]:
    """Requests are numbered as they are submitted; a request's samples by index."""
    return seq.request_id, seq.index


class Scheduler:
    """First come, first served, with memory-aware admission.

    A request's unfinished samples move together: admitted, preempted and requeued
    as one group (they draw their tokens together, see `request.SampleGroup`). The
    head of the queue is admitted when the batch has room for its group and the pool
    (free plus evictable retained chunks) can hold its uncached tokens while keeping
    one chunk per running sequence to grow into, so the next decode step rarely needs
    a preemption. Nothing behind a head that does not fit jumps ahead, so no request
    starves. `max_prefill_tokens` bounds the uncached prompt tokens admitted in one
    step, except that the first group of a step is always admitted.

    When a decode step still runs out of chunks, the request that arrived last among
    the running is preempted: its sequences leave the tree (their full chunks stay
    cached as a retained prefix) and go back to the queue in arrival order, keeping
    the tokens they generated; when room returns they are prefilled again, mostly
    from the cache.
    """

    def __init__(self, cache: ChunkCache, max_batch_size: int, max_prefill_tokens: int):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's samples (consecutive in the queue)."""
        self.waiting.extend(seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[tuple[Sequence, int]]:
        """Move waiting groups into the tree; returns (sequence, cached length) pairs."""
        admitted: list[tuple[Sequence, int]] = []
        num_new_tokens = 0
        try:
            while self.waiting:
                group = self._head_group()
                if len(self.running) + len(group) > self.max_batch_size:
                    break
                mark = self.cache.savepoint()
                placed = self._place(group, num_new_tokens if admitted else None)
                if placed is None:
                    self.cache.rollback_to(mark)
                    break
                for _ in group:
                    self.waiting.popleft()
                self.running.extend(group)
                admitted += placed
                num_new_tokens += sum(len(seq.all_ids) - cached for seq, cached in placed)
        except BaseException:  # nothing of this step may stay in the tree
            self.cache.end_step(completed=False)
            self.requeue([seq for seq, _ in admitted])
            raise
        return admitted

    def _head_group(self) -> list[Sequence]:
        request_id = self.waiting[0].request_id
        group = []
        for seq in self.waiting:
            if seq.request_id != request_id:
                break
            group.append(seq)
        return group

    def _place(self, group: list[Sequence], tokens_so_far: int | None) -> list[tuple[Sequence, int]] | None:
        """Insert a group's sequences, or None when the step's budget or the pool says wait
        (the caller rolls the partial insert back). tokens_so_far: None for a step's first group."""
        tree = self.cache.tree
        placed: list[tuple[Sequence, int]] = []
        for seq in group:
            ids = seq.all_ids
            new_tokens = len(ids) - tree.match_len(ids, len(ids) - 1)
            if tokens_so_far is not None:
                tokens_so_far += new_tokens
                if tokens_so_far > self.max_prefill_tokens:
                    return None
            reserve = len(self.running) + len(placed) + 1
            can_wait = bool(self.running or placed or tokens_so_far is not None)
            if can_wait and tree.chunks_needed(ids, len(ids) - 1) + reserve > tree.num_available():
                return None
            try:
                placed.append((seq, self.cache.add_sequence(seq.seq_id, ids)))
            except KVCacheFull:
                if can_wait:
                    return None
                raise  # nothing else holds memory: the submission check should have refused it
        return placed

    def preempt_newest(self) -> list[Sequence]:
        """Take the running request that arrived last out of the tree and requeue it."""
        request_id = max(seq.request_id for seq in self.running)
        victims = [seq for seq in self.running if seq.request_id == request_id]
        for seq in victims:
            self.cache.remove_sequence(seq.seq_id)
        self.requeue(victims)
        self.num_preemptions += 1
        return victims

    def requeue(self, seqs: list[Sequence]) -> None:
        """Put running sequences back in the queue in arrival order (they leave `running`;
        the caller has taken them out of the tree)."""
        gone = set(map(id, seqs))
        self.running = [seq for seq in self.running if id(seq) not in gone]
        self.waiting = deque(sorted([*self.waiting, *seqs], key=arrival_order))

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.remove_sequence(seq.seq_id)

    def abort(self, request_id: int) -> list[Sequence]:
        """Drop every sequence of a request, waiting or running; returns them."""
        dropped = [s for s in self.waiting if s.request_id == request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.finish(seq)
            dropped.append(seq)
        return dropped
