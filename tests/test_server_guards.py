"""The server's guards (`DeployArgs`) on a real uvicorn server on 127.0.0.1 serving a tiny random
Llama: API keys, request limits, strict JSON, read and keep-alive timeouts, the bounded queue,
deadlines and the drain. Each refusal is a clear 4xx (or 503) with OpenAI's error body, and the
server goes on serving. Every wait is bounded in time."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from helpers import tiny_llama, tiny_tokenizer
from test_server import CHAT_TEMPLATE, MODEL, Server, metrics, wait_for, words
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.server import create_app
from chunk_llama.server.options import DeployArgs

REJECTED = 'chunk_llama_requests_rejected_total{{reason="{}"}}'
BIG = 60000  # max_tokens of a request that only a deadline, a drain or its client ends


def make_engine(max_batch_size=4):
    """A tiny Llama that never picks EOS (its LM-head row is zeroed), so requests run to max_tokens."""
    model = tiny_llama(max_position_embeddings=65536)
    with torch.no_grad():
        model.lm_head.weight[5].zero_()
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return ChunkLlamaEngine(model, tokenizer, max_batch_size=max_batch_size, chunk_size=16, kv_cache_bytes=32 << 20)


class Serving:
    """An engine, its app and a server, stopped on exit; the engine is idle at the end."""

    def __init__(self, max_batch_size=4, **deploy):
        self.engine = make_engine(max_batch_size)
        self.deploy = DeployArgs(**deploy)
        self.app = create_app(self.engine, MODEL, deploy=self.deploy)
        self.server = Server(self.app, self.deploy)
        self.url = self.server.url

    def client(self, key="unused", **kwargs):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **{"timeout": 60, **kwargs})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.stop()
        wait_for(lambda: not self.engine.has_unfinished_requests(), what="an idle engine")


def post(url, path, body, **kwargs):
    return httpx.post(url + path, json=body, timeout=30, **kwargs)


def completion(prompt="w7 w8 w9", **fields):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields}


def test_api_keys_guard_v1_and_leave_health_open(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# deploy keys\n\nfile-key\n")
    with Serving(api_key=["flag-key"], api_key_file=str(key_file)) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "flag-key"},
                        {"Authorization": "Basic flag-key"}):
            refused = httpx.get(s.url + "/v1/models", headers=headers, timeout=10)
            assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
            assert refused.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model=MODEL, prompt="w7", max_tokens=2)
        for key in ("flag-key", "file-key"):
            answer = s.client(key).completions.create(model=MODEL, prompt="w7 w8", max_tokens=3, temperature=0)
            assert answer.usage.completion_tokens == 3
        assert httpx.get(s.url + "/health", timeout=10).json() == {"status": "ok"}
        assert metrics(s.url)[REJECTED.format("unauthorized")] == 5
    with Serving(api_key=["k"], metrics_need_key=True) as s:
        assert httpx.get(s.url + "/metrics", timeout=10).status_code == 401
        assert httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer k"}, timeout=10).status_code == 200
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


def test_keys_from_the_environment_and_never_in_help(monkeypatch, capsys):
    from chunk_llama.cli import build_parser
    from chunk_llama.settings import from_namespace

    monkeypatch.setenv("CHUNK_LLAMA_API_KEY", "env-one,env-two")
    parser = build_parser()
    args = parser.parse_args(["serve", "--api-key", "flag", "--max-waiting-requests", "7"])
    deploy = from_namespace(DeployArgs, args)
    assert deploy.keys() == ["env-one", "env-two", "flag"] and deploy.max_waiting_requests == 7
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "env-one" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="max_waiting_requests must be a positive int"):
        DeployArgs(max_waiting_requests=0)


def test_non_loopback_bind_without_a_key_warns(caplog):
    from chunk_llama.server.main import is_loopback, warn_if_exposed

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    with caplog.at_level(logging.WARNING, logger="chunk_llama.server"):
        warn_if_exposed("127.0.0.1", [])
        warn_if_exposed("0.0.0.0", ["k"])
        assert not caplog.records
        warn_if_exposed("0.0.0.0", [])
    assert "without an API key" in caplog.text


def test_limits_are_clear_4xx_and_the_server_goes_on():
    with Serving(max_request_bytes=4096, max_messages=3, max_prompts=2) as s:
        url, chat_path, done = s.url, "/v1/chat/completions", "/v1/completions"
        stream = s.client().completions.create(model=MODEL, prompt=words(1, 20), max_tokens=40, temperature=0,
                                               stream=True)
        first = next(iter(stream)).choices[0].text
        cases = [
            (post(url, done, completion(words(2, 2000))), 413, None, "too large"),
            (post(url, chat_path, {"model": MODEL, "messages": [{"role": "user", "content": "w7"}] * 4}), 400,
             "messages", "4 messages, more than this server takes in one request (3)"),
            (post(url, done, completion(["w7", "w8", "w9"])), 400, "prompt", "3 prompts"),
            (post(url, done, completion(max_tokens=10**12)), 400, None, "exceeds the model's"),
            (post(url, done, completion(n=200, temperature=1)), 400, "n", "less than or equal to 128"),
            (post(url, done, completion(stop=["w1"] * 17)), 400, "stop", "at most 16"),
            (post(url, done, completion(logprobs=6)), 400, "logprobs", "less than or equal to 5"),
            (post(url, chat_path, {"model": MODEL, "messages": [{"role": "user", "content": "w7"}],
                                   "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs", "20"),
        ]
        raw = {
            b'{"model": "tiny-llama", "prompt": "w7", "temperature": NaN}': "NaN",
            b'{"model": "tiny-llama", "prompt": "w7", "max_tokens": 4, "seed": -Infinity}': "-Infinity",
            b'{"model": "tiny-llama", "prompt": "w7 \xff\xfe"}': "not valid UTF-8",
            b'[' * 1500 + b']' * 1500: "nested too deeply",
            b'{"model": "tiny-llama", "prompt": ': "not valid JSON",
        }
        for body, message in raw.items():
            response = httpx.post(url + done, content=body, headers={"content-type": "application/json"}, timeout=30)
            cases.append((response, 400, None, message))
        for response, status, param, message in cases:
            assert response.status_code == status, (message, response.text)
            error = response.json()["error"]
            assert message in error["message"] and error["param"] == param, (message, error)
        rest = "".join(c.choices[0].text for c in stream)
        (expected,) = s.engine.generate([words(1, 20)], GenerationConfig(max_new_tokens=40, do_sample=False))
        assert first + rest == expected.text
        assert metrics(url)["chunk_llama_request_errors_total"] == len(cases)


def test_a_slow_client_cannot_hold_a_connection():
    with Serving(header_timeout=0.5, keep_alive_timeout=0.5) as s:
        def closed_after(send: bytes) -> float:
            with socket.create_connection(("127.0.0.1", s.server.port), timeout=10) as sock:
                start = time.monotonic()
                sock.sendall(send)
                while sock.recv(4096):  # a response to a finished request, then the close
                    pass
                return time.monotonic() - start

        assert closed_after(b"") < 3  # connected, sent nothing
        assert closed_after(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") < 3  # half a head
        assert closed_after(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                            b"Content-Type: application/json\r\n\r\n{\"mod") < 3  # half a body
        body = json.dumps(completion()).encode()
        idle = closed_after(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert idle < 5  # answered, then idle past the keep-alive timeout
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


def test_a_full_queue_gets_429_and_health_stays_quick():
    with Serving(max_batch_size=2, max_waiting_requests=2) as s:
        client = s.client()
        streams = []

        def start(i):
            stream = client.completions.create(model=MODEL, prompt=words(10 + i, 5), max_tokens=BIG,
                                               temperature=0, stream=True)
            streams.append(stream)

        for i in range(2):
            start(i)
        wait_for(lambda: metrics(s.url)["chunk_llama_requests_running"] == 2, what="two running")
        threads = [threading.Thread(target=start, args=(i,)) for i in (2, 3)]  # queued: their heads wait
        for t in threads:
            t.start()
        wait_for(lambda: metrics(s.url)["chunk_llama_requests_waiting"] == 2, what="two waiting")
        refused = httpx.post(s.url + "/v1/completions", json=completion(), timeout=30)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_overloaded"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="w7", max_tokens=2)
        latencies = []
        for _ in range(10):
            start_time = time.monotonic()
            assert httpx.get(s.url + "/health", timeout=10).status_code == 200
            latencies.append(time.monotonic() - start_time)
        assert max(latencies) < 2.0, latencies  # the event loop is not blocked by the engine
        for t in threads:
            t.join(30)
        for stream in streams:  # the clients leave: running and queued requests are aborted
            stream.close()
        wait_for(lambda: not s.engine.has_unfinished_requests(), what="an idle engine")
        after = metrics(s.url)
        assert after["chunk_llama_requests_waiting"] == 0 and after["chunk_llama_kv_cache_used_bytes"] == 0
        ok = client.completions.create(model=MODEL, prompt="w7", max_tokens=2, temperature=0)
        assert ok.usage.completion_tokens == 2
        assert metrics(s.url)[REJECTED.format("overloaded")] == 2


def test_deadlines_end_requests_with_their_partial_output():
    with Serving(max_batch_size=1, request_timeout=1.5) as s:
        start = time.monotonic()
        answer = s.client().completions.create(model=MODEL, prompt=words(20, 5), max_tokens=BIG,
                                               temperature=0)
        assert answer.choices[0].finish_reason == "length" and 0 < answer.usage.completion_tokens < BIG
        assert time.monotonic() - start < 10
    with Serving(max_batch_size=1) as s:
        # the client's own timeout (x-stainless-read-timeout) ends a request; a queued request whose
        # deadline passes before it runs ends with nothing
        results = {}
        runner = threading.Thread(target=lambda: results.update(first=s.client(timeout=6).completions.create(
            model=MODEL, prompt=words(21, 5), max_tokens=BIG, temperature=0)))
        runner.start()
        wait_for(lambda: metrics(s.url)["chunk_llama_requests_running"] == 1, what="the first to run")
        queued = s.client(timeout=2).completions.create(model=MODEL, prompt=words(22, 5), max_tokens=5)
        runner.join(30)
        assert queued.choices[0].finish_reason == "length" and queued.usage.completion_tokens == 0
        assert results["first"].choices[0].finish_reason == "length"
        wait_for(lambda: not s.engine.has_unfinished_requests(), what="an idle engine")
        assert metrics(s.url)["chunk_llama_kv_cache_used_bytes"] == 0


def test_engine_deadline_ends_a_request_and_frees_its_chunks():
    engine = make_engine()
    request_id = engine.add_request(words(30, 40), GenerationConfig(max_new_tokens=BIG, do_sample=False),
                                    deadline=time.perf_counter() + 0.3)
    finished = []
    while engine.has_unfinished_requests():
        finished += [d for d in engine.step() if d.finished]
    (delta,) = finished
    assert delta.request_id == request_id and delta.finish_reason == "length"
    assert 0 < len(delta.output.token_ids) < BIG and delta.output.text
    assert engine.stats["chunks_in_use"] == engine.stats["retained_chunks"]  # nothing live is left
    with pytest.raises(TypeError, match="deadline"):
        engine.add_request("w7", deadline="soon")


def test_drain_finishes_running_requests_and_refuses_new_ones():
    with Serving() as s:
        loop = s.app.state.loop
        stream = s.client().completions.create(model=MODEL, prompt=words(40, 5), max_tokens=300, temperature=0,
                                               stream=True)
        pieces = [next(iter(stream)).choices[0].text]
        loop.drain(timeout=60)
        health = httpx.get(s.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        refused = httpx.post(s.url + "/v1/completions", json=completion(), timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "shutting_down"
        chunks = list(stream)
        pieces += [c.choices[0].text for c in chunks]
        assert chunks[-1].choices[0].finish_reason == "length"
        (expected,) = s.engine.generate([words(40, 5)], GenerationConfig(max_new_tokens=300, do_sample=False))
        assert "".join(pieces) == expected.text
        wait_for(lambda: not loop.alive, what="the loop to end once drained")
        assert metrics(s.url)[REJECTED.format("draining")] == 1
    with Serving() as s:  # past the drain timeout, what still runs is aborted with its partial output
        loop = s.app.state.loop
        stream = s.client().completions.create(model=MODEL, prompt=words(41, 5), max_tokens=BIG,
                                               temperature=0, stream=True)
        next(iter(stream))
        loop.drain(timeout=0.5)
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason == "abort"
        wait_for(lambda: not loop.alive, what="the loop to end")
        assert metrics(s.url)["chunk_llama_kv_cache_used_bytes"] == 0
