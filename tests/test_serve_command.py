"""`chunk-llama serve` as a user runs it: a subprocess on a local model folder that answers
over HTTP, steps the engine in its main thread (see server/loop.py) and ends cleanly on
SIGTERM, draining what runs; a second SIGINT ends it at once; a port in use ends it with
an error."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from helpers import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    model = tiny_llama(max_position_embeddings=4096)  # room for streams that outlast a signal
    with torch.no_grad():  # EOS (id 5) is never the likeliest token: requests run to max_tokens
        model.lm_head.weight[5].zero_()
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(folder, port, *flags, **popen_kwargs):
    return subprocess.Popen([sys.executable, "-m", "chunk_llama.cli", "serve", "--model", str(folder), "--port",
                             str(port), "--kv-cache-bytes", str(8 << 20), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen_kwargs)


def wait_healthy(proc, url, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the server did not become healthy:\n{proc.communicate()[0][-3000:]}")


def ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sigint", ["default", "ignored"])
def test_serves_then_ends_cleanly_on_sigterm(model_folder, sigint):
    """Also when started in the background from a shell, which has SIGINT ignored: SIGTERM
    must not rely on SIGINT."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(model_folder, port, preexec_fn=ignore_sigint if sigint == "ignored" else None)
    try:
        wait_healthy(proc, url)
        body = {"model": model_folder.name, "prompt": "w7 w8 w9", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 4 and answer["choices"][0]["text"]
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert f"serving {model_folder.name!r} on {url}/v1" in output


def test_a_port_in_use_is_an_error(model_folder):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = start(model_folder, port)
        output = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and f"the HTTP server did not start on 127.0.0.1:{port}" in output, output[-3000:]


def test_server_options_from_flags_and_environment(model_folder, tmp_path):
    """--served-model-name, --max-model-len, --chat-template, --allowed-origins, --stats-interval,
    --kv-dtype from the command line and the log level from CHUNK_LLAMA_LOG_LEVEL; one log format
    for everything."""
    import os

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}w9 {{ m['content'] }} {% endfor %}w8")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "chunk_llama.cli", "serve", "--model", str(model_folder), "--port", str(port),
         "--kv-cache-bytes", str(8 << 20), "--served-model-name", "alpha", "beta", "--max-model-len", "64",
         "--chat-template", str(template), "--allowed-origins", "*", "--stats-interval", "0.01",
         "--kv-dtype", "bfloat16"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "CHUNK_LLAMA_LOG_LEVEL": "info"})
    try:
        wait_healthy(proc, url)
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == ["alpha"]
        chat = httpx.post(url + "/v1/chat/completions", timeout=60, headers={"Origin": "http://x.example"}, json={
            "model": "beta", "messages": [{"role": "user", "content": "w7 w7"}], "max_tokens": 30, "temperature": 0})
        assert chat.status_code == 200 and chat.headers["access-control-allow-origin"] == "*"
        assert chat.json()["usage"]["prompt_tokens"] == 4  # w9 w7 w7 w8: the template given
        too_long = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "alpha", "prompt": " ".join(["w7"] * 40), "max_tokens": 30})
        assert too_long.status_code == 400 and "exceeds max_model_len=64" in too_long.json()["error"]["message"]
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    import re

    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "
    assert re.search(stamp + r"INFO chunk_llama\.server: chunk-llama: cpu .*, float32, weights [\d.]+ GiB; .*KV pool [\d.]+ GiB, "
                     r"bfloat16 \(", output, re.M), output[-3000:]
    assert re.search(stamp + r"INFO chunk_llama\.server: engine: [\d.]+ tokens/s generated, \d+ running, \d+ "
                     r"waiting, KV [\d.]+% used", output, re.M), output[-3000:]
    assert re.search(stamp + r"INFO uvicorn", output, re.M), output[-3000:]


def test_engine_flags_reach_the_server_engine():
    from chunk_llama.cli import build_parser
    from chunk_llama.settings import EngineArgs, from_namespace

    args = build_parser().parse_args(["serve", "--max-prefill-tokens", "256", "--no-prefix-caching",
                                      "--max-model-len", "128", "--revision", "abc", "--trust-remote-code"])
    engine_kwargs = from_namespace(EngineArgs, args).engine_kwargs()
    assert engine_kwargs["max_prefill_tokens"] == 256 and engine_kwargs["retain_prefixes"] is False
    assert engine_kwargs["max_model_len"] == 128
    engine_args = from_namespace(EngineArgs, args)
    assert engine_args.revision == "abc" and engine_args.trust_remote_code is True


def test_sigterm_drains_running_requests_then_exits_0(model_folder):
    """A stream running when SIGTERM comes runs to its end; a request sent during the drain gets
    503; then the process exits 0 by itself."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(model_folder, port, "--drain-timeout", "60")
    try:
        wait_healthy(proc, url)
        body = {"model": model_folder.name, "prompt": "w7 w8 w9", "max_tokens": 150, "temperature": 0,
                "stream": True}
        events, first = [], threading.Event()

        def read_stream():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        first.set()

        reader = threading.Thread(target=read_stream)
        reader.start()
        assert first.wait(60)
        proc.send_signal(signal.SIGTERM)
        seen_at_signal = len(events)
        deadline = time.monotonic() + 30
        while (health := httpx.get(url + "/health", timeout=5)).status_code != 503:
            assert time.monotonic() < deadline, "the server did not start draining"
            time.sleep(0.05)
        assert health.json()["status"] == "draining"
        refused = httpx.post(url + "/v1/completions", timeout=10, json={**body, "stream": False})
        assert refused.status_code == 503 and refused.headers["retry-after"]
        reader.join(60)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and len(events) > seen_at_signal
    assert "SIGTERM: draining" in output and "drained: no request left" in output, output[-3000:]


def test_a_second_sigint_exits_at_once(model_folder):
    """The first SIGINT drains (four long requests queued one at a time keep it draining); a
    second one, sent once the server says it drains, ends it at once with 130."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(model_folder, port, "--drain-timeout", "600", "--max-batch-size", "1", "--log-level", "info")
    lines, draining = [], threading.Event()

    def read_output():
        for line in proc.stdout:
            lines.append(line)
            if "SIGINT: draining" in line:
                draining.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    body = {"model": model_folder.name, "prompt": "w7", "max_tokens": 240, "temperature": 0}
    clients = ThreadPoolExecutor(4)
    try:
        wait_healthy(proc, url)
        pending = [clients.submit(httpx.post, url + "/v1/completions", json=body, timeout=60) for _ in range(4)]
        deadline = time.monotonic() + 30
        while not re.search(r"^chunk_llama_requests_running(\{.*\})? 1", httpx.get(url + "/metrics", timeout=5).text,
                            re.M):
            assert time.monotonic() < deadline, "no request started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        assert draining.wait(30), "the first SIGINT did not start a drain:\n" + "".join(lines[-30:])
        assert proc.poll() is None, "the drain ended before the second SIGINT: the requests were too short"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        clients.shutdown(wait=False, cancel_futures=True)
    output = "".join(lines)
    assert proc.returncode == 130 and "second interrupt: exiting now" in output, output[-3000:]
    assert any(isinstance(f.exception(timeout=60), httpx.HTTPError) for f in pending), "no request was cut"
