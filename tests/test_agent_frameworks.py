"""Agent frameworks as they are written today, against a real `chunk-llama` server on
127.0.0.1 serving the default model (SmolLM2-135M-Instruct): the OpenAI Agents SDK over the
Responses API and over chat completions (`OpenAIChatCompletionsModel`), and smolagents'
`ToolCallingAgent` with `OpenAIServerModel`. Each runs a bounded multi-step tool loop to its
end: the model calls the tool, the tool's result goes back, the model answers. Greedy
decoding and small `max_tokens` keep every run the same and short; one server for the module,
stopped at the end. The frameworks are test dependencies only (the `test` extra)."""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest
import torch
from test_server import Server

import chunk_llama
from chunk_llama import ChunkLlamaEngine
from chunk_llama.server import create_app
from chunk_llama.server.main import DEFAULT_MODEL_NAME as NAME

pytestmark = pytest.mark.slow
CITY, WEATHER = "Paris", "sunny, 21 C"
QUESTION = f"What is the weather in {CITY}? Use the get_weather tool."
calls: list[str] = []  # the cities the tool was called with, in order


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: the city's name
    """
    calls.append(city)
    return f"The weather in {city} is {WEATHER}."


@pytest.fixture(scope="module")
def url():
    model, tokenizer = chunk_llama.load_default_model(torch.float32)
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=8, kv_cache_bytes=128 << 20)
    server = Server(create_app(engine, NAME))
    try:
        yield server.url
    finally:
        server.stop()
        assert not engine.has_unfinished_requests()


@pytest.fixture(autouse=True)
def _fresh_calls():
    calls.clear()


def _agents_run(url: str, api: str):
    """The Agents SDK's loop: a required first call, then (the SDK resets tool_choice once a tool
    ran) the model's answer from the tool's result."""
    import agents

    agents.set_tracing_disabled(True)  # no export to OpenAI from a test
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    agent = agents.Agent(
        name="weather", instructions="Answer questions about the weather with the get_weather tool.",
        tools=[agents.function_tool(get_weather)], model=model_class(model=NAME, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                            max_tokens=96))
    return asyncio.run(agents.Runner.run(agent, QUESTION, max_turns=4))


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_tool_loop(url, api):
    import agents

    result = _agents_run(url, api)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
    assert calls and all(isinstance(c, str) and c for c in calls)
    assert kinds[-1] == "MessageOutputItem" and isinstance(result.final_output, str) and result.final_output.strip()
    assert agents.ItemHelpers.text_message_outputs(result.new_items) == result.final_output
    assert len(result.raw_responses) <= 4


def test_smolagents_tool_calling_agent(url):
    """smolagents asks for a required call every step. The 135M model calls get_weather, reads its
    result, and calls it again rather than final_answer, so the loop ends the way smolagents
    ends one at max_steps: its final-answer request (no tools) answers from the memory."""
    import smolagents

    model = smolagents.OpenAIServerModel(model_id=NAME, api_base=url + "/v1", api_key="unused", temperature=0,
                                         max_tokens=128)
    agent = smolagents.ToolCallingAgent(tools=[smolagents.tool(get_weather)], model=model, max_steps=2,
                                        verbosity_level=0)
    answer = agent.run(QUESTION)
    steps = [s for s in agent.memory.steps if isinstance(s, smolagents.ActionStep)]
    names = [c.name for s in steps for c in s.tool_calls or []]
    assert names and names[0] == "get_weather" and calls == [CITY] * len(calls), names
    assert set(names) <= {"get_weather", "final_answer"} and not any(s.error for s in steps[:1])
    assert WEATHER in (steps[0].observations or "")  # the result went back to the model
    assert isinstance(answer, str) and answer.strip()


TRAVEL_TOOLS = [
    {"type": "function", "function": {"name": "add_baggage", "description": "Add a bag to a booking",
                                      "parameters": {"type": "object", "properties": {
                                          "booking_ref": {"type": "string"}, "bags": {"type": "integer"}},
                                          "required": ["booking_ref", "bags"]}}},
    {"type": "function", "function": {"name": "get_booking", "description": "Look a booking up",
                                      "parameters": {"type": "object", "properties": {
                                          "booking_ref": {"type": "string"}}, "required": ["booking_ref"]}}},
]


def test_eight_concurrent_required_calls_never_leak_markup(url):
    """The default model repeats parallel calls until max_tokens cuts one: every answer keeps its
    complete calls, valid JSON, and no call markup reaches content (whole and streamed)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    results, errors = {}, []

    def run(i):
        try:
            messages = [{"role": "user", "content": f"Add {i + 1} bags to booking LIS{2027 + i}."}]
            kwargs = dict(model=NAME, messages=messages, tools=TRAVEL_TOOLS, tool_choice="required", max_tokens=96,
                          temperature=0)
            whole = client.chat.completions.create(**kwargs)
            content, streamed_calls = "", {}
            for chunk in client.chat.completions.create(**kwargs, stream=True):
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for part in delta.tool_calls or []:
                    streamed_calls.setdefault(part.index, "")
                    streamed_calls[part.index] += part.function.arguments or ""
            results[i] = (whole.choices[0], content, streamed_calls)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(results) == 8
    for choice, streamed_content, streamed_calls in results.values():
        message = choice.message
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert call.function.name in ("add_baggage", "get_booking")
            assert isinstance(json.loads(call.function.arguments), dict)
        for text in (message.content or "", streamed_content):
            assert "<tool_call>" not in text and "</tool_call>" not in text and '"arguments"' not in text
        complete = [c.function.arguments for c in message.tool_calls]
        assert [streamed_calls[i] for i in range(len(complete))] == complete


def test_chat_and_responses_give_the_same_greedy_answer(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    system = "You are a helpful travel assistant."
    chat = client.chat.completions.create(model=NAME, max_tokens=32, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": QUESTION}])
    response = client.responses.create(model=NAME, instructions=system, input=QUESTION, max_output_tokens=32,
                                       temperature=0)
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
