"""The FastAPI application: OpenAI-compatible routes over one `EngineLoop`.

Handlers validate, queue their requests (`Session.submit`) and relay deltas; only
the loop thread steps the engine. A bad request is a 400 with OpenAI's error body
(pydantic's validation errors included), and touches nothing else. The guards
(`options.DeployArgs`): API keys (`auth.py`, 401), the body's size (413) and strict JSON
(`limits.py`, 400), a bounded queue (429) and a drain on shutdown (503: `loop.py`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunk_llama.server import responses as fmt
from chunk_llama.server.adapters import ServedModels, add_adapter_routes
from chunk_llama.server.auth import ApiKeyMiddleware
from chunk_llama.server.convert import OpenAIError, chat_request, completion_requests
from chunk_llama.server.limits import (
    BodyLimitMiddleware,
    StrictJSONRoute,
    check_chat_size,
    check_completion_size,
    request_deadline,
)
from chunk_llama.server.loop import EngineLoop
from chunk_llama.server.metrics import CONTENT_TYPE, Metrics
from chunk_llama.server.options import DeployArgs
from chunk_llama.server.schemas import ChatCompletionRequest, CompletionRequest
from chunk_llama.server.session import ClientGone, Session
from chunk_llama.server.stats_log import StatsLogger
from chunk_llama.server.tools import ToolCallParser, template_writes_tool_calls
from chunk_llama.server.worker_info import add_worker_routes


def sse(obj) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


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
               worker_id: str | None = None, deploy: DeployArgs | None = None) -> FastAPI:
    """The server app for `engine`, serving it as `model_name` (requests may also name it by
    one of `aliases`, e.g. the path it was loaded from). The engine loop (`app.state.loop`)
    starts in a thread of its own with the app (its lifespan), or, with `loop_thread=False`,
    is the caller's to `run`; it stops with the app either way. `allowed_origins`: browser
    origins allowed by CORS (`["*"]`: any); `stats_interval`: seconds between stats lines
    while busy (`stats_log.py`; 0: none); `worker_id`: this server is one replica behind a
    router (`worker_info.py`: the routes a router reads, the worker in every response and
    every metric); `deploy`: keys, limits, queue bound, timeouts (default: `DeployArgs()`,
    no key)."""
    deploy = deploy or DeployArgs()
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
    served = [model_name, *aliases]
    max_positions = engine.max_model_len
    vocab_size = engine.model.config.vocab_size
    native_tools = template_writes_tool_calls(engine.tokenizer)
    created_at = int(time.time())

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
        add_worker_routes(app, engine, served, worker_id)
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

    served_models = ServedModels(engine, served, created_at)
    add_adapter_routes(app, engine, served_models)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def respond(body, request: Request, requests, *, endpoint: str, id_prefix: str,
                      object_name: str, stream_events, choice, logprobs_format, top_logprobs: int | None):
        """What both endpoints share: queue the prompts, then stream their events or collect
        the outputs into one response (`choice(index, text, finish_reason, logprobs)`)."""
        session = Session(loop, body.n)
        await session.submit(requests, metrics=metrics, endpoint=endpoint,
                             deadline=request_deadline(request, body.stream, deploy))
        head = (fmt.new_id(id_prefix), fmt.now(), body.model)
        stops = body.stop_list()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _event_stream(stream_events(session, head, stops, include_usage))
        outputs = await _collect(session, request)
        if outputs is None:
            return Response(status_code=499)
        choices = []
        for index, out in enumerate(outputs):
            logprobs = None
            if top_logprobs is not None:
                logprobs = await _logprobs(engine, logprobs_format, out, top_logprobs)
            choices.append(choice(index, _final_text(out, stops), out.finish_reason, logprobs))
        return {"id": head[0], "object": object_name, "created": head[1], "model": head[2], "choices": choices,
                "usage": _usage(session, outputs)}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        adapter = served_models.adapter_for(body.model)
        check_chat_size(body, deploy)
        requests = chat_request(body, max_positions, vocab_size, native_tools)
        requests.adapter = adapter
        return await respond(body, request, requests, endpoint="chat", id_prefix="chatcmpl",
                             object_name="chat.completion",
                             stream_events=functools.partial(_stream_chat, tool_parsing=requests.tool_parsing),
                             choice=functools.partial(fmt.chat_choice, tool_parsing=requests.tool_parsing),
                             logprobs_format=fmt.chat_logprobs,
                             top_logprobs=(body.top_logprobs or 0) if body.logprobs else None)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        adapter = served_models.adapter_for(body.model)
        check_completion_size(body, deploy)
        requests = completion_requests(body, vocab_size)
        requests.adapter = adapter
        return await respond(body, request, requests, endpoint="completions", id_prefix="cmpl",
                             object_name="text_completion", stream_events=_stream_completion,
                             choice=fmt.completion_choice, logprobs_format=fmt.completion_logprobs,
                             top_logprobs=body.logprobs)

    return app


async def _collect(session: Session, request: Request):
    """Every sample's `RequestOutput` in choice order, or None when the client left (its
    requests are aborted)."""
    outputs = [None] * (len(session.subs) * session.n)
    try:
        async for index, delta in session.deltas(request):
            if delta.finished:
                outputs[index] = delta.output
    except ClientGone:
        return None
    finally:
        session.close()
    return outputs


def _final_text(output, stops: list[str]) -> str:
    text = output.text or ""
    return fmt.cut_at_stop(text, stops) if stops and output.finish_reason == "stop" else text


def _usage(session: Session, outputs) -> dict:
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(outputs[i * session.n].num_cached_tokens for i in range(len(session.subs)))
    return fmt.usage(sum(session.prompt_tokens), completion, cached)


async def _logprobs(engine, build, output, top: int):
    tokenizer, lock = engine.tokenizer, engine.inputs.tokenizer_lock

    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def work():
        with lock:
            return build(output, top, token_text)

    return await asyncio.to_thread(work)


def _event_stream(generator) -> StreamingResponse:
    return StreamingResponse(
        generator,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _stream_chat(session: Session, head, stops: list[str], include_usage: bool, *, tool_parsing: bool):
    response_id, created, model = head
    num_choices = len(session.subs) * session.n
    cutters = [fmt.StopCutter(stops) for _ in range(num_choices)]
    parsers = [ToolCallParser() if tool_parsing else None for _ in range(num_choices)]
    started: set[int] = set()
    outputs: dict[int, object] = {}
    try:
        async for index, delta in session.deltas():
            text = cutters[index].feed(delta.text, delta.finished)
            reason = delta.finish_reason if delta.finished else None
            if parsers[index] is None:
                pieces = [{"content": text}] if text else []
            else:  # content, or a tool call's name then its argument fragments
                pieces = [{"content": e[1]} if e[0] == "content" else {"tool_calls": [e[2]]}
                          for e in parsers[index].feed(text, delta.finished)]
                reason = fmt.tool_finish_reason(reason, bool(parsers[index].calls))
            if index not in started:  # the first chunk of a choice carries the role
                pieces = [{"role": "assistant", **(pieces[0] if pieces else {"content": ""})}, *pieces[1:]]
                started.add(index)
            if reason and not pieces:
                pieces = [{}]
            for i, piece in enumerate(pieces):
                last = reason if i == len(pieces) - 1 else None
                yield sse(fmt.chat_chunk(response_id, created, model, index, piece, last))
            if delta.finished:
                outputs[index] = delta.output
        if include_usage:
            ordered = [outputs[i] for i in range(len(cutters))]
            yield sse(
                fmt.usage_chunk(
                    response_id, created, model, "chat.completion.chunk", _usage(session, ordered)
                )
            )
        yield DONE
    except OpenAIError as error:
        yield sse(error.body())
        yield DONE
    finally:
        session.close()


async def _stream_completion(session: Session, head, stops: list[str], include_usage: bool):
    response_id, created, model = head
    cutters = [fmt.StopCutter(stops) for _ in range(len(session.subs) * session.n)]
    outputs: dict[int, object] = {}
    try:
        async for index, delta in session.deltas():
            text = cutters[index].feed(delta.text, delta.finished)
            reason = delta.finish_reason if delta.finished else None
            if text or reason:
                yield sse(fmt.completion_chunk(response_id, created, model, index, text, reason))
            if delta.finished:
                outputs[index] = delta.output
        if include_usage:
            ordered = [outputs[i] for i in range(len(cutters))]
            yield sse(
                fmt.usage_chunk(response_id, created, model, "text_completion", _usage(session, ordered))
            )
        yield DONE
    except OpenAIError as error:
        yield sse(error.body())
        yield DONE
    finally:
        session.close()
