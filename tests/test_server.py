"""The OpenAI-compatible server (`chunk_llama.server`) through the official `openai` client,
against a real uvicorn server on 127.0.0.1 serving a tiny random Llama with a word-level
tokenizer and a chat template built here. Every wait is bounded in time."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from helpers import tiny_llama, tiny_tokenizer
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.server import create_app
from chunk_llama.server.http import uvicorn_config
from chunk_llama.server.options import DeployArgs

MODEL = "tiny-llama"
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}w2 {% elif m['role'] == 'user' %}w3 "
    "{% else %}w4 {% endif %}"
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
)
CHUNK = 16
LONG = 2000  # max_tokens of a request that must still run when its client leaves


def words(seed: int, count: int) -> str:
    """`count` ordinary words (w6..w95) of the tiny vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(6, 96, (count,), generator=g))


def chat(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


class Server:
    """uvicorn in a background thread on a free port of 127.0.0.1, configured as `chunk-llama
    serve` configures it (`deploy`'s read and keep-alive timeouts)."""

    def __init__(self, app, deploy: DeployArgs | None = None):
        import uvicorn

        deploy = deploy or DeployArgs()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(
            app, host="127.0.0.1", port=self.port, header_timeout=deploy.header_timeout,
            keep_alive_timeout=deploy.keep_alive_timeout, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start in 30 s"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive(), "the server did not stop in 15 s"
        self.sock.close()


@pytest.fixture(scope="module")
def served():
    """(engine, base url). The EOS row of the LM head is zeroed, so greedy decoding never
    picks EOS (every other logit is far from 0) and requests run to max_tokens or a stop string."""
    model = tiny_llama(max_position_embeddings=2048)
    with torch.no_grad():
        model.lm_head.weight[5].zero_()
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=8, chunk_size=CHUNK, kv_cache_bytes=8 << 20)
    server = Server(create_app(engine, MODEL))
    try:
        yield engine, server.url
    finally:
        server.stop()
        assert not engine.has_unfinished_requests()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(engine, prompts, max_new_tokens, **kwargs):
    return engine.generate(
        prompts, GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, **kwargs)
    )


def metrics(url) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def wait_for(condition, seconds=15.0, what="condition"):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_health_and_models(served, client):
    url = served[1]
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    assert [m.id for m in client.models.list()] == [MODEL]
    missing = httpx.get(url + "/v1/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"


def test_concurrent_streams_sharing_a_system_prompt_equal_generate(served, client):
    engine, _ = served
    system = words(1, 90)
    chats = [chat(system, words(100 + i, 3 + i)) for i in range(6)]
    expected = greedy(engine, chats, 24)
    texts, reasons, errors = [None] * len(chats), [None] * len(chats), []

    def run(i):
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=chats[i], max_tokens=24, temperature=0, stream=True
            )
            pieces = []
            for chunk in stream:
                (choice,) = chunk.choices
                pieces.append(choice.delta.content or "")
                reasons[i] = choice.finish_reason or reasons[i]
            texts[i] = "".join(pieces)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert texts == [out.text for out in expected]
    assert all(len(out.token_ids) == 24 for out in expected) and reasons == ["length"] * len(chats)


