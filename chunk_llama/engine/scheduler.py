"""Admission and preemption: who runs this step, under the batch and memory limits."""

from __future__ import annotations

from collections import deque

from chunk_llama.engine.request import Sequence
from chunk_llama.hf.cache import ChunkCache


class Scheduler:
    """First come, first served, with memory-aware admission.

    A waiting sequence is admitted when the batch has room and the pool (free plus
    evictable retained chunks) can hold its uncached tokens while keeping one
    chunk per running sequence to grow into, so the next decode step rarely needs
    a preemption. The queue is served in arrival order: when its head does not
    fit, nothing behind it jumps ahead, so no request starves.

    When a decode step still runs out of chunks, the newest running sequence is
    preempted: it leaves the tree (its full chunks stay cached as a retained
    prefix) and goes back to the front of the queue, keeping the tokens it
    generated; when room returns it is prefilled again, mostly from its cache.
    """

    def __init__(self, cache: ChunkCache, max_batch_size: int, max_prefill_tokens: int):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[tuple[Sequence, int]]:
        """Move waiting sequences into the tree; returns (sequence, cached length) pairs."""
        admitted: list[tuple[Sequence, int]] = []
        num_tokens = 0
        tree = self.cache.tree
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            ids = seq.all_ids
            if admitted and num_tokens + len(ids) > self.max_prefill_tokens:
                break
            reserve = len(self.running) + 1
            if tree.chunks_needed(ids, len(ids) - 1) + reserve > tree.num_available() and self.running:
                break
            matched = self.cache.add_sequence(seq.seq_id, ids)  # KVCacheFull only if nothing runs
            self.waiting.popleft()
            self.running.append(seq)
            admitted.append((seq, matched))
            num_tokens += len(ids) - matched
        return admitted

    def preempt_newest(self) -> Sequence:
        seq = self.running.pop()
        self.cache.remove_sequence(seq.seq_id)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.remove_sequence(seq.seq_id)

    def abort(self, request_id: int) -> list[Sequence]:
        """Drop every sequence of a request, waiting or running; returns them."""
        dropped = [s for s in self.waiting if s.request_id == request_id]
        for seq in dropped:
            self.waiting.remove(seq)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.finish(seq)
            dropped.append(seq)
        return dropped
