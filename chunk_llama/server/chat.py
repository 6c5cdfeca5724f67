"""Chat and text completions once their requests are built (`convert.py`): queue them, then
stream their chunks or collect the outputs into one response. Each sample's text is read by
a `SampleReader` (stop strings, reasoning, tool calls), the same way whole or streamed."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from chunk_llama.server import responses as fmt
from chunk_llama.server.errors import OpenAIError
from chunk_llama.server.limits import request_deadline
from chunk_llama.server.logprobs import build_logprobs
from chunk_llama.server.session import ClientGone, Session

DONE = "data: [DONE]\n\n"


@dataclass
class AppContext:
    """What every handler uses: the engine, its loop, the metrics, the guards (`DeployArgs`),
    the served model's traits (`served.ServedModel`) and the models a request may name
    (`adapters.ServedModels`: the base's names, the LoRA adapters)."""

    engine: object
    loop: object
    metrics: object
    deploy: object
    served: object
    models: object


def sse(obj, event: str | None = None) -> str:
    """One server-sent event carrying `obj` as JSON (with an `event:` line when named)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def event_stream(generator, headers: dict | None = None) -> StreamingResponse:
    """A `text/event-stream` response of `generator`'s events."""
    return StreamingResponse(generator, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


async def respond(ctx: AppContext, body, request: Request, requests, *, endpoint: str, chat: bool,
                  top_logprobs: int | None):
    """The response to a chat (`chat`) or text completion request whose engine `requests` are
    built: a stream of chunks, or one body with every choice."""
    session = Session(ctx.loop, body.n)
    await session.submit(requests, metrics=ctx.metrics, endpoint=endpoint,
                         deadline=request_deadline(request, body.stream, ctx.deploy))
    object_name = "chat.completion" if chat else "text_completion"
    head = (fmt.new_id("chatcmpl" if chat else "cmpl"), fmt.now(), body.model)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream_chat if chat else _stream_completion
        return event_stream(stream(session, head, requests.read, include_usage))
    outputs = await collect(session, request)
    if outputs is None:
        return Response(status_code=499)
    choices = []
    for index, out in enumerate(outputs):
        logprobs = None
        if top_logprobs is not None:
            logprobs = await build_logprobs(ctx.engine, out, top_logprobs, chat=chat)
        reader = requests.read.reader()
        if chat:
            choices.append(fmt.chat_choice(index, reader.read_whole(out.text), out.finish_reason, logprobs))
        else:
            choices.append(fmt.completion_choice(index, reader.read_whole(out.text)[0] or "", out.finish_reason,
                                                 logprobs))
    return {"id": head[0], "object": object_name, "created": head[1], "model": head[2], "choices": choices,
            "usage": usage_of(session, outputs)}


async def collect(session: Session, request: Request):
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


def usage_of(session: Session, outputs) -> dict:
    """The `usage` of a request's outputs (prompt tokens counted once per prompt)."""
    completion = sum(len(o.token_ids) for o in outputs)
    cached = sum(outputs[i * session.n].num_cached_tokens for i in range(len(session.subs)))
    return fmt.usage(sum(session.prompt_tokens), completion, cached)


def chat_delta(event: tuple) -> dict:
    """A `SampleReader` event as a chat chunk's `delta`."""
    if event[0] == "call":
        return {"tool_calls": [event[2]]}
    return {"reasoning_content" if event[0] == "reasoning" else "content": event[1]}


async def _stream_chat(session: Session, head, read, include_usage: bool):
    response_id, created, model = head
    num_choices = len(session.subs) * session.n
    readers = [read.reader() for _ in range(num_choices)]
    started: set[int] = set()
    outputs: dict[int, object] = {}
    try:
        async for index, delta in session.deltas():
            reader = readers[index]
            pieces = [chat_delta(e) for e in reader.feed(delta.text, delta.finished)]
            reason = delta.finish_reason if delta.finished else None
            reason = fmt.tool_finish_reason(reason, bool(reader.complete_calls()))
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
            ordered = [outputs[i] for i in range(num_choices)]
            yield sse(fmt.usage_chunk(response_id, created, model, "chat.completion.chunk",
                                      usage_of(session, ordered)))
        yield DONE
    except OpenAIError as error:
        yield sse(error.body())
        yield DONE
    finally:
        session.close()


async def _stream_completion(session: Session, head, read, include_usage: bool):
    response_id, created, model = head
    readers = [read.reader() for _ in range(len(session.subs) * session.n)]
    outputs: dict[int, object] = {}
    try:
        async for index, delta in session.deltas():
            text = "".join(e[1] for e in readers[index].feed(delta.text, delta.finished))
            reason = delta.finish_reason if delta.finished else None
            if text or reason:
                yield sse(fmt.completion_chunk(response_id, created, model, index, text, reason))
            if delta.finished:
                outputs[index] = delta.output
        if include_usage:
            ordered = [outputs[i] for i in range(len(readers))]
            yield sse(fmt.usage_chunk(response_id, created, model, "text_completion", usage_of(session, ordered)))
        yield DONE
    except OpenAIError as error:
        yield sse(error.body())
        yield DONE
    finally:
        session.close()
