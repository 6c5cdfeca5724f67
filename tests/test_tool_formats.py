"""Each family's tool-call format end to end, on the tiny byte-level Llama of
test_server_tools.py under chat templates written here after Llama 3.1's and Mistral's
conventions (the tools and earlier calls rendered by the template; Mistral's `[TOOL_CALLS]` a
special token): `auto` finds the format in the template, a forced call is generated in that
format and read back as valid calls, whole and streamed alike, the next turn renders the call
through the template, and a call cut off by max_tokens leaves no markup in `content`."""

from __future__ import annotations

import json

import openai
import pytest
from helpers import tiny_byte_llama, tiny_byte_tokenizer
from test_server import Server
from test_server_tools import TOOLS, check_calls

from chunk_llama import ChunkLlamaEngine
from chunk_llama.server import create_app

MODEL = "tiny-format"
LLAMA3 = (  # the tools as JSON in the system turn; calls as {"name", "parameters"} objects
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>Call with {\"name\": name, \"parameters\": {...}}:"
    "{% for t in tools %} {{ t | tojson }}{% endfor %}<|eot_id|>{% endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "{%- if m.get('tool_calls') %}{% for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", "
    "\"parameters\": {{ c['function']['arguments'] | tojson }}}{% endfor %}"
    "{%- else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")
MISTRAL = (  # the tools before the last user turn; calls as [TOOL_CALLS] and a JSON list
    "{%- for m in messages %}{% if m['role'] == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m['content'] }}[/INST]"
    "{%- elif m.get('tool_calls') %}[TOOL_CALLS][{% for c in m['tool_calls'] %}{\"name\": "
    "\"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]<eos>"
    "{%- elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{%- else %}{{ m['content'] }}{% endif %}{% endfor %}")
TEMPLATES = {"llama3_json": LLAMA3, "mistral": MISTRAL}
QUESTION = [{"role": "user", "content": "Weather in Paris, and flights on day 3?"}]


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request):
    tokenizer = tiny_byte_tokenizer()
    if request.param == "mistral":
        tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer.chat_template = TEMPLATES[request.param]
    engine = ChunkLlamaEngine(tiny_byte_llama(tokenizer, max_position_embeddings=2048), tokenizer, max_batch_size=4,
                              chunk_size=16, kv_cache_bytes=16 << 20)
    app = create_app(engine, MODEL)
    server = Server(app)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield request.param, engine, client
    finally:
        server.stop()


def test_auto_reads_the_format_and_the_template_renders_the_tools(served):
    name, engine, _ = served
    from chunk_llama.server.served import served_model

    traits = served_model(engine)
    assert traits.tool_format.name == name and traits.native_tools
    assert traits.tool_format.keep_special_tokens == (name == "mistral")


@pytest.mark.parametrize("parallel", [False, True])
def test_forced_calls_in_the_family_format_whole_and_streamed(served, parallel):
    name, engine, client = served
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                  max_tokens=160, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    check_calls(whole.message, id_prefix="call_" if name != "mistral" else "")
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert parallel or len(whole.message.tool_calls) == 1
    calls, content = {}, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, [part.function.name, ""])
            entry[1] += part.function.arguments or ""
    assert content == "" and [tuple(v) for v in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    if name == "mistral":  # the calls' ids are what Mistral's templates take, not call_...
        assert all(len(c.id) == 9 and c.id.isalnum() for c in whole.message.tool_calls)


def test_the_next_turn_renders_the_call_through_the_template(served):
    name, engine, client = served
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=160, temperature=0)
    message = first.choices[0].message
    call = message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
    second = client.chat.completions.create(model=MODEL, messages=QUESTION + [message.model_dump(exclude_none=True),
                                            result], tools=TOOLS, max_tokens=4, temperature=0)
    arguments = json.loads(call.function.arguments)
    as_template_takes = {"messages": [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}]},
        result], "tools": TOOLS}
    ids = engine.tokenize(as_template_takes)
    assert second.usage.prompt_tokens == len(ids)
    rendered = engine.tokenizer.decode(ids, skip_special_tokens=False)
    key = "parameters" if name == "llama3_json" else "arguments"
    assert f'"name": "{call.function.name}", "{key}": ' in rendered  # the call, as the template writes it
    assert "You may call one or more functions" not in rendered  # the template's rendering, not the fallback's


def test_a_cut_off_call_leaves_no_markup(served):
    name, _, client = served
    for max_tokens in (3, 9, 20):
        choice = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="required",
                                                max_tokens=max_tokens, temperature=0).choices[0]
        assert choice.finish_reason == "length"
        assert not choice.message.tool_calls  # none complete yet
        assert "[TOOL_CALLS]" not in (choice.message.content or "") and "{" not in (choice.message.content or "")


