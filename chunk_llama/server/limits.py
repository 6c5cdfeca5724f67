"""What one request may be: strict JSON bodies, counts of messages and prompts, and its
deadline.

FastAPI parses a body with `json.loads`, which takes `NaN` and `Infinity` (not JSON) and,
given bytes, guesses their encoding. `StrictJSONRoute` parses them as UTF-8 and refuses
non-finite numbers, invalid UTF-8 and nesting too deep for the parser: each a 400 naming
the problem, before any field is read. `BodyLimitMiddleware` refuses a body over
`max_request_bytes` with a 413 before reading it (by its Content-Length) or as soon as a
chunked one passes the limit (FastAPI's own `max_body_size` answers in plain text, not
OpenAI's error body). The sizes of the fields that bound the work are checked here; the
prompt's length against the context is the engine's check (`engine/inputs.py`).
"""

from __future__ import annotations

import json
import math
import time

from fastapi import Request
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chunk_llama.server.errors import OpenAIError
from chunk_llama.server.options import DeployArgs

CLIENT_TIMEOUT_SHARE = 0.9  # end a request at 90% of its client's timeout, so its answer arrives in time


def _refuse_constant(name: str):
    raise HTTPException(400, f"the body holds {name}, which is not a JSON number (non-finite numbers are refused)")


class BodyLimitMiddleware:
    """413 with OpenAI's error body for a request body over `max_bytes` (module doc);
    `on_refused()` counts one refused by its Content-Length (the app's handler of the
    HTTPException counts the others)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused=None):
        self.app, self.max_bytes, self.on_refused = app, max_bytes, on_refused

    def _too_large(self) -> HTTPException:
        return HTTPException(413, f"the request body is too large: this server takes at most {self.max_bytes} "
                                  "bytes")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            if self.on_refused is not None:
                self.on_refused()
            body = OpenAIError(self._too_large().detail, status=413).body()
            await JSONResponse(body, status_code=413, headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:  # FastAPI re-raises an HTTPException from the body's read
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)


class StrictJSONRequest(Request):
    """A request whose `json()` is strict (see module doc)."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as error:
                raise HTTPException(400, f"the body is not valid UTF-8 (byte {error.start})") from None
            try:
                self._json = json.loads(text, parse_constant=_refuse_constant)
            except RecursionError:
                raise HTTPException(400, "the body's JSON is nested too deeply") from None
        return self._json


class StrictJSONRoute(APIRoute):
    """An `APIRoute` whose handlers read `StrictJSONRequest`s."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler


def check_chat_size(body, deploy: DeployArgs) -> None:
    """A chat request has at most `max_messages` messages."""
    if len(body.messages) > deploy.max_messages:
        raise OpenAIError(f"messages: {len(body.messages)} messages, more than this server takes in one request "
                          f"({deploy.max_messages})", param="messages")


def check_completion_size(body, deploy: DeployArgs) -> None:
    """A completion request has at most `max_prompts` prompts."""
    count = len(body.prompts())
    if count > deploy.max_prompts:
        raise OpenAIError(f"prompt: {count} prompts, more than this server takes in one request "
                          f"({deploy.max_prompts})", param="prompt")


def request_deadline(request: Request, stream: bool, deploy: DeployArgs) -> float | None:
    """When the request must end (`time.perf_counter()`), or None: `--request-timeout` from
    now, shortened for a non-streaming request to `CLIENT_TIMEOUT_SHARE` of the client's own
    timeout, which the openai client sends as `x-stainless-read-timeout` (a streaming
    client's read timeout bounds the gap between chunks, not the whole answer)."""
    timeouts = [deploy.request_timeout] if deploy.request_timeout else []
    sent = request.headers.get("x-stainless-read-timeout")
    if sent is not None and not stream:
        try:
            client = float(sent)
        except ValueError:
            client = math.nan
        if math.isfinite(client) and client > 0:
            timeouts.append(client * CLIENT_TIMEOUT_SHARE)
    return time.perf_counter() + min(timeouts) if timeouts else None
