"""API keys: every `/v1/*` request (and `/metrics`, if asked) must carry one of the server's
keys as `Authorization: Bearer <key>`, as OpenAI's API takes it; `/health` stays open for
load balancers, and CORS preflights (OPTIONS) pass, since browsers send them without
credentials.

The check compares SHA-256 digests of the sent token and of every key with
`hmac.compare_digest`, all keys every time: how long it takes tells nothing about a
key's length, its contents or which key matched.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from chunk_llama.server.errors import OpenAIError


def read_key_file(path: str) -> list[str]:
    """The keys in `path`: one a line; blank lines and lines starting with `#` are skipped."""
    with open(path, encoding="utf-8") as f:
        keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    return keys


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class ApiKeyMiddleware:
    """Refuses a protected request without a valid key: 401 with OpenAI's error body
    (`code: "invalid_api_key"`) and `WWW-Authenticate: Bearer`. `on_refused()` is called
    for each refusal (the metrics count them)."""

    def __init__(self, app: ASGIApp, keys: list[str], *, protect_metrics: bool = False, on_refused=None):
        if not keys or not all(isinstance(k, str) and k.strip() for k in keys):
            raise ValueError("API keys must be non-empty strings")
        self.app = app
        self._digests = [_digest(k.strip().encode("utf-8")) for k in keys]
        self.protect_metrics = protect_metrics
        self.on_refused = on_refused

    def _protected(self, scope: Scope) -> bool:
        path = scope["path"]
        if scope["method"] == "OPTIONS":
            return False
        return path == "/v1" or path.startswith("/v1/") or (self.protect_metrics and path == "/metrics")

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        sent = _digest(token.strip())
        matched = False
        for digest in self._digests:  # no early exit: the time does not depend on which key matched
            matched |= hmac.compare_digest(sent, digest)
        return matched and scheme.lower() == b"bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._protected(scope) and not self._authorized(scope):
            if self.on_refused is not None:
                self.on_refused()
            error = OpenAIError("a valid API key is required: send it as 'Authorization: Bearer <key>'", status=401,
                                code="invalid_api_key")
            response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
