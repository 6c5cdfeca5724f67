"""`chunk-llama serve` as a user runs it: a subprocess on a local model folder that answers
over HTTP, steps the engine in its main thread (see server/loop.py) and ends cleanly on
SIGTERM; a port in use ends it with an error."""

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers import tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(max_position_embeddings=256).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(folder, port):
    return subprocess.Popen([sys.executable, "-m", "chunk_llama.cli", "serve", "--model", str(folder), "--port",
                             str(port), "--kv-cache-bytes", str(8 << 20)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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


def test_serves_then_ends_cleanly_on_sigterm(model_folder):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(model_folder, port)
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
