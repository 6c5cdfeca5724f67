"""The HTTP API under attack, on a real uvicorn server on 127.0.0.1 serving a tiny random Llama:
fuzzed from its own OpenAPI schema (schemathesis), a storm of clients that disconnect while
queued, in prefill and mid-stream, and a short soak (scripts/soak_serve.py runs the long one).
After each: no 5xx, the server alive, and, once idle, no request or K/V left behind. Every wait
is bounded in time; the case and request counts are fixed."""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter

import httpx
from hypothesis import HealthCheck, given, settings
from test_server import MODEL, metrics, wait_for, words
from test_server_guards import BIG, Serving

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import soak_serve  # noqa: E402

FUZZ_CASES = 30  # per operation and generation mode: a bounded run (scripts/soak_serve.py is the long one)


def assert_idle_and_serving(s: Serving) -> None:
    wait_for(lambda: not s.engine.has_unfinished_requests(), seconds=30, what="an idle engine")
    after = metrics(s.url)
    assert after["chunk_llama_requests_running"] == 0 and after["chunk_llama_requests_waiting"] == 0
    assert after["chunk_llama_kv_cache_used_bytes"] == 0
    answer = s.client().completions.create(model=MODEL, prompt="w7 w8", max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens == 3


def test_fuzzed_from_the_openapi_schema_no_5xx():
    """Bodies, headers and queries schemathesis draws from /openapi.json, valid ones (naming the
    served model) and invalid ones: every answer is below 500. A server deadline bounds what a
    valid request with a large max_tokens may run."""
    import schemathesis
    from schemathesis import GenerationMode

    with Serving(max_batch_size=8, request_timeout=2.0) as s:
        schema = schemathesis.openapi.from_dict(s.app.openapi())
        statuses, failures = Counter(), []
        for result in schema.get_all_operations():
            operation = result.ok()
            has_input = operation.method.upper() == "POST"  # the GET routes take nothing to break
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_input else (GenerationMode.POSITIVE,):
                @settings(max_examples=FUZZ_CASES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(operation.as_strategy(generation_mode=mode))
                def send(case):
                    if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                        case.body["model"] = MODEL  # reach past the model check into the request
                    response = case.call(base_url=s.url, timeout=30)
                    statuses[f"{operation.method.upper()} {response.status_code // 100}xx"] += 1
                    if response.status_code >= 500:
                        failures.append((operation.label, mode.value, response.status_code, case.body,
                                         response.text[:300]))

                send()
        assert not failures, failures[:3]
        print("fuzzed:", dict(statuses))
        assert sum(statuses.values()) >= FUZZ_CASES * 2 and statuses["POST 2xx"] > 0  # some reached the engine
        assert_idle_and_serving(s)


def test_a_disconnect_storm_leaves_nothing_behind():
    """Clients that leave while queued (their heads wait behind a full batch), in prefill (a long
    prompt, gone at once) and mid-stream, some while the server is busiest."""
    with Serving(max_batch_size=2) as s:
        holders = [httpx.Client(base_url=s.url, timeout=60) for _ in range(2)]
        streams = [h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": words(50 + i, 5),
                                                             "max_tokens": BIG, "temperature": 0, "stream": True})
                   for i, h in enumerate(holders)]
        opened = [stream.__enter__() for stream in streams]  # the batch is full while they run
        try:
            wait_for(lambda: metrics(s.url)["chunk_llama_requests_running"] == 2, what="two running")

            answered_while_queued = []  # a thread's assertion would not fail the test: collect instead

            def leave_while_queued(i):
                try:
                    answer = httpx.post(s.url + "/v1/completions", timeout=0.5,
                                        json={"model": MODEL, "prompt": words(60 + i, 20), "max_tokens": 20})
                    answered_while_queued.append(answer.status_code)
                except httpx.TimeoutException:
                    pass

            def leave_in_prefill(i):
                try:
                    httpx.post(s.url + "/v1/completions", timeout=0.05,
                               json={"model": MODEL, "prompt": words(70 + i, 3000), "max_tokens": 5})
                except httpx.TimeoutException:
                    pass

            def leave_mid_stream(i):
                body = {"model": MODEL, "prompt": words(80 + i, 10), "max_tokens": 50, "stream": True}
                try:
                    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=2) as response:
                        next(response.iter_lines())
                except httpx.TimeoutException:  # still queued behind the full batch at 2 s
                    pass

            clients = [threading.Thread(target=f, args=(i,)) for i in range(6)
                       for f in (leave_while_queued, leave_in_prefill, leave_mid_stream)]
            for t in clients:
                t.start()
            for t in clients:
                t.join(60)
            assert not any(t.is_alive() for t in clients)
            assert not answered_while_queued  # the batch was full: they could only wait, then leave
        finally:
            for stream, holder in zip(streams, holders):
                stream.__exit__(None, None, None)
                holder.close()
        assert opened[0].status_code == 200
        assert_idle_and_serving(s)
        after = metrics(s.url)
        finished = sum(v for k, v in after.items() if k.startswith("chunk_llama_requests_finished_total"))
        accepted = sum(v for k, v in after.items() if k.startswith("chunk_llama_requests_total"))
        assert finished == accepted  # each accepted request ended once (aborted or not)


def test_a_short_http_soak_is_consistent():
    """scripts/soak_serve.py's traffic, shortened: random sizes and options, drops, invalid bodies."""
    with Serving(max_batch_size=8) as s:
        with httpx.Client(base_url=s.url) as client:
            before = soak_serve.metrics(client)
        tally = soak_serve.drive(s.url, MODEL, 150, concurrency=8, seed=1)
        figures, problems = soak_serve.check(s.url, tally, before)
        assert not problems, (problems, figures)
        assert figures["accepted"] > 100 and figures["aborted_samples"] > 0 and figures["errors"] > 0
