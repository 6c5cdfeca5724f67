"""The FastAPI application: OpenAI-compatible routes over one `EngineLoop`.

Handlers validate, queue their requests (`Session.submit`) and relay deltas; only
the loop thread steps the engine. A bad request is a 400 with OpenAI's error body
(pydantic's validation errors included), and touches nothing else. The guards
(`options.DeployArgs`): API keys (`auth.py`, 401), the body's size (413) and strict JSON
(`limits.py`, 400), a bounded queue (429) and a drain on shutdown (503: `loop.py`).
Routes: `/v1/chat/completions` and `/v1/completions` (`chat.py`), `/v1/responses`
(`responses_api/`), `/tokenize` and `/detokenize` (`tokenize.py`), `/v1/models`, `/health`,
`/metrics`.
"""

from __future__ import annotations

import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunk_llama.server.adapters import ServedModels, add_adapter_routes
from chunk_llama.server.auth import ApiKeyMiddleware
from chunk_llama.server.chat import AppContext, respond
from chunk_llama.server.convert import OpenAIError, chat_request, completion_requests
from chunk_llama.server.fields import ignored_fields_header, unknown_fields
from chunk_llama.server.limits import (
    BodyLimitMiddleware,
    StrictJSONRoute,
    check_chat_size,
    check_completion_size,
)
from chunk_llama.server.loop import EngineLoop
from chunk_llama.server.metrics import CONTENT_TYPE, Metrics
from chunk_llama.server.options import ChatArgs, DeployArgs
from chunk_llama.server.responses_api.routes import add_responses_routes
from chunk_llama.server.schemas import ChatCompletionRequest, CompletionRequest
from chunk_llama.server.served import served_model
from chunk_llama.server.stats_log import StatsLogger
from chunk_llama.server.tokenize import add_tokenize_routes
from chunk_llama.server.worker_info import add_worker_routes


def _validation_message(errors) -> tuple[str, str | None]:
    """pydantic's errors as one message, and the offending field's path (the common part of
    the errors' paths: a union reports one error per member type)."""
    if errors and errors[0].get("type") == "json_invalid":  # its loc is a character offset, not a field
        where = [p for p in errors[0].get("loc", ()) if p != "body"]
        reason = (errors[0].get("ctx") or {}).get("error") or errors[0].get("msg")
        return f"the body is not valid JSON: {reason}" + (f" at character {where[0]}" if where else ""), None
    locs = [[str(p) for p in error.get("loc", ()) if p != "body"] for error in errors]
    common = os.path.commonprefix(locs) if locs else []
    param = ".".join(common or (locs[0] if locs else [])) or None
    parts = []
    for error, loc in zip(errors[:3], locs):
        if error.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON: {error.get('msg')}")
        else:
            parts.append(f"{'.'.join(loc) or 'body'}: {error.get('msg')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, param


def create_app(engine, model_name: str, *, aliases: tuple[str, ...] = (), loop_thread: bool = True,
               allowed_origins: list[str] | None = None, stats_interval: float = 0.0,
               worker_id: str | None = None, deploy: DeployArgs | None = None,
               chat: ChatArgs | None = None) -> FastAPI:
    """The server app for `engine`, serving it as `model_name` (requests may also name it by
    one of `aliases`, e.g. the path it was loaded from). The engine loop (`app.state.loop`)
    starts in a thread of its own with the app (its lifespan), or, with `loop_thread=False`,
    is the caller's to `run`; it stops with the app either way. `allowed_origins`: browser
    origins allowed by CORS (`["*"]`: any); `stats_interval`: seconds between stats lines
    while busy (`stats_log.py`; 0: none); `worker_id`: this server is one replica behind a
    router (`worker_info.py`: the routes a router reads, the worker in every response and
    every metric); `deploy`: keys, limits, queue bound, timeouts (default: `DeployArgs()`,
    no key); `chat`: the reasoning and tool-call parsers, the template's default kwargs, the
    Responses store's size (default: `ChatArgs()`, formats found in the chat template)."""
    deploy, chat = deploy or DeployArgs(), chat or ChatArgs()
    keys = deploy.keys()
    metrics = Metrics()
    stats = None

    def on_deltas(deltas):
        metrics.on_deltas(deltas)
        stats.maybe_log()

    loop = EngineLoop(engine, on_deltas=on_deltas, on_finish=metrics.on_finish, on_admitted=metrics.on_admitted,
                      max_waiting=deploy.max_waiting_requests)
    metrics.bind(engine, loop)
    stats = StatsLogger(metrics, engine, loop, stats_interval)
    created_at = int(time.time())
    models = ServedModels(engine, [model_name, *aliases], created_at)
    served = served_model(engine, chat.reasoning_parser, chat.tool_call_parser, chat.template_kwargs())
    ctx = AppContext(engine, loop, metrics, deploy, served, models)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if loop_thread:
            loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="chunk-llama", lifespan=lifespan)
    app.router.route_class = StrictJSONRoute
    app.add_middleware(BodyLimitMiddleware, max_bytes=deploy.max_request_bytes, on_refused=metrics.on_error)
    if keys:  # inside CORS (added later, so outside it): a 401 carries the CORS headers too
        app.add_middleware(ApiKeyMiddleware, keys=keys, protect_metrics=deploy.metrics_need_key,
                           on_refused=lambda: metrics.on_rejected("unauthorized"))
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.state.engine, app.state.loop, app.state.metrics = engine, loop, metrics
    if worker_id is not None:
        add_worker_routes(app, engine, models.base_names, worker_id)
        metrics.label_worker(worker_id)

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError):
        if error.status < 500 and error.status != 429:  # 429 and 503 count as rejected (session.refusal)
            metrics.on_error()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        message, param = _validation_message(error.errors())
        metrics.on_error()
        return JSONResponse(OpenAIError(message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        if error.status_code in (400, 413):  # a body refused before validation: too large, not strict JSON
            metrics.on_error()
        body = OpenAIError(str(error.detail), status=error.status_code).body()
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.get("/health")
    async def health():
        if loop.draining:
            return JSONResponse({"status": "draining", "message": "the server is shutting down"}, status_code=503)
        if not loop.alive:
            return JSONResponse(
                {"status": "error", "message": "the engine loop is not running"}, status_code=503
            )
        return {"status": "ok"}

    add_adapter_routes(app, engine, models)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_chat_size(body, deploy)
        requests = chat_request(body, served)
        requests.adapter = models.adapter_for(body.model)
        result = await respond(ctx, body, request, requests, endpoint="chat", chat=True,
                               top_logprobs=(body.top_logprobs or 0) if body.logprobs else None)
        return with_headers(result, ignored_fields_header(unknown_fields(body)))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_completion_size(body, deploy)
        requests = completion_requests(body, served)
        requests.adapter = models.adapter_for(body.model)
        result = await respond(ctx, body, request, requests, endpoint="completions", chat=False,
                               top_logprobs=body.logprobs)
        return with_headers(result, ignored_fields_header(unknown_fields(body)))

    add_responses_routes(app, ctx, max_stored=chat.max_stored_responses)
    add_tokenize_routes(app, ctx)
    return app


def with_headers(result, headers: dict[str, str]):
    """A handler's result (a body, or a response already made) as a response with `headers`."""
    if not isinstance(result, Response):
        result = JSONResponse(result)
    result.headers.update(headers)
    return result
