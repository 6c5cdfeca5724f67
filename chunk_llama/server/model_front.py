"""The front of `chunk-llama serve --data-parallel`: each request to its model's router.

A worker's prefix cache is keyed by the adapter that computed the K/V, so a prompt cached
under adapter A on worker 1 saves nothing for the same prompt under adapter B. sglang-router
0.3.2 routes by the request's text in one tree for all the models of its workers, so it
sends both to worker 1; its multi-model mode (`--enable-igw`) does not start offline and
keys one model per worker URL (docs/ARCHITECTURE.md, "Replicas"). So the launcher runs one
router per model name (`router_pool.py`) and this small ASGI app in front of them: it reads
a request's `model` and relays the request, unchanged, to that model's router, which keeps
the cache-aware policy, the health checks, the retries and the circuit breaker; the front
only picks which tree a request goes into. The routes:

- `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses`: the body's `model`
  picks the router (`RouterPool.url_for`: a name without a router of its own, or none, goes
  to the base model's, whose worker answers an unknown name with the 400 one server gives).
  The answer streams back as it arrives, headers included (`X-Chunk-Llama-Worker`). A body
  over `max_body` bytes is not parsed: it goes on whole, and the worker answers 413.
- `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter`: to every worker at once, with
  the client's headers (each worker checks the key); once all that answer have loaded it,
  the adapter's router starts (after `load_inplace`, a fresh one: the old tree points at K/V
  of the weights replaced). A load some worker refuses is undone on the others (except with
  `load_inplace`, which replaced theirs), and that refusal is the answer. An unload stops
  the router once no worker has the adapter.
- `GET /v1/models`, `/v1/models/{model}`, `POST /tokenize`, `/detokenize`: to a worker
  (every worker serves the same models; the router answers `/v1/models` with its one
  registered model and has no `/tokenize` for HTTP workers).
- `POST /workers` (`{"url"}`): a worker joining at run time, added to the router of each
  model it serves. `DELETE /workers/{id}` (the id `GET /workers` lists, or the worker's URL):
  out of every model's router and of the adapter fan-out, answered once no router lists it
  (the worker keeps running).
- anything else (`/health`, `/get_loads`, `/flush_cache`, `GET /workers`, ...): the base
  model's router, as when it faced clients itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chunk_llama.server.errors import OpenAIError
from chunk_llama.server.router_pool import RouterPool

logger = logging.getLogger(__name__)
MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ADAPTER_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
TOKENIZE_ROUTES = ("/tokenize", "/detokenize")
# Headers of one hop only; httpx and uvicorn write their own host and framing.
REQUEST_DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "upgrade",
                "proxy-connection", "trailer"}
RESPONSE_DROP = {"transfer-encoding", "connection", "keep-alive", "upgrade", "proxy-connection", "trailer"}


def _error(message: str, status: int = 503) -> JSONResponse:
    kind = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}.get(status, "api_error")
    return JSONResponse(OpenAIError(message, status=status, type=kind).body(), status_code=status)


def _answer(response: httpx.Response) -> Response:
    """A worker's answer, read whole, as it was."""
    headers = {k: v for k, v in response.headers.items() if k.lower() not in RESPONSE_DROP | {"content-length"}}
    return Response(response.content, status_code=response.status_code, headers=headers)


class Relayed(StreamingResponse):
    """An upstream answer relayed as it arrives; the upstream connection closes however the
    relay ends (a client gone mid-stream too: the router, then the worker, see it go)."""

    def __init__(self, upstream: httpx.Response):
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in RESPONSE_DROP}
        super().__init__(upstream.aiter_raw(), status_code=upstream.status_code, headers=headers)
        self.upstream = upstream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()


async def _chain(head: bytes, rest):
    yield head
    async for chunk in rest:
        yield chunk


