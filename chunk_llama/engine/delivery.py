"""Who gets which delta: the engine's requests between threads.

`add_request` and `abort` only queue (under `_lock`); one iteration runs at a time (the
step lock); `generate` and `stream` each get their own requests' deltas through a private
channel, and `step()` those of `add_request`'s requests (`_undelivered`). A caller that
stops early aborts its own requests. `ChunkLlamaEngine` is this plus its public API.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

from chunk_llama.engine.inputs import is_chat
from chunk_llama.engine.outputs import make_delta
from chunk_llama.engine.request import RequestDelta, Sequence


class Delivery:
    """The request bookkeeping of `ChunkLlamaEngine` (which sets `scheduler`, `runner`,
    `inputs`; `_init_delivery` the rest)."""

    def _init_delivery(self) -> None:
        self._step_lock = threading.Lock()  # one iteration at a time
        self._step_owner: int | None = None
        self._lock = threading.Lock()  # guards everything below
        self._inbox: list[list[Sequence]] = []
        self._aborts: list[int] = []
        self._deadlines: dict[int, float] = {}  # request id -> perf_counter time it must end by
        self._live: dict[int, list[Sequence]] = {}  # request id -> its sequences, until all finish
        self._channels: dict[int, deque[RequestDelta]] = {}  # requests of a generate / stream call
        self._undelivered: list[RequestDelta] = []  # deltas of add_request's requests, for step()
        self._num_submitting = 0  # add_request calls still tokenizing
        self._next_request_id = 0
        self._next_seq_id = 0
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ChunkLlamaEngine was closed; create a new one")

    @contextlib.contextmanager
    def _stepping(self):
        """Hold the step lock; re-entering from inside a step (a processor calling the
        engine) would deadlock, so it raises instead."""
        if self._step_owner == threading.get_ident():
            raise RuntimeError("the engine was called from inside one of its own steps")
        with self._step_lock:
            self._step_owner = threading.get_ident()
            try:
                yield
            finally:
                self._step_owner = None

    def _enqueue(self, batches: list[list[Sequence]], channel: deque | None = None,
                 deadline: float | None = None) -> list[int]:
        """Number the requests (arrival order) and queue them; returns their ids."""
        request_ids = []
        with self._lock:
            for seqs in batches:
                request_id = self._next_request_id
                self._next_request_id += 1
                for seq in seqs:
                    seq.request_id, seq.seq_id = request_id, self._next_seq_id
                    self._next_seq_id += 1
                self._inbox.append(seqs)
                self._live[request_id] = seqs
                if channel is not None:
                    self._channels[request_id] = channel
                if deadline is not None:
                    self._deadlines[request_id] = float(deadline)
                request_ids.append(request_id)
        return request_ids

    def _wait(self, channel: deque) -> None:
        """Until `channel` has a delta: run an iteration unless another caller's run filled it."""
        with self._stepping():
            if not channel:
                self._check_open()
                self._iterate()

    def _leave(self, request_ids: list[int], aborted: bool) -> None:
        """A generate / stream call is done with its requests: drop its channel, and
        abort those still unfinished (the caller stopped early)."""
        if aborted:
            with self._stepping():
                if not self._closed:
                    wanted = set(request_ids)
                    with self._lock:
                        self._inbox = [seqs for seqs in self._inbox if seqs[0].request_id not in wanted]
                    for request_id in request_ids:
                        self.scheduler.abort(request_id)
        with self._lock:
            for request_id in request_ids:
                self._channels.pop(request_id, None)
                if aborted:
                    self._live.pop(request_id, None)
                    self._deadlines.pop(request_id, None)

    def _iterate(self) -> None:
        """One iteration (caller holds the step lock); every delta goes to its consumer,
        those that advanced before an exception included."""
        now = time.perf_counter()
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            expired = [r for r, deadline in self._deadlines.items() if deadline <= now]
            for request_id in expired:
                del self._deadlines[request_id]
        for seqs in inbox:
            self.scheduler.add(seqs)
        deltas = []
        for request_ids, reason in ((aborts, "abort"), (expired, "length")):
            for request_id in request_ids:
                for seq in self.scheduler.abort(request_id):
                    seq.finish_reason = reason
                    deltas.append(self._delta(seq))
        try:
            if self.scheduler.has_work():
                self.runner.run_iteration()
        finally:
            deltas += [self._delta(seq) for seq in self.runner.take_advanced()]
            with self._lock:
                for delta in deltas:
                    self._channels.get(delta.request_id, self._undelivered).append(delta)

    def _delta(self, seq: Sequence) -> RequestDelta:
        delta = make_delta(seq, self.inputs)
        if delta.finished and seq.finish_reason != "abort" and self.inputs.conversations is not None \
                and is_chat(seq.prompt):
            self.inputs.conversations.record(seq.prompt_ids, seq.output_ids)  # the next turn may continue it
        if delta.finished:
            with self._lock:
                if all(s.is_finished for s in self._live.get(seq.request_id, [])):
                    self._live.pop(seq.request_id, None)
                    self._deadlines.pop(seq.request_id, None)
        return delta
