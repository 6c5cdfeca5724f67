"""Tool calls, structured output and the sampling options of the OpenAI-compatible server,
through the official `openai` client against a real server on 127.0.0.1 serving a tiny
random Llama with a byte-level tokenizer (it can write JSON). Each option is checked
against its definition: the server's tokens equal `engine.generate` with a processor
written here from the OpenAI / transformers formula."""

from __future__ import annotations

import contextlib
import json
import threading

import httpx
import jsonschema
import openai
import pytest
import torch
from helpers import tiny_byte_llama, tiny_byte_tokenizer
from test_server import Server
from transformers import GenerationConfig, LogitsProcessor

from chunk_llama import ChunkLlamaEngine
from chunk_llama.server import create_app

MODEL = "tiny-bytes"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
FLIGHTS = {"type": "function", "function": {"name": "find_flights", "parameters": {
    "type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31}},
    "required": ["day"], "additionalProperties": False}}}
TOOLS = [WEATHER, FLIGHTS]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SYSTEM = {"role": "system", "content": "You are a travel agent. Use the tools. " * 6}


@contextlib.contextmanager
def byte_server(tokenizer, max_batch_size: int = 4, kv_cache_bytes: int = 8 << 20):
    """A real server of the tiny byte-level model on `tokenizer`: (engine, url, an openai client)."""
    engine = ChunkLlamaEngine(tiny_byte_llama(tokenizer, max_position_embeddings=2048), tokenizer,
                              max_batch_size=max_batch_size, chunk_size=16, kv_cache_bytes=kv_cache_bytes)
    server = Server(create_app(engine, MODEL))
    try:
        yield engine, server.url, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                                timeout=120)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served():
    tokenizer = tiny_byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    with byte_server(tokenizer, max_batch_size=8, kv_cache_bytes=16 << 20) as (engine, url, _):
        yield engine, url
    assert not engine.has_unfinished_requests()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(question: str) -> list[dict]:
    return [SYSTEM, {"role": "user", "content": question}]


def check_calls(message, names=None, id_prefix="call_"):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith(id_prefix)
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_concurrent_tool_choices(served, client):
    """required, a named function and auto, four of each at once: the forced ones always parse and
    validate under the function's schema and finish with tool_calls."""
    results, errors = {}, []

    def run(key, choice, parallel):
        try:
            results[key] = client.chat.completions.create(
                model=MODEL, messages=ask(f"question {key}"), tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=parallel, max_tokens=120, temperature=0)
        except Exception as error:  # reported below
            errors.append(error)

    choices = {"required": "required", "named": {"type": "function", "function": {"name": "find_flights"}},
               "auto": "auto"}
    # a random model may go on calling forever with parallel calls allowed (the default model's
    # test has them): one call each here, but for the named function (one call anyway)
    threads = [threading.Thread(target=run, args=(f"{kind}{i}", choice, kind != "required"))
               for kind, choice in choices.items() for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 12
    for key, response in results.items():
        (choice,) = response.choices
        if key.startswith("required"):
            check_calls(choice.message, {"get_weather", "find_flights"})
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
        elif key.startswith("named"):
            check_calls(choice.message, {"find_flights"})
            assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
        else:  # a random model rarely writes a call by itself: plain text, no tool_calls
            assert choice.message.content is not None or choice.message.tool_calls


def test_streamed_tool_calls_reassemble_to_the_whole_response(served, client):
    kwargs = dict(model=MODEL, messages=ask("weather in Paris?"), tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    check_calls(whole.message)
    calls, reasons, first = {}, [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        (choice,) = chunk.choices
        reasons.append(choice.finish_reason)
        first = first or choice.delta.role
        assert not choice.delta.content
        for part in choice.delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
            assert call["name"]  # the name comes first, with the id
            call["arguments"] += part.function.arguments or ""
    assert first == "assistant" and reasons[-1] == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_tool_result_turn_reuses_the_first_turn(served, client):
    engine, _ = served
    messages = ask("weather in Paris?")
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0)
    message = first.choices[0].message
    check_calls(message)
    call = message.tool_calls[0]
    history = messages + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # every token of the first turn (prompt and generated call) was cached: it continues them
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + \
        first.usage.completion_tokens - 1
    assert engine.inputs.conversations.num_continued >= 1


def test_json_schema_and_json_object_answers_validate(served, client):
    schema = SCHEMAS["get_weather"]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=ask("json please"), response_format=fmt,
                                          max_tokens=60, temperature=0)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    text = client.completions.create(model=MODEL, prompt="a city:", max_tokens=60, temperature=0,
                                     extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(text.choices[0].text), schema)
    stream = client.chat.completions.create(model=MODEL, messages=ask("any object"), max_tokens=40, temperature=0,
                                            response_format={"type": "json_object"}, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream)
    assert streamed.startswith("{")


class ByHand(LogitsProcessor):
    """OpenAI's logit_bias, frequency and presence penalties and transformers' repetition
    penalty, top-k and min-p, written from their definitions."""

    def __init__(self, prompt_len, bias=None, frequency=0.0, presence=0.0, repetition=None, top_k=None, min_p=None):
        self.__dict__.update(locals())

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for token, value in (self.bias or {}).items():
            scores[0, token] += value
        generated = input_ids[0, self.prompt_len:].tolist()
        for token in set(generated):
            scores[0, token] -= generated.count(token) * self.frequency + self.presence
        if self.repetition is not None:
            for token in set(input_ids[0].tolist()):
                value = scores[0, token]
                scores[0, token] = value * self.repetition if value < 0 else value / self.repetition
        if self.top_k is not None:
            kth = scores[0].topk(self.top_k).values[-1]
            scores[scores < kth] = float("-inf")
        if self.min_p is not None:
            probs = scores.softmax(-1)
            scores[probs < self.min_p * probs.max()] = float("-inf")
        return scores


OPTIONS = [  # (request fields, ByHand arguments, sampled)
    ({"logit_bias": {"40": 4.0, "41": -100}}, {"bias": {40: 4.0, 41: -100.0}}, False),
    ({"frequency_penalty": 1.5}, {"frequency": 1.5}, False),
    ({"presence_penalty": 2.0}, {"presence": 2.0}, False),
    ({"frequency_penalty": -0.5, "presence_penalty": 1.0}, {"frequency": -0.5, "presence": 1.0}, False),
    ({"repetition_penalty": 1.8}, {"repetition": 1.8}, False),
    ({"top_k": 3}, {"top_k": 3}, True),
    ({"min_p": 0.3}, {"min_p": 0.3}, True),
]


@pytest.mark.parametrize("fields,by_hand,sampled", OPTIONS, ids=[next(iter(o[0])) for o in OPTIONS])
def test_sampling_options_follow_their_definitions(served, client, fields, by_hand, sampled):
    engine, _ = served
    messages = ask("tell me about Lima " * 2)
    prompt_len = len(engine.tokenize(messages))
    settings = dict(do_sample=True, temperature=1.0, top_k=0, seed=7) if sampled else dict(do_sample=False)
    (expected,) = engine.generate([messages], GenerationConfig(max_new_tokens=24, **settings),
                                  logits_processor=[ByHand(prompt_len, **by_hand)])
    (plain,) = engine.generate([messages], GenerationConfig(max_new_tokens=24, **settings))
    assert expected.token_ids != plain.token_ids  # the option changes the output here
    extra = dict(temperature=1.0, seed=7) if sampled else dict(temperature=0)
    response = client.completions.create(model=MODEL, prompt=engine.tokenize(messages), max_tokens=24,
                                         extra_body=fields, **extra)
    assert response.choices[0].text == expected.text


def test_bad_tool_and_format_requests_get_400_and_ignored_fields_are_accepted(served, client):
    _, url = served
    body = {"model": MODEL, "messages": ask("hi"), "max_tokens": 2}
    bad = [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not among the tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", "pattern"),
        ({"logit_bias": {"5000": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "Input should be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         None, "invalid json schema grammar"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
         "tool call"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
          "function": {"name": "f", "arguments": "{not json"}}]}, {"role": "user", "content": "x"}]}, "messages",
         "not valid JSON"),
    ]
    for change, param, message in bad:
        response = httpx.post(url + "/v1/chat/completions", json={**body, **change}, timeout=30)
        assert response.status_code == 400, (change, response.text)
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], (change, error)
    ok = client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=2, temperature=0, user="u1",
                                        metadata={"k": "v"}, store=False, service_tier="auto",
                                        extra_body={"functions": []})  # unknown here: accepted (test_server_fields)
    assert ok.choices[0].finish_reason == "length"


