"""The grammars of tool calls through the real server and the official `openai` client (the
tiny byte-level model of test_server_tools.py): forced parallel calls and their separator, a
stop string cutting a forced call, functions without parameters or with `allOf` ones, and
strict tools under tool_choice auto, each the same whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest
import test_server_tools
from helpers import tiny_byte_tokenizer
from test_server_tools import MODEL, TEMPLATE, TOOLS, ask, byte_server, check_calls

served, client = test_server_tools.served, test_server_tools.client  # (its server and client fixtures)


def streamed_chat(client, **kwargs) -> tuple[str, dict, str]:
    """A streamed chat's content, its calls by index ([name, arguments]) and finish reason."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        reason = choice.finish_reason or reason
        for part in choice.delta.tool_calls or []:
            entry = calls.setdefault(part.index, [part.function.name, ""])
            entry[1] += part.function.arguments or ""
    return content, calls, reason


def test_parallel_forced_calls_are_only_calls_streamed_or_not(served, client):
    """The grammar's "\\n" between calls is their separator, not text, in either mode."""
    kwargs = dict(model=MODEL, messages=ask("weather in Paris and Lima?"), tools=TOOLS, tool_choice="required",
                  max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert len(whole.message.tool_calls) >= 2 and whole.message.content is None
    content, calls, _ = streamed_chat(client, **kwargs)
    assert content == "" and [tuple(c) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_stop_string_that_cuts_a_forced_call_leaves_no_call_streamed_or_not(served, client):
    """A call cut by a stop string is no call, whole or streamed (a stream holds a call's deltas
    back until it is complete when stop strings are given); an uncut one streams whole."""
    kwargs = dict(model=MODEL, messages=ask("weather in Paris?"), tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs, stop=["}}"]).choices[0]  # every call's object ends so
    assert (whole.message.content, whole.message.tool_calls, whole.finish_reason) == ("", None, "stop")
    assert streamed_chat(client, **kwargs, stop=["}}"]) == ("", {}, "stop")
    uncut = client.chat.completions.create(**kwargs, stop=["zzz"]).choices[0]
    check_calls(uncut.message)
    content, calls, reason = streamed_chat(client, **kwargs, stop=["zzz"])
    assert content == "" and reason == uncut.finish_reason == "tool_calls"
    assert [tuple(c) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                  for c in uncut.message.tool_calls]


NO_PARAMETERS = [{"type": "function", "function": {"name": "get_time"}},
                 {"type": "function", "function": {"name": "get_date", "parameters": None}}]
ALL_OF = {"type": "function", "function": {"name": "plan_trip", "parameters": {"allOf": [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]},
    {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["days"]}]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_date"}}])
def test_a_function_without_parameters_is_called_with_no_arguments(served, client, choice):
    message = client.chat.completions.create(model=MODEL, messages=ask("what time is it?"), tools=NO_PARAMETERS,
                                             tool_choice=choice, parallel_tool_calls=False, max_tokens=60,
                                             temperature=0).choices[0].message
    assert [c.function.arguments for c in message.tool_calls] == ["{}"]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "plan_trip"}}])
def test_an_all_of_schema_is_called_with_its_declared_arguments(served, client, choice):
    message = client.chat.completions.create(model=MODEL, messages=ask("plan a trip"), tools=[ALL_OF],
                                             tool_choice=choice, parallel_tool_calls=False, max_tokens=60,
                                             temperature=0).choices[0].message
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, ALL_OF["function"]["parameters"])
    assert set(arguments) == {"city", "days"}


@pytest.fixture(scope="module")
def marked():
    """A server whose tokenizer writes `<tool_call>` as one (plain) token: a logit_bias on it
    makes the random model begin a call by itself under tool_choice auto."""
    tokenizer = tiny_byte_tokenizer()
    tokenizer.add_tokens(["<tool_call>"])
    tokenizer.chat_template = TEMPLATE
    with byte_server(tokenizer) as (_, _, client):
        yield client, {str(tokenizer.convert_tokens_to_ids("<tool_call>")): 100}


STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]


def test_strict_tools_under_auto_write_valid_calls_or_text(marked):
    """OpenAI's strict guarantee under tool_choice auto: a call the model begins by itself (its
    marker pushed by logit_bias) is a valid call of a declared tool; without the push, text."""
    client, push = marked
    kwargs = dict(model=MODEL, messages=ask("weather in Paris?"), tools=STRICT_TOOLS, parallel_tool_calls=False,
                  max_tokens=120, temperature=0)
    pushed = client.chat.completions.create(**kwargs, logit_bias=push).choices[0]
    check_calls(pushed.message)
    assert pushed.finish_reason == "tool_calls" and len(pushed.message.tool_calls) == 1
    content, calls, reason = streamed_chat(client, **kwargs, logit_bias=push)
    assert [tuple(c) for c in calls.values()] == [(c.function.name, c.function.arguments)
                                                  for c in pushed.message.tool_calls]
    free = client.chat.completions.create(**kwargs).choices[0]
    assert free.message.content and "<tool_call>" not in free.message.content or free.message.tool_calls