def _accepts(grammar, tokenizer, text: str) -> bool:
    """Whether llguidance takes `text` (as the tokenizer writes it) as a whole output of `grammar`."""
    import llguidance
    import llguidance.hf

    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, len(tokenizer)),
                                   grammar.llguidance_grammar(), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


CALL = '{"name":"get_weather","ARGS":{"city":"Lima","unit":"c"}}'
BAD_CALL = '{"name":"get_weather","ARGS":{"city":"Lima","unit":"c","x":1}}'
AUTO_CASES = {  # format: [(output, taken under tool_choice auto with a strict tool)]
    "hermes": [("Sunny.", True), ("", True), (f"Let me see. <tool_call>\n{CALL}\n</tool_call>", True),
               (f"<tool_call>\n{BAD_CALL}\n</tool_call>", False), ("a <tool_call> b", False)],
    "llama3_json": [("Sunny.", True), (CALL, True), (BAD_CALL, False), ("{not a call}", False)],
    "mistral": [("Sunny [x].", True), (f"Here:[TOOL_CALLS][{CALL}]", True), (f"[TOOL_CALLS][{BAD_CALL}]", False),
                ("a [TOOL_CALLS] b", False)],
}


@pytest.mark.parametrize("name", list(AUTO_CASES))
def test_auto_grammar_takes_text_or_valid_calls_only(name):
    from chunk_llama.server.schemas import Tool
    from chunk_llama.server.tool_formats import FORMATS

    tokenizer = tiny_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    fmt = FORMATS[name](tokenizer.convert_tokens_to_ids("[TOOL_CALLS]") if name == "mistral" else None)
    grammar = fmt.grammar([Tool.model_validate({**t, "function": {**t["function"], "strict": True}}) for t in TOOLS],
                          None, True, free_text=True)
    for text, taken in AUTO_CASES[name]:
        assert _accepts(grammar, tokenizer, text.replace("ARGS", fmt.arguments_key)) == taken, text


def test_call_schemas_close_no_parameters_and_merge_all_of():
    from chunk_llama.server.schemas import FunctionDefinition
    from chunk_llama.server.tool_schemas import call_schema, closed

    for parameters in (None, {}):  # (omitted, null or empty: an empty argument list, never any JSON value)
        none = call_schema(FunctionDefinition(name="f", parameters=parameters), "arguments")["properties"]["arguments"]
        assert none == {"type": "object", "properties": {}, "additionalProperties": False}, parameters
    untyped = call_schema(FunctionDefinition(name="f", parameters={"properties": {"a": {"type": "integer"}}}),
                          "arguments")["properties"]["arguments"]
    assert untyped["type"] == "object" and untyped["additionalProperties"] is False
    branches = [{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                {"properties": {"days": {"type": "integer"}, "city": {"maxLength": 6}}, "required": ["days"]}]
    assert closed({"allOf": branches}) == {
        "type": "object", "required": ["city", "days"], "additionalProperties": False,
        "properties": {"city": {"allOf": [{"type": "string"}, {"maxLength": 6}]}, "days": {"type": "integer"}}}
    ref = closed({"allOf": [{"$ref": "#/$defs/a"}, branches[0]], "$defs": {"a": branches[1]}})
    assert "additionalProperties" not in ref["allOf"][1]  # not mergeable: branches stay open
    assert ref["$defs"]["a"]["additionalProperties"] is False


def test_strict_tools_under_auto_are_not_constrained_where_a_grammar_cannot_hold_the_reply(caplog):
    """A response_format's grammar, or a reasoning model's thinking (its tags are added tokens no
    grammar text may write), keeps the reply unconstrained under auto (logged once); forced calls
    keep their grammar."""
    from chunk_llama.logs import forget_logged
    from chunk_llama.server.schemas import ChatCompletionRequest
    from chunk_llama.server.tool_formats import FORMATS
    from chunk_llama.server.tools import call_grammar

    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}])
    hermes = FORMATS["hermes"]()
    forget_logged()
    with caplog.at_level("WARNING", logger="chunk_llama.server.tools"):
        assert call_grammar(hermes, body.tools, "auto", True, None) is not None
        assert call_grammar(hermes, body.tools, "auto", True, None, reasoning=True) is None
        assert call_grammar(hermes, body.tools, "required", True, None, reasoning=True) is not None
    assert any("reasoning model" in r.getMessage() for r in caplog.records)
