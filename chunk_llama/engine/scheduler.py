"""Admission and preemption: who runs this step, under the batch and memory limits."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from chunk_llama.engine.request import Sequence
from chunk_llama.hf.cache import ChunkCache
from chunk_llama.hf.lora.registry import AdapterUnavailable
from chunk_llama.kv import KVCacheFull

logger = logging.getLogger(__name__)


def arrival_order(seq: Sequence) -> tuple[int, int]:
    """Requests are numbered as they are submitted; a request's samples by index."""
    return seq.request_id, seq.index


@dataclass
class PrefillWork:
    """One sequence's share of a prefill step: it computes positions `start` up to what the
    tree holds for it (`reused` of its leading tokens were found cached on admission)."""

    seq: Sequence
    start: int
    reused: int


class Scheduler:
    """First come, first served, with memory-aware admission and chunked prefill.

    A request's unfinished samples move together: admitted, preempted and requeued
    as one group (they draw their tokens together, see `request.SampleGroup`). The
    head of the queue is admitted when the batch has room for its group and the pool
    (free plus evictable retained chunks) can hold its uncached tokens while keeping
    one chunk per running sequence to grow into, so the next decode step rarely needs
    a preemption. Nothing behind a head that does not fit jumps ahead, so no request
    starves.

    `max_prefill_tokens` bounds the uncached prompt tokens computed in one step. A
    prompt with more uncached tokens than the step has left is prefilled in pieces
    over several steps (chunked prefill), each with the decode of the
    running requests, so their inter-token latency stays bounded while a long
    prompt is admitted. Only that group's first sample is in the tree meanwhile
    (`partial`; one group at a time, and nothing is admitted behind it); its other
    samples join at the last piece and share its chunks.

    Adapters: a request under an adapter is admitted with its weights (`AdapterRegistry.acquire`:
    read again from their folder if they were evicted); where `max_loras` adapters are
    resident and every one is in use by a running request, the head waits like one that
    does not fit the pool. A request whose adapter no longer reads finishes at once with
    `finish_reason="abort"` (`take_failed`). Its sequences are inserted under the adapter's
    identity: only K/V the same weights computed are matched.

    When a decode step still runs out of chunks, the request that arrived last among
    the running (and the partial) is preempted: its sequences leave the tree (their
    full chunks stay cached as a retained prefix) and go back to the queue in arrival
    order, keeping the tokens they generated; when room returns they are prefilled
    again, mostly from the cache.
    """

    def __init__(self, cache: ChunkCache, max_batch_size: int, max_prefill_tokens: int, adapters=None):
        self.cache = cache
        self.adapters = adapters  # AdapterRegistry, or None (every request runs the model as it is)
        self.failed: list[Sequence] = []  # requests whose adapter could not be read (`take_failed`)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.partial: list[Sequence] = []  # the group whose prompt is prefilled in pieces
        self.num_preemptions = 0
        self._before_admission: tuple[list, deque, list] | None = None

    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's samples (consecutive in the queue)."""
        self.waiting.extend(seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.partial)

    def admit(self) -> list[PrefillWork]:
        """This step's prefill: the next piece of the partial prompt, then waiting groups
        moved into the tree while the batch, the pool and the token budget allow. The
        step is undone with `undo_admission` (after the cache's rollback) if it fails."""
        self._before_admission = (list(self.running), deque(self.waiting), list(self.partial))
        work: list[PrefillWork] = []
        try:
            budget = self._continue_partial(work) if self.partial else self.max_prefill_tokens
            while self.waiting and budget > 0 and not self.partial:
                group = self._head_group()
                if len(self.running) + len(group) > self.max_batch_size:
                    break
                mark = self.cache.savepoint()
                try:
                    placed = self._place(group, budget, can_wait=bool(self.running or work))
                except AdapterUnavailable as error:
                    self.cache.rollback_to(mark)
                    self._fail(group, error)
                    continue
                if placed is None:
                    self.cache.rollback_to(mark)
                    break
                for _ in group:
                    self.waiting.popleft()
                if self.partial is not group:
                    self.running.extend(group)
                work += placed
                budget -= sum(self.cache.tree.seq_len(w.seq.seq_id) - w.start for w in placed)
        except BaseException:  # nothing of this step may stay in the tree
            self.cache.end_step(completed=False)
            self.undo_admission()
            raise
        return work

    def undo_admission(self) -> None:
        """Put the queue, the running list and the partial group back as they were before
        this step's `admit` (the cache has rolled the step back)."""
        if self._before_admission is not None:
            running, waiting, partial = self._before_admission
            # (requests that failed admission stay finished)
            self.running, self.partial = running, partial
            self.waiting = deque(seq for seq in waiting if not seq.is_finished)
            self._before_admission = None

    def _continue_partial(self, work: list[PrefillWork]) -> int:
        """Queue the next piece of the partial prompt; returns the step's budget left.
        At its last piece the group's other samples join and the group runs."""
        head = self.partial[0]
        ids, done = head.all_ids, self.cache.tree.seq_len(head.seq_id)
        end = min(len(ids), done + self.max_prefill_tokens)
        try:
            self.cache.extend_sequence(head.seq_id, ids[done:end])
        except KVCacheFull:
            if not self.running:
                raise
            return 0  # decoding requests grew into its room: it waits for them to finish
        work.append(PrefillWork(head, done, 0))
        budget = self.max_prefill_tokens - (end - done)
        if end == len(ids):
            for seq in self.partial[1:]:
                cached = self.cache.add_sequence(seq.seq_id, seq.all_ids, seq.lora)
                work.append(PrefillWork(seq, cached, cached))
                budget -= len(seq.all_ids) - cached
            self.running.extend(self.partial)
            self.partial = []
        return budget

    def _head_group(self) -> list[Sequence]:
        request_id = self.waiting[0].request_id
        group = []
        for seq in self.waiting:
            if seq.request_id != request_id:
                break
            group.append(seq)
        return group

    def _place(self, group: list[Sequence], budget: int, can_wait: bool) -> list[PrefillWork] | None:
        """Insert a group's sequences, or None when the pool says wait (the caller rolls the
        partial insert back). A prompt with more uncached tokens than `budget` starts in
        pieces: only its first sample goes in, with `budget` tokens to compute."""
        tree = self.cache.tree
        if not self._acquire(group):
            return None
        key = self.cache.key_of(group[0].lora)
        placed: list[PrefillWork] = []
        for seq in group:
            ids = seq.all_ids
            reserve = len(self.running) + len(placed) + 1
            if can_wait and tree.chunks_needed(ids, len(ids) - 1, key) + reserve > tree.num_available():
                return None
            cached = tree.match_len(ids, len(ids) - 1, key)
            if not placed and len(ids) - cached > budget:
                ids = ids[: cached + budget]
                self.partial = group
            try:
                cached = self.cache.add_sequence(seq.seq_id, ids, seq.lora)
            except KVCacheFull:
                if can_wait or placed:
                    if self.partial is group:
                        self.partial = []
                    return None
                raise  # nothing else holds memory: the submission check should have refused it
            placed.append(PrefillWork(seq, cached, cached))
            if self.partial is group:
                break
            can_wait = True
        return placed

    def _acquire(self, group: list[Sequence]) -> bool:
        """Give a group its adapter's weights (`seq.lora`); False: every resident place is in use."""
        if self.adapters is None or group[0].adapter is None:
            return True
        busy = {seq.adapter for seq in self.running + self.partial}
        lora = self.adapters.acquire(group[0].adapter, busy)
        if lora is None:
            return False
        for seq in group:
            seq.lora = lora
        return True

    def _fail(self, group: list[Sequence], error: Exception) -> None:
        logger.error("chunk-llama: request %d ends unanswered: %s", group[0].request_id, error)
        for seq in group:
            self.waiting.popleft()
            seq.finish_reason = "abort"
        self.failed += group

    def take_failed(self) -> list[Sequence]:
        """Requests that finished in admission (their adapter could not be read) since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def can_preempt(self) -> bool:
        """Whether another request than the one a preemption would spare holds chunks."""
        return len({seq.request_id for seq in self.running + self.partial}) > 1

    def preempt_newest(self) -> list[Sequence]:
        """Take the request that arrived last (running or partial) out of the tree and requeue it."""
        request_id = max(seq.request_id for seq in self.running + self.partial)
        victims = [seq for seq in self.running + self.partial if seq.request_id == request_id]
        self._preempt(victims)
        return victims

    def _preempt(self, victims: list[Sequence]) -> None:
        for seq in victims:
            if seq.seq_id in self.cache.tree:  # a partial group's later samples are not
                self.cache.remove_sequence(seq.seq_id)
        if victims[0] in self.partial:
            self.partial = []
        self.requeue(victims)
        self.num_preemptions += 1

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
        """Drop every sequence of a request, waiting, partial or running; returns them."""
        dropped = [s for s in self.waiting if s.request_id == request_id]
        self.waiting = deque(s for s in self.waiting if s.request_id != request_id)
        if self.partial and self.partial[0].request_id == request_id:
            dropped += self.partial
            self.cache.remove_sequence(self.partial[0].seq_id)
            self.partial = []
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.finish(seq)
            dropped.append(seq)
        return dropped