def test_non_streaming_chat_and_completions_equal_generate(served, client):
    engine, _ = served
    messages = chat(words(2, 40), words(3, 5))
    (expected,) = greedy(engine, [messages], 12)
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=12, temperature=0
    )
    assert response.object == "chat.completion" and response.model == MODEL
    (choice,) = response.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert (
        response.usage.prompt_tokens == len(expected.prompt_token_ids)
        and response.usage.completion_tokens == 12
    )

    prompts = [words(4, 20), words(5, 7)]
    expected = greedy(engine, prompts, 10)
    one = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=10, temperature=0)
    assert one.choices[0].text == expected[0].text and one.usage.prompt_tokens == len(
        expected[0].prompt_token_ids
    )
    ids = client.completions.create(
        model=MODEL, prompt=expected[1].prompt_token_ids, max_tokens=10, temperature=0
    )
    assert ids.choices[0].text == expected[1].text
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == [
        o.text for o in expected
    ]
    assert both.usage.completion_tokens == 20
    stream = client.completions.create(
        model=MODEL,
        prompt=prompts[1],
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[1].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_n_samples_seeded_equal_generate(served, client):
    engine, _ = served
    messages = chat(words(6, 30), words(7, 4))
    config = GenerationConfig(
        max_new_tokens=8, do_sample=True, temperature=0.9, top_k=0, num_return_sequences=3, seed=1234
    )
    expected = engine.generate([messages], config)
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.9, n=3, seed=1234
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.message.content for c in response.choices] == [o.text for o in expected]
    assert len({o.text for o in expected}) > 1  # the samples differ: they were sampled
    assert response.usage.completion_tokens == 24 and response.usage.prompt_tokens == len(
        expected[0].prompt_token_ids
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0.9, n=3, seed=1234, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [o.text for o in expected]


def test_stop_strings_cut_the_text(served, client):
    engine, _ = served
    messages = chat(words(8, 25), words(9, 6))
    (full,) = greedy(engine, [messages], 30)
    tokens = full.text.split(" ")
    stop = f" {tokens[6]} {tokens[7]}"
    expected = full.text[: full.text.index(stop)]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stop=stop
    )
    assert response.choices[0].message.content == expected and response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens < 30
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, temperature=0, stop=["w999", stop], stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    (plain,) = greedy(engine, [words(10, 12)], 30)
    text = client.completions.create(
        model=MODEL, prompt=words(10, 12), max_tokens=30, temperature=0, stop=[" w"]
    )
    assert text.choices[0].text == plain.text.split(" ")[0] and text.usage.completion_tokens == 2


def test_usage_reports_cached_prompt_tokens(served, client):
    engine, url = served
    system = words(11, 70)
    first_chat, second_chat = chat(system, words(12, 3)), chat(system, words(13, 5))
    first = client.chat.completions.create(model=MODEL, messages=first_chat, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens <= 1  # new, but for the template's first token
    before = metrics(url)["chunk_llama_prefix_cache_hit_tokens_total"]
    second = client.chat.completions.create(model=MODEL, messages=second_chat, max_tokens=2, temperature=0)
    a, b = engine.tokenize(first_chat), engine.tokenize(second_chat)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common < (len(a) + 1) // CHUNK * CHUNK  # within the full chunks the first request left cached
    assert second.usage.prompt_tokens == len(b)
    assert second.usage.prompt_tokens_details.cached_tokens == common
    assert metrics(url)["chunk_llama_prefix_cache_hit_tokens_total"] == before + common


def test_logprobs_are_the_model_log_softmax(served, client):
    engine, _ = served
    messages = chat(words(14, 20), words(15, 3))
    (expected,) = greedy(engine, [messages], 5, output_logits=True, return_dict_in_generate=True)
    reference = torch.log_softmax(expected.logits.float(), dim=-1)
    response = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = response.choices[0].logprobs.content
    assert [c.token for c in content] == [f"w{t}" for t in expected.token_ids]
    for step, (entry, token) in enumerate(zip(content, expected.token_ids)):
        assert entry.logprob == pytest.approx(reference[step, token].item(), abs=1e-5)
        assert entry.top_logprobs[0].token == entry.token  # greedy took the most likely token
        assert entry.top_logprobs[1].logprob <= entry.logprob
    legacy = client.completions.create(
        model=MODEL, prompt=words(16, 9), max_tokens=3, temperature=0, logprobs=1
    )
    assert len(legacy.choices[0].logprobs.token_logprobs) == 3 and all(
        v <= 0 for v in legacy.choices[0].logprobs.token_logprobs
    )


def test_client_disconnect_aborts_its_request(served, client):
    engine, url = served
    aborted = 'chunk_llama_requests_finished_total{reason="abort"}'
    before = metrics(url).get(aborted, 0)
    # a streaming client reads two chunks, then leaves
    stream = client.chat.completions.create(
        model=MODEL, messages=chat(words(17, 10), words(18, 2)), max_tokens=LONG, temperature=0, stream=True
    )
    for _, _chunk in zip(range(2), stream):
        pass
    assert metrics(url)["chunk_llama_requests_running"] >= 1
    stream.close()
    wait_for(lambda: metrics(url).get(aborted, 0) == before + 1, what="the stream's abort")
    # a non-streaming client times out and leaves while another one is served to the end
    other = chat(words(19, 10), words(20, 2))
    (expected,) = greedy(engine, [other], 40)
    result = {}
    done = threading.Thread(
        target=lambda: result.update(
            r=client.chat.completions.create(model=MODEL, messages=other, max_tokens=40, temperature=0)
        )
    )
    done.start()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            url + "/v1/chat/completions",
            timeout=0.5,
            json={
                "model": MODEL,
                "messages": chat(words(21, 10), "w7"),
                "max_tokens": LONG,
                "temperature": 0,
            },
        )
    done.join(60)
    assert result["r"].choices[0].message.content == expected.text
    wait_for(lambda: metrics(url).get(aborted, 0) == before + 2, what="the non-streaming request's abort")
    wait_for(
        lambda: metrics(url)["chunk_llama_requests_running"] == 0 and not engine.has_unfinished_requests(),
        what="an idle engine",
    )
    assert metrics(url)["chunk_llama_kv_cache_used_bytes"] == 0


