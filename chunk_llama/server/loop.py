"""The engine loop: one thread steps the engine; HTTP handlers only queue and listen.

A handler calls `submit` (from a worker thread: tokenizing and validating a long
prompt takes a while), which queues the request with `engine.add_request` and
returns a `Subscription`: an `asyncio.Queue` on the handler's event loop that
receives the request's `RequestDelta`s, handed over with `call_soon_threadsafe`
after each step. A step may run between `add_request` and the subscription; its
deltas wait in `_early` until then. A handler that stops listening (its client left) calls `abort`.

If a step raises (a bug, or memory the engine could not find), every request in
flight gets the error as its last item and is aborted, and the loop goes on: a
failed step would otherwise be retried with the same requests forever.

Overload: with `max_waiting`, a handler `reserve`s room for its requests before it
tokenizes them; the queue (requests submitted or reserved and not running) is bounded,
and `reserve` raises `Overloaded` beyond it. Drain (`drain(timeout)`, on SIGTERM): new
requests are refused (`Draining`), those in flight run on until they finish or the
timeout passes, when they are aborted (each still gets its last delta, with what it
generated); then the loop ends.

`chunk-llama serve` runs the loop in the main thread (`run`) and uvicorn in another:
the kernels' OpenMP teams belong to the thread that starts them, and once the main
thread has one (loading the model makes it), parallel regions started from any other
thread ran 1.7-2x slower here (libgomp, 2 cores: a decode step 45 -> 59 ms). `start`
runs the loop in a thread of its own (tests, an app embedded elsewhere).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from chunk_llama.engine.request import RequestDelta

logger = logging.getLogger(__name__)


class EngineFailure(Exception):
    """A step of the engine raised while this request was in flight."""


class Overloaded(Exception):
    """The queue is full; `waiting` requests wait for the batch."""

    def __init__(self, waiting: int):
        super().__init__(f"the server is overloaded: {waiting} requests are already waiting; retry later")
        self.waiting = waiting


class Draining(Exception):
    """The server is shutting down and takes no new request."""

    def __init__(self):
        super().__init__("the server is shutting down and takes no new requests")


@dataclass(eq=False)
class Subscription:
    """Where one request's deltas go, in order: a queue on the event loop of the handler
    that submitted it. Items are lists of `RequestDelta` or, once, an `EngineFailure`."""

    request_id: int
    num_samples: int
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    num_finished: int = 0


class EngineLoop:
    """Owns the thread that calls `engine.step()`; `start` it, `stop` it at shutdown.

    `on_deltas(deltas)`, `on_finish(output)` and `on_admitted(arrival_times, step_start)`
    (optional) are called in the loop thread for every delta of a step, every finished
    sample, and the requests a step admitted (the metrics use them).
    """

    def __init__(self, engine, *, on_deltas=None, on_finish=None, on_admitted=None, idle_wait: float = 0.5,
                 max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_deltas = on_deltas
        self.on_finish = on_finish
        self.on_admitted = on_admitted
        self._admitted: set[int] = set()  # requests in flight seen running (a preempted one stays in)
        self.idle_wait = idle_wait
        self._lock = threading.Lock()
        self._subs: dict[int, Subscription] = {}
        self._early: dict[int, list[list[RequestDelta]]] = {}  # deltas that came before their subscriber
        self._num_submitting = 0
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        self._reserved = 0  # requests that passed `reserve` and are not submitted yet
        self._drain_deadline: float | None = None  # time.monotonic() when draining
        self._drain_aborted = False
        self.num_running = 0  # requests in the engine's batch after the last step
        self.num_in_flight = 0  # requests submitted and not finished

    # ------------------------------------------------------------ handlers' side
    @property
    def num_waiting(self) -> int:
        """Requests submitted or reserved that are not in the batch."""
        return max(0, len(self._subs) + self._reserved - self.num_running)

    def reserve(self, count: int) -> None:
        """Hold room in the queue for `count` requests about to be submitted (`submit` with
        `reserved=True` takes one each; `release` gives back what was not). Raises `Draining`
        while draining, `Overloaded` when the queue has no room."""
        with self._lock:
            if self.draining or self._stopping.is_set():
                raise Draining()
            waiting = self.num_waiting
            if self.max_waiting is not None and waiting + count > self.max_waiting:
                raise Overloaded(waiting)
            self._reserved += count

    def release(self, count: int) -> None:
        """Give back reserved room that no request took."""
        with self._lock:
            self._reserved = max(0, self._reserved - count)

    def submit(self, prompt, config, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, *,
               reserved: bool = False, **request_kwargs) -> Subscription:
        """Queue a request whose deltas go to `queue` on `loop` (several requests may share
        one); `request_kwargs` go to `add_request` (grammar, logits_processor, deadline);
        `reserved`: it takes room `reserve` held. Blocking (`add_request` tokenizes): call it
        from a worker thread. Raises what `add_request` raises for a bad request (ValueError /
        TypeError), and `Draining` while draining."""
        if self.draining or self._stopping.is_set():
            raise Draining()
        with self._lock:
            self._num_submitting += 1
        try:
            request_id = self.engine.add_request(prompt, config, **request_kwargs)
            with self._lock:
                sub = Subscription(request_id, config.num_return_sequences or 1, queue, loop)
                self._subs[request_id] = sub
                if reserved:
                    self._reserved = max(0, self._reserved - 1)
                for items in self._early.pop(request_id, []):  # a step ran before it was subscribed
                    self._accept(sub, items)
                self.num_in_flight = len(self._subs)
        finally:
            with self._lock:
                self._num_submitting -= 1
                if not self._num_submitting:
                    self._early.clear()  # what is left belongs to aborted requests
        self._wake.set()
        return sub

    def abort(self, sub: Subscription) -> None:
        """Stop a request (its client left); a finished one is left as is."""
        with self._lock:
            live = self._subs.pop(sub.request_id, None) is not None
            self.num_in_flight = len(self._subs)
        if live:
            self.engine.abort(sub.request_id)
            self._wake.set()

    # ------------------------------------------------------------ loop thread
    def start(self) -> None:
        """Run the loop in a thread of its own."""
        self._thread = threading.Thread(target=self.run, name="chunk-llama-engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight and end the loop (and its thread, if it has one)."""
        self._stopping.set()
        self._wake.set()
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            self.engine.abort(sub.request_id)
            self._deliver(sub, EngineFailure("the server is shutting down"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def drain(self, timeout: float) -> None:
        """Take no new request; let those in flight finish for up to `timeout` seconds, then
        abort the rest. The loop ends once none is left (`run` returns). Safe in a signal
        handler: it takes no lock (the handler may run in the loop thread while it holds one);
        the loop sees it at its next step, or within `idle_wait` when idle."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + timeout

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def _drained(self) -> bool:
        """While draining: whether nothing is left; past the deadline, abort what is."""
        with self._lock:
            if not self._subs and not self._num_submitting:
                return True
            subs = list(self._subs.values())
            if self._drain_aborted or time.monotonic() < self._drain_deadline:
                return False
            self._drain_aborted = True
        logger.warning("drain timeout: aborting %d requests still running", len(subs))
        for sub in subs:  # their abort deltas reach their handlers as usual
            self.engine.abort(sub.request_id)
        return False

    @property
    def alive(self) -> bool:
        """Whether the loop runs (in its thread, or in the thread that called `run`)."""
        return self._running.is_set()

    def run(self) -> None:
        """Step the engine in this thread until `stop`."""
        self._running.set()
        try:
            self._step_until_stopped()
        finally:
            self._running.clear()

    def _step_until_stopped(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._wake.clear()
            if self.draining and self._drained():
                logger.info("drained: no request left")
                return
            if not engine.has_unfinished_requests():
                self._wake.wait(self.idle_wait)
                continue
            step_start = time.perf_counter()
            try:
                deltas = engine.step()
            except Exception as error:  # noqa: BLE001 - reported to every request in flight
                logger.exception("an engine step failed; aborting the requests in flight")
                self._fail_all(error)
                continue
            self._count_running(step_start)
            if deltas:
                self._dispatch(deltas)

    def _count_running(self, step_start: float) -> None:
        scheduler = self.engine.scheduler
        live = {s.request_id: s.arrival_time for s in [*scheduler.running, *scheduler.partial]}
        self.num_running = len(live)
        admitted = [arrival for request_id, arrival in live.items() if request_id not in self._admitted]
        with self._lock:
            self._admitted = {r for r in self._admitted if r in self._subs} | set(live)
        if admitted and self.on_admitted is not None:
            self.on_admitted(admitted, step_start)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        if self.on_deltas is not None:
            self.on_deltas(deltas)
        by_sub: dict[int, list[RequestDelta]] = {}
        for delta in deltas:
            by_sub.setdefault(delta.request_id, []).append(delta)
        # One wake-up per event loop and step, not one per request: each wake-up takes the
        # GIL and a core from the step that follows.
        outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, list[RequestDelta]]]] = {}
        for request_id, items in by_sub.items():
            with self._lock:
                sub = self._subs.get(request_id)
                if sub is not None:
                    self._accept(sub, items, outbox)
                elif self._num_submitting:  # maybe a request whose submit has not subscribed yet
                    self._early.setdefault(request_id, []).append(items)
                # else aborted: its client is gone
        for event_loop, pairs in outbox.items():
            try:
                event_loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # the handlers' event loop is closed
                pass
        if self.on_finish is not None:
            for delta in deltas:
                if delta.finished and delta.output is not None:
                    self.on_finish(delta.output)

    def _accept(self, sub: Subscription, items: list[RequestDelta], outbox: dict | None = None) -> None:
        """Deliver a step's deltas of one request (caller holds the lock), now or through
        `outbox` (event loop -> [(queue, items)]); forget the request once done."""
        sub.num_finished += sum(d.finished for d in items)
        if sub.num_finished >= sub.num_samples:
            del self._subs[sub.request_id]
            self.num_in_flight = len(self._subs)
        if outbox is None:
            self._deliver(sub, items)
        else:
            outbox.setdefault(sub.loop, []).append((sub.queue, items))

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
            self.num_in_flight = 0
        failure = EngineFailure(f"the engine failed: {type(error).__name__}: {error}")
        for sub in subs:
            try:
                self.engine.abort(sub.request_id)
            except ValueError:
                pass
            self._deliver(sub, failure)
        try:  # take the aborts out now, so the failing requests leave the batch
            self.engine.step()
        except Exception:  # noqa: BLE001
            logger.exception("the engine step that removes the failed requests failed too")

    @staticmethod
    def _deliver(sub: Subscription, item) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)
        except RuntimeError:  # the handler's event loop is closed
            pass


def _put_all(pairs: list[tuple[asyncio.Queue, list[RequestDelta]]]) -> None:
    """On the handlers' event loop: a step's deltas into their requests' queues."""
    for queue, items in pairs:
        queue.put_nowait(items)
