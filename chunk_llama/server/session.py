"""One HTTP request's engine requests: submit them, receive their deltas, abort them if
the client leaves.

A completion request with several prompts becomes one engine request per prompt;
all of them deliver to the session's one queue. Choice `i * n + j` is sample `j` of
prompt `i`, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

try:
    from jinja2 import TemplateError
except ImportError:  # without jinja2 no chat template renders at all (the engine says so)

    class TemplateError(Exception):
        """Stands in for jinja2's."""


from chunk_llama.engine.request import RequestDelta
from chunk_llama.server.convert import OpenAIError, explain
from chunk_llama.server.loop import Draining, EngineFailure, EngineLoop, Overloaded, Subscription

DISCONNECT_POLL_S = 0.5  # how often a non-streaming handler checks that its client is still there
OVERLOADED_RETRY_AFTER_S = 1  # a full queue turns over in about a request's time
DRAINING_RETRY_AFTER_S = 5  # time for a replacement to start (or a balancer to notice)


def refusal(error: Overloaded | Draining, metrics) -> OpenAIError:
    """The 429 (full queue) or 503 (shutting down) for `error`, counted in the metrics."""
    if isinstance(error, Overloaded):
        metrics.on_rejected("overloaded")
        return OpenAIError(str(error), status=429, type="rate_limit_exceeded", code="server_overloaded",
                           headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)})
    metrics.on_rejected("draining")
    return OpenAIError(str(error), status=503, type="server_error", code="shutting_down",
                       headers={"Retry-After": str(DRAINING_RETRY_AFTER_S)})


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


_GONE = object()  # queued by the disconnect watcher


class Session:
    """The engine requests of one HTTP request (see module doc)."""

    def __init__(self, loop: EngineLoop, n: int):
        self.loop = loop
        self.n = n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.subs: list[Subscription] = []
        self.prompt_tokens: list[int] = []  # per prompt, known once one of its samples finished
        self._prompt_index: dict[int, int] = {}
        self.remaining = 0  # samples not finished

    async def submit(self, requests, *, metrics, endpoint: str, deadline: float | None = None) -> None:
        """Queue every prompt of `requests` (`convert.EngineRequests`; the engine tokenizes and
        checks each, in a worker thread), to end by `deadline` (`time.perf_counter()`; None: no
        limit). A bad one raises `OpenAIError` and none of them stays queued; so does a full
        queue (429) or a server shutting down (503)."""
        event_loop = asyncio.get_running_loop()
        config = requests.config
        count = len(requests.prompts)
        try:
            self.loop.reserve(count)  # before the tokenizing: refusing must cost nothing
        except (Overloaded, Draining) as error:
            raise refusal(error, metrics) from None
        submitted = 0

        def work():
            nonlocal submitted
            for prompt in requests.prompts:
                try:
                    sub = self.loop.submit(prompt, config, event_loop, self.queue, reserved=True, deadline=deadline,
                                           **requests.kwargs())
                    submitted += 1
                except TemplateError as error:
                    raise OpenAIError(
                        f"the chat template cannot render these messages: {error}", param="messages"
                    ) from error
                self._prompt_index[sub.request_id] = len(self.subs)
                self.subs.append(sub)
                self.prompt_tokens.append(0)
                self.remaining += sub.num_samples

        try:
            await asyncio.to_thread(work)
        except (ValueError, TypeError) as error:
            self.close()
            raise OpenAIError(explain(error, config)) from error
        except Draining as error:
            self.close()
            raise refusal(error, metrics) from None
        except BaseException:
            self.close()
            raise
        finally:
            self.loop.release(count - submitted)
        metrics.on_request(endpoint, len(self.subs))

    async def deltas(self, request=None) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(choice index, delta) until every sample finished. With `request` (non-streaming)
        raises `ClientGone` when its client disconnects; a failed engine step raises
        `OpenAIError` (500)."""
        watcher = asyncio.create_task(self._watch(request)) if request is not None else None
        try:
            while self.remaining:
                item = await self.queue.get()
                if item is _GONE:
                    raise ClientGone()
                if isinstance(item, EngineFailure):
                    raise OpenAIError(str(item), status=500, type="server_error")
                for delta in item:
                    prompt = self._prompt_index[delta.request_id]
                    if delta.finished:
                        self.remaining -= 1
                        self.prompt_tokens[prompt] = len(delta.output.prompt_token_ids)
                    yield prompt * self.n + delta.index, delta
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _watch(self, request) -> None:
        """Put `_GONE` in the queue when the client of `request` disconnects."""
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        self.queue.put_nowait(_GONE)

    def close(self) -> None:
        """Abort the requests that have not finished (a no-op for those that have)."""
        for sub in self.subs:
            self.loop.abort(sub)