BAD_REQUESTS = [
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 1"),
    ({"model": "gpt-4"}, "model", "does not exist"),
    ({"messages": [{"content": "w7"}]}, "messages.0.role", "Field required"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content", "string"),
    ({"messages": []}, "messages", "at least 1"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"temperature": -0.5}, "temperature", "greater than or equal to 0"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop_token_ids": ["w7"]}, "stop_token_ids.0", "valid integer"),  # unknown fields pass: test_server_fields
    ({"stream": True, "logprobs": True}, "logprobs", "not supported with stream"),
    (
        {"messages": [{"role": "user", "content": " ".join(["w7"] * 2100)}], "max_tokens": None},
        None,
        "no room to generate: this model's context is 2048 tokens (Input length of input_ids is 2102",
    ),
    (
        {"messages": [{"role": "user", "content": " ".join(["w7"] * 2045)}]},
        None,
        "prompt of 2047 tokens plus max_new_tokens=4 exceeds the model's max_position_embeddings=2048",
    ),
    ({"n": 9, "temperature": 1}, None, "exceeds max_batch_size=8"),
    ({"n": 2}, "n", "needs temperature > 0"),
    (
        {"messages": [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8"}]},
        "messages",
        "assistant",
    ),
]


def test_bad_requests_get_400_and_the_server_keeps_serving(served, client):
    engine, url = served
    messages = chat(words(22, 15), words(23, 2))
    (expected,) = greedy(engine, [messages], 60)
    errors_before = metrics(url)["chunk_llama_request_errors_total"]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, stream=True
    )
    first = next(iter(stream)).choices[0].delta.content or ""
    for change, param, message in BAD_REQUESTS:
        body = {"model": MODEL, "messages": chat("w9", "w10"), "max_tokens": 4, **change}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, (change, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] is None, error
        assert error["param"] == param and message in error["message"], (change, error)
    malformed = httpx.post(
        url + "/v1/completions",
        content=b"{not json",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert malformed.status_code == 400 and "not valid JSON" in malformed.json()["error"]["message"]
    too_long = httpx.post(
        url + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": words(24, 2000), "max_tokens": 100},
    )
    assert (
        too_long.status_code == 400 and "max_position_embeddings=2048" in too_long.json()["error"]["message"]
    )
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="w7", max_tokens=-3)
    assert raised.value.body["param"] == "max_tokens"
    assert first + "".join(c.choices[0].delta.content or "" for c in stream) == expected.text
    assert metrics(url)["chunk_llama_request_errors_total"] == errors_before + len(BAD_REQUESTS) + 3


def test_metrics_counters_and_gauges_move(served, client):
    engine, url = served
    text = httpx.get(url + "/metrics", timeout=10)
    assert text.headers["content-type"].startswith("text/plain; version=")
    for family, kind in [
        ("requests_total", "counter"),
        ("prompt_tokens_total", "counter"),
        ("prefix_cache_hit_tokens_total", "counter"),
        ("generation_tokens_total", "counter"),
        ("requests_running", "gauge"),
        ("requests_waiting", "gauge"),
        ("kv_cache_used_bytes", "gauge"),
        ("kv_cache_retained_bytes", "gauge"),
    ]:
        assert re.search(rf"^# TYPE chunk_llama_{family} {kind}$", text.text, re.M), family
    before = metrics(url)
    system = words(25, 50)
    stream = client.chat.completions.create(
        model=MODEL, messages=chat(system, "w7"), max_tokens=LONG - 100, temperature=0, stream=True
    )
    next(iter(stream))
    during = metrics(url)
    assert during["chunk_llama_requests_running"] == 1 and during["chunk_llama_kv_cache_used_bytes"] > 0
    stream.close()
    response = client.chat.completions.create(
        model=MODEL, messages=chat(system, "w8 w9"), max_tokens=3, temperature=0
    )
    wait_for(lambda: metrics(url)["chunk_llama_requests_running"] == 0, what="the aborted stream to leave")
    after = metrics(url)
    assert (
        after['chunk_llama_requests_total{endpoint="chat"}']
        == before['chunk_llama_requests_total{endpoint="chat"}'] + 2
    )
    assert (
        after["chunk_llama_prompt_tokens_total"]
        >= before["chunk_llama_prompt_tokens_total"] + response.usage.prompt_tokens + 50
    )
    assert after["chunk_llama_generation_tokens_total"] >= before["chunk_llama_generation_tokens_total"] + 4
    cached = response.usage.prompt_tokens_details.cached_tokens
    assert cached >= 48  # the aborted stream left the system prompt's chunks cached
    assert (
        after["chunk_llama_prefix_cache_hit_tokens_total"]
        >= before["chunk_llama_prefix_cache_hit_tokens_total"] + cached
    )
    assert after["chunk_llama_kv_cache_retained_bytes"] > 0 and after["chunk_llama_kv_cache_used_bytes"] == 0
    assert after["chunk_llama_requests_waiting"] == 0
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                      "queue_time_seconds", "prompt_length_tokens", "generation_length_tokens"):
        name = f"chunk_llama_{histogram}"
        assert re.search(rf"^# TYPE {name} histogram$", text.text, re.M), histogram
        assert after[name + "_count"] > before[name + "_count"], histogram  # moved with these requests
        assert after[f'{name}_bucket{{le="+Inf"}}'] == after[name + "_count"]
    assert after["chunk_llama_prompt_length_tokens_sum"] >= before["chunk_llama_prompt_length_tokens_sum"] + \
        response.usage.prompt_tokens
    assert after["chunk_llama_generation_length_tokens_sum"] >= before["chunk_llama_generation_length_tokens_sum"] + 3


def test_cors_headers_for_allowed_origins():
    model = tiny_llama()
    tokenizer = tiny_tokenizer()
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=2, chunk_size=CHUNK, kv_cache_bytes=1 << 20)
    server = Server(create_app(engine, MODEL, allowed_origins=["http://app.example"]))
    try:
        preflight = httpx.options(server.url + "/v1/completions", timeout=10, headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        listed = httpx.get(server.url + "/v1/models", timeout=10, headers={"Origin": "http://app.example"})
        assert listed.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.get(server.url + "/v1/models", timeout=10, headers={"Origin": "http://elsewhere.example"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        server.stop()


def test_sse_wire_format(served):
    _, url = served
    body = {"model": MODEL, "prompt": "w7 w8", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = "".join(response.iter_text())
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
    assert (
        all(c["object"] == "text_completion" for c in chunks)
        and chunks[-1]["choices"][0]["finish_reason"] == "length"
    )


@pytest.mark.slow
def test_default_model_chat_equals_generate():
    import chunk_llama
    from chunk_llama.server.main import DEFAULT_MODEL_NAME

    model, tokenizer = chunk_llama.load_default_model(torch.float32)
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=4, kv_cache_bytes=64 << 20)
    from chunk_llama.cli import DEFAULT_SYSTEM

    with open(DEFAULT_SYSTEM, encoding="utf-8") as f:
        system = tokenizer.decode(tokenizer(f.read())["input_ids"][:300])
    messages = chat(system, "How many flights left BOS on 2022-01-02?")
    (expected,) = greedy(engine, [messages], 16)
    server = Server(create_app(engine, DEFAULT_MODEL_NAME))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=16, temperature=0
        )
    finally:
        server.stop()
    assert response.choices[0].message.content == expected.text and expected.text
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert response.usage.prompt_tokens_details.cached_tokens > 0  # generate left the prompt's chunks cached