class Front:
    """The routes above over `pool` and the worker URLs (those it fans adapters out to)."""

    def __init__(self, pool: RouterPool, workers: list[str], *, max_body: int):
        self.pool, self.workers, self.max_body = pool, list(workers), max_body
        self.client: httpx.AsyncClient | None = None  # made in the server's event loop (`lifespan`)
        self.adapter_lock: asyncio.Lock | None = None
        self._next_worker = 0

    @asynccontextmanager
    async def lifespan(self, app):
        # No read timeout: a generation takes as long as the worker lets it (--request-timeout).
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.adapter_lock = asyncio.Lock()
        try:
            yield
        finally:
            await self.client.aclose()

    async def _read(self, request: Request) -> tuple[bytes, object]:
        """The body, if at most `max_body` bytes (and None); else what was read and the rest's
        stream (a client may not make the front hold more than a worker would accept)."""
        chunks, size, stream = [], 0, request.stream()
        async for chunk in stream:
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body:
                return b"".join(chunks), stream
        return b"".join(chunks), None

    async def _send(self, request: Request, base_url: str, content, path: str | None = None,
                    method: str | None = None) -> httpx.Response:
        """`request` (its method, path, query and headers, or `path` and `method` instead) to
        `base_url` with the body `content`, the answer's head read, its body not yet."""
        query = f"?{request.url.query}" if request.url.query and path is None else ""
        headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in REQUEST_DROP]
        outgoing = self.client.build_request(method or request.method, base_url + (path or request.url.path) + query,
                                             headers=headers, content=content)
        return await self.client.send(outgoing, stream=True)

    async def _relay(self, request: Request, base_url: str, content) -> Response:
        try:
            return Relayed(await self._send(request, base_url, content))
        except httpx.HTTPError as error:
            return _error(f"{base_url} did not answer: {error}")

    async def by_model(self, request: Request) -> Response:
        body, rest = await self._read(request)
        if rest is not None:
            return await self._relay(request, self.pool.url_for(None), _chain(body, rest))
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the worker says what is wrong with it
        model = parsed.get("model") if isinstance(parsed, dict) else None
        return await self._relay(request, self.pool.url_for(model), body)

    async def to_a_worker(self, request: Request) -> Response:
        """To the next worker in turn that answers."""
        body, rest = await self._read(request)
        if rest is not None:
            return await self._relay(request, self.workers[0], _chain(body, rest))
        for turn in range(len(self.workers)):
            index = (self._next_worker + turn) % len(self.workers)
            try:
                upstream = await self._send(request, self.workers[index], body)
            except httpx.TransportError:
                continue  # a worker that is down: the next one
            self._next_worker = index + 1
            return Relayed(upstream)
        return _error("no worker answered")

    async def _fan_out(self, request: Request, body: bytes, workers: list[str],
                       path: str | None = None) -> list[tuple[str, httpx.Response | None]]:
        async def one(url):
            try:
                response = await self._send(request, url, body, path)
                await response.aread()
                return url, response
            except httpx.TransportError as error:
                logger.warning("%s did not answer %s: %s", url, path or request.url.path, error)
                return url, None

        return list(await asyncio.gather(*(one(url) for url in workers)))

    async def adapter(self, request: Request) -> Response:
        body, rest = await self._read(request)
        if rest is not None:
            return await self._relay(request, self.workers[0], _chain(body, rest))
        loading = request.url.path == "/v1/load_lora_adapter"
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        parsed = parsed if isinstance(parsed, dict) else {}
        async with self.adapter_lock:  # one load or unload at a time: workers and routers stay in step
            answers = [(url, r) for url, r in await self._fan_out(request, body, list(self.workers)) if r is not None]
            if not answers:
                return _error("no worker answered")
            done = [url for url, r in answers if r.status_code == 200]
            # Unloading, a worker without the adapter (404) is where the others end up.
            refused = [(url, r) for url, r in answers if r.status_code != 200 and (loading or r.status_code != 404)]
            if loading and refused and done and not parsed.get("load_inplace"):
                undo = json.dumps({"lora_name": parsed.get("lora_name")}).encode()
                await self._fan_out(request, undo, done, path="/v1/unload_lora_adapter")
            if refused or not done:
                url, response = (refused or answers)[0]
                logger.warning("%s %s: %s answered %d", request.url.path, parsed.get("lora_name"), url,
                               response.status_code)
                return _answer(response)
            name = parsed["lora_name"]  # the workers accepted the body: it has one
            try:
                await asyncio.to_thread(self.pool.start if loading else self.pool.stop,
                                        *((name, done) if loading else (name,)))
            except RuntimeError as error:  # its requests still work, routed by the base model's router
                logger.error("no router for the adapter %r: %s", name, error)
            return _answer(next(r for _, r in answers if r.status_code == 200))

    async def join(self, request: Request) -> Response:
        body, rest = await self._read(request)
        try:
            url = json.loads(body)["url"].rstrip("/") if rest is None else None
        except (ValueError, KeyError, TypeError, AttributeError):
            url = None
        if not isinstance(url, str):
            return _error('POST /workers takes {"url": "http://host:port"}', status=400)
        if url in self.workers:
            return _error(f"{url} is routed to already", status=400)
        try:  # its models, asked with the client's key
            listing = await self._send(request, url, None, path="/v1/models", method="GET")
            await listing.aread()
            listing.raise_for_status()
            models = [m["id"] for m in listing.json()["data"] if m.get("parent")]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            return _error(f"{url}/v1/models did not list its models: {error}", status=400)
        try:
            await asyncio.to_thread(self.pool.add_worker, url, [self.pool.base, *models])
        except (httpx.HTTPError, RuntimeError) as error:
            return _error(f"{url} could not join: {error}", status=502)
        self.workers.append(url)
        return JSONResponse({"url": url, "models": [self.pool.base, *models]})

    async def leave(self, request: Request) -> Response:
        """`DELETE /workers/{id or URL}` (module doc)."""
        worker = request.path_params["worker"]
        if worker.startswith(("http://", "https://")):
            url = worker.rstrip("/")
        else:  # the base model's router's id for it (sglang-router's own API takes ids)
            try:
                found = await self._send(request, self.pool.url_for(None), b"", path=f"/workers/{worker}",
                                         method="GET")
                await found.aread()
            except httpx.HTTPError as error:
                return _error(f"the router did not answer: {error}")
            if found.status_code != 200:
                return _answer(found)
            url = found.json()["url"].rstrip("/")
        try:
            models = await asyncio.to_thread(self.pool.remove_worker, url)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as error:
            return _error(f"{url} could not leave: {error}", status=502)
        if not models and url not in self.workers:
            return _error(f"{url} is routed to by no router", status=404)
        if url in self.workers:
            self.workers.remove(url)
        return JSONResponse({"url": url, "models": models})

    async def to_base_router(self, request: Request) -> Response:
        body, rest = await self._read(request)
        return await self._relay(request, self.pool.url_for(None), _chain(body, rest) if rest is not None else body)


def create_front(pool: RouterPool, workers: list[str], *, max_body: int) -> Starlette:
    """The front's ASGI app (module doc); `max_body`: the workers' `--max-request-bytes`."""
    front = Front(pool, workers, max_body=max_body)
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]
    routes = [*(Route(path, front.by_model, methods=["POST"]) for path in MODEL_ROUTES),
              *(Route(path, front.adapter, methods=["POST"]) for path in ADAPTER_ROUTES),
              Route("/v1/models", front.to_a_worker, methods=["GET"]),
              Route("/v1/models/{model:path}", front.to_a_worker, methods=["GET"]),
              *(Route(path, front.to_a_worker, methods=["POST"]) for path in TOKENIZE_ROUTES),
              Route("/workers", front.join, methods=["POST"]),
              Route("/workers/{worker:path}", front.leave, methods=["DELETE"]),
              Route("/{path:path}", front.to_base_router, methods=methods)]
    app = Starlette(routes=routes, lifespan=front.lifespan)
    app.state.front = front
    return app
