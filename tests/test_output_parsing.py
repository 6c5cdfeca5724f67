"""Reading a sample's text as OpenAI's parts, without a model: each family's tool-call format
(whole and streamed in pieces of every size give the same calls), a call cut off by the end
of the output never reaching `content`, the format found from a chat template, and the
reasoning split, which never takes an answer for reasoning."""

from __future__ import annotations

import json

import pytest

from chunk_llama.server import options
from chunk_llama.server.reasoning import PARSER_NAMES as REASONING_NAMES
from chunk_llama.server.reasoning import REASONING_TAGS, ReasoningFormat
from chunk_llama.server.sample_reader import ReadSettings
from chunk_llama.server.tool_formats import FORMATS, PARSER_NAMES, tool_format

HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "P\\"a}ris", "n": [1, {"x": 2}]}}'
          '\n</tool_call>\n<tool_call>\n{"arguments": {"day": 3}, "name": "find_flights"}\n</tool_call>'
          ' <tool_call>not json</tool_call>')
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "P\\"a}ris", "n": [1, {"x": 2}]}}; ' \
         '{"name": "find_flights", "parameters": {"day": 3}}'
MISTRAL = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "P\\"a}ris", "n": [1, {"x": 2}]}}, ' \
          '{"name": "find_flights", "arguments": {"day": 3}}]'
EXPECTED = [("get_weather", {"city": 'P"a}ris', "n": [1, {"x": 2}]}), ("find_flights", {"day": 3})]
# whitespace between calls separates them: not content (sample_reader.py)
CASES = {"hermes": (HERMES, "Let me check.  <tool_call>not json</tool_call>"), "llama3_json": (LLAMA3, ""),
         "mistral": (MISTRAL, "Sure.")}


def read(settings: ReadSettings, text: str, step: int):
    """(content, reasoning, calls as (name, arguments text)) of `text` fed `step` characters at a time."""
    reader = settings.reader()
    content, reasoning, calls = "", "", {}
    for start in range(0, len(text), step):
        for event in reader.feed(text[start:start + step], start + step >= len(text)):
            if event[0] == "content":
                content += event[1]
            elif event[0] == "reasoning":
                reasoning += event[1]
            else:
                entry = calls.setdefault(event[1], [event[2]["function"].get("name"), ""])
                entry[1] += event[2]["function"]["arguments"]
    return content, reasoning, [tuple(v) for v in calls.values()]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_each_format_streams_what_it_reads_whole(name, step):
    text, content = CASES[name]
    settings = ReadSettings(tool_format=FORMATS[name]())
    whole_content, _, whole_calls = settings.reader().read_whole(text)
    assert (whole_content or "") == content
    assert [(c["name"], json.loads(c["arguments"])) for c in whole_calls] == EXPECTED
    assert whole_calls[0]["arguments"] == '{"city": "P\\"a}ris", "n": [1, {"x": 2}]}'  # the text as generated
    streamed_content, _, streamed_calls = read(settings, text, step)
    assert streamed_content == content
    assert streamed_calls == [(c["name"], c["arguments"]) for c in whole_calls]


@pytest.mark.parametrize("name", list(CASES))
def test_a_call_cut_off_by_the_end_never_reaches_content(name):
    """Every prefix of a text with two calls, read as a whole output (max_tokens cut it there):
    the content never holds call markup, and the calls returned are complete and parse."""
    text = CASES[name][0]
    markers = {"hermes": "<tool_call>", "llama3_json": "{", "mistral": "[TOOL_CALLS]"}
    ends = {"hermes": "</tool_call>", "llama3_json": "}}", "mistral": "}},"}  # where the first call is complete
    first_end = text.index(ends[name]) + len(ends[name])
    for cut in range(1, len(text)):
        content, _, calls = ReadSettings(tool_format=FORMATS[name]()).reader().read_whole(text[:cut])
        if name == "hermes" and cut > text.index(" <tool_call>not"):
            continue  # the third block is not a call: once closed it is content
        assert markers[name] not in (content or ""), (cut, content)
        assert all(json.loads(c["arguments"]) is not None for c in calls)
        if cut >= first_end:
            assert calls and calls[0]["name"] == "get_weather", cut


def test_a_json_answer_is_not_taken_for_a_llama_call():
    content, _, calls = ReadSettings(tool_format=FORMATS["llama3_json"]()).reader().read_whole(
        '{"city": "Paris"} is the answer')
    assert calls == [] and content == '{"city": "Paris"} is the answer'
    content, _, calls = ReadSettings(tool_format=FORMATS["llama3_json"]()).reader().read_whole("No call: {x}")
    assert calls == [] and content == "No call: {x}"