NATIVE_TEMPLATE = (  # a Hermes-style template: it renders the tools and the calls itself
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}"
    "<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_that_knows_tools_renders_them():
    tokenizer = tiny_byte_tokenizer()
    tokenizer.chat_template = NATIVE_TEMPLATE
    with byte_server(tokenizer) as (engine, _, client):
        response = client.chat.completions.create(model=MODEL, messages=ask("flights?"), tools=TOOLS,
                                                  tool_choice="required", parallel_tool_calls=False,
                                                  max_tokens=120, temperature=0)
        check_calls(response.choices[0].message)
        prompt = tokenizer.decode(engine.tokenize({"messages": ask("flights?"), "tools": TOOLS}))
        assert prompt.startswith("<tools>get_weather find_flights </tools>") and "<function-name>" not in prompt
        assert response.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])


@pytest.mark.slow
def test_default_model_tool_calls_and_json_schema_always_validate_under_16_clients():
    """The targets on SmolLM2-135M-Instruct: tool_choice=required and a strict json_schema, 16
    concurrent clients each: every answer parses and validates. One call each: with parallel calls
    allowed this model repeats its call until max_tokens (the calls before the cut still parse)."""
    import chunk_llama
    from chunk_llama.cli import DEFAULT_PROMPTS, read_prompts
    from chunk_llama.server.main import DEFAULT_MODEL_NAME

    model, tokenizer = chunk_llama.load_default_model(torch.float32)
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=16, kv_cache_bytes=256 << 20)
    server = Server(create_app(engine, DEFAULT_MODEL_NAME))
    questions = read_prompts(DEFAULT_PROMPTS)[:16]
    answer = {"type": "object", "properties": {"airport": {"type": "string", "maxLength": 3},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 10000}},
              "required": ["airport", "count"], "additionalProperties": False}
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        results, errors = {}, []

        def run(i, kind):
            try:
                messages = [{"role": "user", "content": questions[i]}]
                if kind == "tools":
                    results[(kind, i)] = client.chat.completions.create(
                        model=DEFAULT_MODEL_NAME, messages=messages, tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False, max_tokens=80, temperature=0)
                else:
                    results[(kind, i)] = client.chat.completions.create(
                        model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=80, temperature=0,
                        response_format={"type": "json_schema",
                                         "json_schema": {"name": "answer", "schema": answer, "strict": True}})
            except Exception as error:  # reported below
                errors.append(error)

        for kind in ("tools", "json"):
            threads = [threading.Thread(target=run, args=(i, kind)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(600)
        assert not errors and len(results) == 32
        for (kind, _), response in results.items():
            choice = response.choices[0]
            if kind == "tools":
                check_calls(choice.message)
                assert choice.finish_reason == "tool_calls"
            else:
                assert choice.finish_reason == "stop"
                jsonschema.validate(json.loads(choice.message.content), answer)
    finally:
        server.stop()
