"""The Responses API (`POST /v1/responses`) through the official `openai` client against a
real server on 127.0.0.1 serving the tiny byte-level Llama of test_server_tools.py: every
response and stream event validates under the openai package's own types, answers equal the
chat completion of the same request, function calls and structured output hold, and stored
responses continue a conversation on its cached chunks."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter
from test_server_tool_grammars import STRICT_TOOLS, marked  # noqa: F401 - fixtures
from test_server_tools import MODEL, SCHEMAS, SYSTEM, TOOLS, ask, client, served  # noqa: F401 - fixtures

INSTRUCTIONS = SYSTEM["content"]
FLAT_TOOLS = [{"type": "function", **t["function"], "strict": None} for t in TOOLS]  # the Responses API's form
EVENTS = TypeAdapter(ResponseStreamEvent)


class Weather(BaseModel):
    city: str = Field(max_length=6)
    unit: str = Field(pattern="^(c|f)$")


def raw_create(client, **kwargs) -> tuple[Response, dict, httpx.Headers]:
    """The parsed response, its JSON as sent, and the headers."""
    raw = client.responses.with_raw_response.create(**kwargs)
    body = raw.http_response.json()
    Response.model_validate(body)  # strictly, as the openai package types it
    return raw.parse(), body, raw.headers


def streamed(client, **kwargs) -> tuple[list, Response]:
    """Every event of a streamed response, each validated under the openai types as sent, and
    the response of the last one (`response.completed`, or `response.incomplete` when
    max_output_tokens cut it, as OpenAI's)."""
    events = []
    for event in client.responses.create(stream=True, **kwargs):
        EVENTS.validate_python(event.model_dump(by_alias=True, exclude_unset=True))
        events.append(event)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


def test_text_answer_whole_and_streamed_equals_chat(served, client):
    engine, _ = served
    chat = client.chat.completions.create(model=MODEL, messages=ask("weather in Lima?"), max_tokens=24, temperature=0)
    response, body, _ = raw_create(client, model=MODEL, instructions=INSTRUCTIONS, input="weather in Lima?",
                                   max_output_tokens=24, temperature=0)
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.input_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 16  # chat's chunks
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events, final = streamed(client, model=MODEL, instructions=INSTRUCTIONS, input="weather in Lima?",
                             max_output_tokens=24, temperature=0)
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert final.output_text == response.output_text and final.usage.output_tokens == response.usage.output_tokens
    assert [i.type for i in final.output] == [i.type for i in response.output] == ["message"]


def test_json_schema_output_parses_whole_and_streamed(served, client):
    """The client's own parsing helpers (`responses.parse`, `responses.stream` with `text_format`)
    read the structured answer; the raw stream validates event by event."""
    parsed = client.responses.parse(model=MODEL, input="json please", text_format=Weather, max_output_tokens=60,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Weather) and parsed.status == "completed"
    with client.responses.stream(model=MODEL, input="json please", text_format=Weather, max_output_tokens=60,
                                 temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and kinds[-1] == "response.completed"
    schema = {"type": "json_schema", "name": "weather", "schema": SCHEMAS["get_weather"], "strict": True}
    events, raw = streamed(client, model=MODEL, input="json please", max_output_tokens=60, temperature=0,
                           text={"format": schema})
    jsonschema.validate(json.loads(raw.output_text), SCHEMAS["get_weather"])
    response, body, _ = raw_create(client, model=MODEL, input="any object", max_output_tokens=40, temperature=0,
                                   text={"format": {"type": "json_object"}})
    assert response.output_text.startswith("{") and body["text"] == {"format": {"type": "json_object"}}


def test_function_calls_then_the_tool_turn_on_stored_or_sent_history(served, client):
    engine, _ = served
    first, _, _ = raw_create(client, model=MODEL, instructions=INSTRUCTIONS, input="weather in Paris?",
                             tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=120, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert call.call_id.startswith("call_") and first.status == "completed"
    events, again = streamed(client, model=MODEL, instructions=INSTRUCTIONS, input="weather in Paris?",
                             tools=FLAT_TOOLS, tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=120, temperature=0)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and again.output[0].name == call.name
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    continued, _, _ = raw_create(client, model=MODEL, instructions=INSTRUCTIONS, previous_response_id=first.id,
                                 input=[result], tools=FLAT_TOOLS, max_output_tokens=8, temperature=0)
    # every token of the first turn (prompt and generated call) was cached: it continues them
    assert continued.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + \
        first.usage.output_tokens - 1
    sent = [{"role": "user", "content": "weather in Paris?"}, call.model_dump(exclude_none=True), result]
    by_hand, _, _ = raw_create(client, model=MODEL, instructions=INSTRUCTIONS, input=sent, tools=FLAT_TOOLS,
                               max_output_tokens=8, temperature=0, store=False)
    assert by_hand.usage.input_tokens == continued.usage.input_tokens
    assert by_hand.output_text == continued.output_text
    named, _, _ = raw_create(client, model=MODEL, input="flights?", tools=FLAT_TOOLS, max_output_tokens=60,
                             tool_choice={"type": "function", "name": "find_flights"}, temperature=0)
    assert [i.name for i in named.output if i.type == "function_call"] == ["find_flights"]


def test_store_get_delete_and_unknown_ids(served, client):
    response, _, _ = raw_create(client, model=MODEL, input="hello", max_output_tokens=4, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert client.responses.retrieve(response.id).output_text == response.output_text
    unstored, _, _ = raw_create(client, model=MODEL, input="hello", max_output_tokens=2, temperature=0, store=False)
    for missing in (unstored.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError) as raised:
            client.responses.create(model=MODEL, input="next", previous_response_id=missing, max_output_tokens=2)
        assert raised.value.body["param"] == "previous_response_id" and missing in raised.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(missing)
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


@pytest.mark.parametrize("change, param, message", [
    ({"tools": [{"type": "web_search"}]}, "tools.0", "not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png", "detail": "auto"}]}]},
     "input",
     "not supported"),
    ({"background": True}, "background", "not supported"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": 7}, "input", None),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools.0", "Field required"),
    ({"model": "other"}, "model", "does not exist"),
])
def test_bad_requests_are_400_naming_the_field(served, change, param, message):
    _, url = served
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **change}
    response = httpx.post(url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, (change, response.text)
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert message is None or message in error["message"], error


def test_unknown_fields_are_answered(served):
    _, url = served
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "temperature": 0, "typical_p": 0.5, "foo": {}}
    response = httpx.post(url + "/v1/responses", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["x-chunk-llama-ignored-fields"] == "foo, typical_p"


def test_parallel_forced_calls_are_only_function_calls_whole_and_streamed(served, client):
    """The grammar's "\\n" between calls is no message, whole or streamed."""
    kwargs = dict(model=MODEL, instructions=INSTRUCTIONS, input="weather in Paris and Lima?", tools=FLAT_TOOLS,
                  tool_choice="required", max_output_tokens=200, temperature=0)
    whole, _, _ = raw_create(client, **kwargs)
    _, final = streamed(client, **kwargs)
    for response in (whole, final):
        assert len(response.output) >= 2 and {i.type for i in response.output} == {"function_call"}


def test_strict_function_tools_under_auto_write_valid_calls(marked):
    client, push = marked
    tools = [{"type": "function", **t["function"]} for t in STRICT_TOOLS]
    response, _, _ = raw_create(client, model=MODEL, instructions=INSTRUCTIONS, input="weather in Paris?",
                                tools=tools, parallel_tool_calls=False, max_output_tokens=120, temperature=0,
                                extra_body={"logit_bias": push})
    (call,) = response.output
    assert call.type == "function_call" and response.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
