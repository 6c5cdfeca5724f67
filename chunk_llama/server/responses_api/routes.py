"""`POST /v1/responses` (whole or streamed), `GET` and `DELETE /v1/responses/{id}`.

A request is validated (`request.py`), becomes its chat request and runs as a chat does
(queued by the handler, stepped by the engine loop); its sample's text is read
(`SampleReader`) into output items (`output.py`) as its deltas arrive, whether it streams or
not, so both give the same response. A stream is OpenAI's: `event:` and `data:` lines,
`response.created`, `response.in_progress`, the items' events, then `response.completed`
(or `response.incomplete` when `max_output_tokens` cut it), every event numbered
(`sequence_number`); a failure mid-stream is an `error` event. With `store` the response
and its conversation are kept (`store.py`); an unknown `previous_response_id` is a 404.
"""

from __future__ import annotations

import itertools
import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from chunk_llama.server.chat import AppContext, event_stream, sse
from chunk_llama.server.convert import chat_request
from chunk_llama.server.errors import OpenAIError
from chunk_llama.server.fields import ignored_fields_header
from chunk_llama.server.limits import check_chat_size, request_deadline
from chunk_llama.server.responses_api.output import OutputBuilder, ResponseHead, assistant_message, usage
from chunk_llama.server.responses_api.request import InvalidBody, chat_body, chat_param, validate_body
from chunk_llama.server.responses_api.store import ResponseStore, StoredResponse
from chunk_llama.server.schemas import ChatCompletionRequest
from chunk_llama.server.session import ClientGone, Session

# What /openapi.json shows of a request (the fields served here); the body is validated against
# the openai package's types (`request.py`), not against this.
_TEXT_OR_ITEMS = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}
OPENAPI_BODY = {"type": "object", "required": ["model"], "properties": {
    "model": {"type": "string"}, "input": _TEXT_OR_ITEMS, "instructions": {"type": "string"},
    "tools": {"type": "array", "items": {"type": "object"}},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
    "text": {"type": "object"}, "max_output_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number"},
    "stream": {"type": "boolean"}, "store": {"type": "boolean"}, "previous_response_id": {"type": "string"},
    "parallel_tool_calls": {"type": "boolean"}, "reasoning": {"type": "object"}}}


def _not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(f"no response with id {response_id!r} is stored here (responses are kept in memory, the "
                       "latest ones only, and only with store: true)", status=404, param=param, code="not_found")


class _Run:
    """One response's state while its sample runs."""

    def __init__(self, head: ResponseHead, requests, session: Session, conversation: list[dict],
                 store: ResponseStore | None, emit=None):
        self.head, self.session, self.conversation, self.store = head, session, conversation, store
        self.reader = requests.read.reader()
        self.builder = OutputBuilder(emit)
        self.output = None  # the engine's RequestOutput once finished

    def feed(self, delta) -> None:
        self.builder.feed(self.reader.feed(delta.text, delta.finished, len(delta.token_ids)))
        if delta.finished:
            self.output = delta.output

    def finish(self) -> dict:
        """The final response (stored when asked)."""
        out = self.output
        incomplete = out.finish_reason == "length"
        items = self.builder.finish(incomplete, self.reader.calls)
        used = usage(sum(self.session.prompt_tokens), out.num_cached_tokens, len(out.token_ids),
                     self.reader.num_reasoning_tokens)
        response = self.head.response("incomplete" if incomplete else "completed", items, used)
        if self.store is not None:
            self.store.put(self.head.id, StoredResponse(response, [*self.conversation, assistant_message(items)]))
        return response


def add_responses_routes(app, ctx: AppContext, max_stored: int) -> None:
    """The routes on `app`, with a store of `max_stored` responses."""
    store = ResponseStore(max_stored)
    app.state.responses_store = store

    @app.post("/v1/responses", openapi_extra={"requestBody": {"required": True, "content": {
        "application/json": {"schema": OPENAPI_BODY}}}})
    async def create_response(request: Request):
        try:
            raw = await request.json()
        except json.JSONDecodeError as error:  # FastAPI's body parsing says so for its own routes
            raise OpenAIError(f"the body is not valid JSON: {error.msg} at character {error.pos}") from None
        try:
            body, unknown = validate_body(raw)
        except InvalidBody as error:
            raise RequestValidationError(error.errors) from None
        previous = []
        if body.get("previous_response_id"):
            entry = store.get(body["previous_response_id"])
            if entry is None:
                raise _not_found(body["previous_response_id"], "previous_response_id")
            previous = entry.messages
        chat_dict = chat_body(body, previous)
        try:
            chat = ChatCompletionRequest.model_validate(chat_dict)
        except ValidationError as error:
            raise RequestValidationError([{**e, "loc": tuple(chat_param(".".join(map(str, e["loc"]))).split("."))}
                                          for e in error.errors()]) from None
        adapter = ctx.models.adapter_for(chat.model)
        check_chat_size(chat, ctx.deploy)
        requests = chat_request(chat, ctx.served)
        requests.adapter = adapter
        session = Session(ctx.loop, 1)
        await session.submit(requests, metrics=ctx.metrics, endpoint="responses",
                             deadline=request_deadline(request, chat.stream, ctx.deploy))
        conversation = chat_dict["messages"][1 if body.get("instructions") else 0:]
        head = ResponseHead(body)
        kept = store if body.get("store", True) else None
        headers = ignored_fields_header(unknown)
        if chat.stream:
            return event_stream(_stream(head, requests, session, conversation, kept), headers)
        run = _Run(head, requests, session, conversation, kept)
        try:
            async for _, delta in session.deltas(request):
                run.feed(delta)
        except ClientGone:
            return Response(status_code=499)
        finally:
            session.close()
        return JSONResponse(run.finish(), headers=headers)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


async def _stream(head: ResponseHead, requests, session: Session, conversation: list[dict], store):
    numbers = itertools.count()
    pending: list[dict] = []

    def event(payload: dict) -> str:
        return sse({**payload, "sequence_number": next(numbers)}, payload["type"])

    run = _Run(head, requests, session, conversation, store, emit=pending.append)
    try:
        yield event({"type": "response.created", "response": head.response("in_progress")})
        yield event({"type": "response.in_progress", "response": head.response("in_progress")})
        async for _, delta in session.deltas():
            run.feed(delta)
            for payload in pending:
                yield event(payload)
            pending.clear()
        response = run.finish()
        for payload in pending:
            yield event(payload)
        yield event({"type": f"response.{response['status']}", "response": response})
    except OpenAIError as error:
        yield event({"type": "error", "code": error.code, "message": error.message, "param": error.param})
    finally:
        session.close()