class _Tokenizer:
    def __init__(self, template, special=()):
        self.chat_template, self.all_special_tokens = template, list(special)

    def convert_tokens_to_ids(self, token):
        return 7


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}<tool_call>{% endfor %}", "hermes"),
    ("{{ '<|start_header_id|>' }}{% if tools %}\"parameters\"{% endif %}", "llama3_json"),
    ("{{ '<|python_tag|>' }}", "llama3_json"),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
])
def test_auto_finds_the_format_in_the_chat_template(template, expected):
    assert tool_format("auto", _Tokenizer(template)).name == expected


def test_a_special_marker_token_is_written_by_the_grammar_as_that_token():
    fmt = tool_format("mistral", _Tokenizer("", special=["[TOOL_CALLS]"]))
    assert fmt.keep_special_tokens and fmt.marker_token_id == 7
    assert not tool_format("mistral", _Tokenizer("")).keep_special_tokens


def test_the_flags_name_the_parsers_there_are():
    assert options.TOOL_CALL_PARSERS == PARSER_NAMES
    assert options.REASONING_PARSERS == REASONING_NAMES


THINK = ReasoningFormat("qwen3", *REASONING_TAGS["qwen3"])


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nplan a b\n</think>\n\nThe answer.", False, "plan a b", "The answer."),
    ("  <think>x</think>y", False, "x", "y"),
    ("The answer, no reasoning.", False, "", "The answer, no reasoning."),
    ("<thinking is not a tag", False, "", "<thinking is not a tag"),
    ("<thi", False, "", "<thi"),  # the output ended before the tag could complete
    ("I think </think> so", False, "", "I think </think> so"),  # a closing tag only: no reasoning opened
    ("plan \n</think>\nanswer", True, "plan", "answer"),  # the prompt opened it
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),
    ("<think>a\n\n  b </think>", False, "a\n\n  b", ""),
])
def test_reasoning_split_never_takes_an_answer_for_reasoning(text, opened, reasoning, content, step):
    settings = ReadSettings(reasoning=THINK, reasoning_opened=opened)
    assert read(settings, text, step)[:2] == (content, reasoning)
    whole = settings.reader().read_whole(text)
    assert (whole[0], whole[1]) == (content, reasoning or None)


def test_reasoning_then_a_tool_call():
    settings = ReadSettings(reasoning=THINK, tool_format=FORMATS["hermes"]())
    content, reasoning, calls = settings.reader().read_whole(
        '<think>call it</think>\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')
    assert (content, reasoning, [(c["name"], c["arguments"]) for c in calls]) == (None, "call it", [("f", "{}")])


def test_stop_strings_are_cut_or_kept():
    assert ReadSettings(["STOP"]).reader().read_whole("abc STOP def")[0] == "abc "
    assert ReadSettings(["STOP"], keep_stop=True).reader().read_whole("abc STOP def")[0] == "abc STOP"
    assert read(ReadSettings(["STOP"], keep_stop=True), "abc STOP def", 1)[0] == "abc STOP"


def test_a_forced_call_writes_declared_arguments_only():
    from chunk_llama.server.tool_schemas import closed

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "when": {"type": "object", "properties": {
        "day": {"type": "integer"}}}, "tags": {"type": "object"}}, "required": ["city"]}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["when"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["tags"]  # no properties declared: any object
    assert closed({**schema, "additionalProperties": True})["additionalProperties"] is True  # said: kept


CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("text, stops", [
    ("Hi " + CALL + " bye " + CALL + "\n", []),  # whitespace before a later call, after text: content
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}} oops\n</tool_call>\n' + CALL, ["STOP"]),  # a dropped block
    (CALL + "\n" + CALL + "\n \n", ["}}"]),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_stream_reads_what_the_whole_reads_around_calls(text, stops, step):
    """Whitespace is held only right after a call; with stop strings a held call is known by its
    id, so a block the parser drops (not a call) never lends its deltas to the next call."""
    settings = ReadSettings(stops=stops, tool_format=FORMATS["hermes"]())
    content, _, calls = settings.reader().read_whole(text)
    want = (content or "", [(c["name"], c["arguments"]) for c in calls])
    streamed, _, streamed_calls = read(settings, text, step)
    assert (streamed, streamed_calls) == want
