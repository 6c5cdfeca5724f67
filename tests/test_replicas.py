"""`chunk-llama serve --data-parallel 2`: two engine workers behind sglang-router on
127.0.0.1, as a user runs it (a subprocess), against `engine.generate` on the same model."""

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from helpers import tiny_llama, tiny_tokenizer
from lora_adapters import SPECS, make_adapter
from transformers import GenerationConfig

pytest.importorskip("sglang_router", reason="the router of --data-parallel (pip install sglang-router)")

from chunk_llama import ChunkLlamaEngine  # noqa: E402
from chunk_llama.loading import load_model  # noqa: E402

SYSTEM_WORDS = 150
NUM_SYSTEMS = 3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-dp")
    tiny_llama(max_position_embeddings=512, num_heads=4, num_kv_heads=2, head_dim=64).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompts():
    """Three system prompts of 150 words, 16 questions in all, interleaved (A1, B1, C1, A2, ...:
    with two prompts, strict alternation would let round-robin over two workers keep each
    prompt on one worker by accident)."""
    rng = random.Random(0)
    systems = [" ".join(f"w{rng.randrange(6, 96)}" for _ in range(SYSTEM_WORDS)) for _ in range(NUM_SYSTEMS)]
    questions = [" ".join(f"w{rng.randrange(6, 96)}" for _ in range(5)) for _ in range(16)]
    return [systems[i % NUM_SYSTEMS] + " " + q for i, q in enumerate(questions)]


@pytest.fixture(scope="module")
def expected(model_folder, prompts):
    model, tokenizer = load_model(str(model_folder), device="cpu")
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=8)
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False)
    return [out.text for out in engine.generate(prompts, config)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replicas:
    """The launcher as a subprocess, stopped (SIGTERM) at the end."""

    def __init__(self, model: str, name: str, policy: str, *extra: str, env: dict | None = None,
                 key: str | None = None):
        self.model = name
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chunk_llama.cli", "serve", "--model", model, "--data-parallel", "2",
             "--port", str(self.port), "--router-policy", policy, "--stats-interval", "0", "--log-level", "warning",
             *(extra or ("--kv-cache-bytes", str(16 << 20)))],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            self.stop()
            raise AssertionError(f"the replicas did not start:\n{self.proc.communicate()[0][-3000:]}")
        self.children = psutil.Process(self.proc.pid).children(recursive=True)

    def complete(self, prompt: str) -> httpx.Response:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        return httpx.post(self.url + "/v1/completions", json=body, headers=self.headers, timeout=120)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.communicate(timeout=120)[0]


def worker_metric(worker: str, name: str) -> float:
    """A counter of one worker, read from its own /metrics (labelled with its id)."""
    port = int(worker.rsplit(":", 1)[1])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    match = re.search(rf'^{name}{{worker="{re.escape(worker)}"}} (\S+)$', text, re.M)
    assert match, f"{name} of {worker} not in its /metrics"
    return float(match.group(1))


def serve_all(replicas: Replicas, prompts: list[str]) -> list[httpx.Response]:
    """The prompts as they arrive (interleaved), two clients at a time."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(replicas.complete, prompts))


def test_cache_aware_routing_computes_each_system_prompt_on_one_worker(model_folder, prompts, expected):
    computed = {}
    for policy in ("cache_aware", "round_robin"):
        replicas = Replicas(str(model_folder), model_folder.name, policy)
        try:
            answers = serve_all(replicas, prompts)
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers if a.status_code != 200]
            assert [a.json()["choices"][0]["text"] for a in answers] == expected
            workers = sorted({a.headers["X-Chunk-Llama-Worker"] for a in answers})
            computed[policy] = sum(worker_metric(w, "chunk_llama_prefill_tokens_computed_total") for w in workers)
            if policy == "cache_aware":
                # each system prompt on one worker: its 150 tokens once, then each question's own 5 (and
                # what its partial last chunk recomputes)
                assert len(workers) == 2 and computed[policy] <= NUM_SYSTEMS * SYSTEM_WORDS + 16 * 5 + 3 * 64
        finally:
            output = replicas.stop()
        assert replicas.proc.returncode == 0, output[-2000:]
        assert not [c for c in replicas.children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert computed["cache_aware"] < computed["round_robin"], computed


def test_a_worker_killed_mid_run_and_the_rest_serves(model_folder, prompts, expected):
    """With an API key and a body limit, which each worker applies behind the router (the key
    in the workers' environment, not on their command lines)."""
    replicas = Replicas(str(model_folder), model_folder.name, "cache_aware", "--kv-cache-bytes", str(16 << 20),
                        "--max-request-bytes", "4000", env={"CHUNK_LLAMA_API_KEY": "k-replicas"}, key="k-replicas")
    try:
        assert all("k-replicas" not in " ".join(c.cmdline()) for c in replicas.children)
        body = {"model": replicas.model, "prompt": prompts[0], "max_tokens": 2}
        keyless = httpx.post(replicas.url + "/v1/completions", json=body, timeout=60)
        assert keyless.status_code == 401, keyless.text
        wrong = httpx.post(replicas.url + "/v1/completions", json=body, timeout=60,
                           headers={"Authorization": "Bearer k-other"})
        assert wrong.status_code == 401, wrong.text
        too_big = httpx.post(replicas.url + "/v1/completions", json={**body, "prompt": "w7 " * 2000},
                             headers=replicas.headers, timeout=60)
        assert too_big.status_code == 413, too_big.text
        assert httpx.get(replicas.url + "/health", timeout=10).status_code == 200
        first = replicas.complete(prompts[0])
        assert first.status_code == 200
        victim = first.headers["X-Chunk-Llama-Worker"]
        port = int(victim.rsplit(":", 1)[1])
        process = next(c for c in replicas.children
                       if any(conn.laddr.port == port for conn in c.net_connections(kind="tcp")))
        with ThreadPoolExecutor(4) as pool:
            in_flight = [pool.submit(replicas.complete, p) for p in prompts[:4]]
            process.kill()
            for future in in_flight:  # each ends, answered or refused, none hangs
                assert future.result(timeout=120).status_code in (200, 500, 502, 503, 504)
        time.sleep(5)  # the router's health checks (every 2 s) drop the dead worker
        later = [replicas.complete(p) for p in prompts[4:8]]
        assert all(a.status_code == 200 for a in later)
        assert {a.headers["X-Chunk-Llama-Worker"] for a in later} != {victim}
        assert [a.json()["choices"][0]["text"] for a in later] == expected[4:8]
    finally:
        replicas.stop()
    assert not [c for c in replicas.children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_each_worker_serves_the_lora_modules_and_the_router_matches_text_only(model_folder, prompts, tmp_path):
    """`--lora-modules` with `--data-parallel 2`: every worker's command line carries the
    adapters, and a request's `model` selects its adapter behind the router (the answers
    `engine.generate` gives under it). sglang-router 0.3's cache-aware policy keeps one
    radix tree per worker model, and these workers are one model: it matches the request's
    text, not its `model` (docs/adapters.md). So the same prompt under the base and two
    adapters goes to the worker that computed it first, whose prefix tree keeps their K/V
    apart: that worker computes the prompt once per adapter."""
    pytest.importorskip("peft")
    model, tokenizer = load_model(str(model_folder), device="cpu")
    folders = {name: make_adapter(model, str(tmp_path / name), seed=i, scale=3.0, **SPECS[name])
               for i, name in enumerate("ab")}
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=4, lora_modules=folders)
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = {name: engine.generate([prompts[0]], config, adapter=name)[0].text for name in ("a", "b", None)}
    assert len(set(expected.values())) == 3
    replicas = Replicas(str(model_folder), model_folder.name, "cache_aware", "--kv-cache-bytes", str(16 << 20),
                        "--lora-modules", *(f"{name}={folder}" for name, folder in folders.items()))
    try:
        workers = [c.cmdline() for c in replicas.children if "serve" in c.cmdline() and "--port" in c.cmdline()]
        assert len(workers) == 2 and all(f"a={folders['a']}" in argv and f"b={folders['b']}" in argv
                                         for argv in workers)
        answers = {}
        for name in ("a", "b", None):
            replicas.model = name or model_folder.name
            answers[name] = replicas.complete(prompts[0])
            assert answers[name].status_code == 200, answers[name].text
            assert answers[name].json()["choices"][0]["text"] == expected[name], name
        routed = {a.headers["X-Chunk-Llama-Worker"] for a in answers.values()}
        assert len(routed) == 1
        prompt_tokens = len(tokenizer(prompts[0])["input_ids"])
        assert worker_metric(routed.pop(), "chunk_llama_prefill_tokens_computed_total") >= 3 * prompt_tokens
    finally:
        replicas.stop()


def test_without_the_router_installed_it_says_so(monkeypatch):
    """A missing sglang-router is a UsageError naming it (the command prints it as one line
    and exits with code 2, as tests/test_settings.py checks for such errors)."""
    from chunk_llama.errors import UsageError
    from chunk_llama.server import replicas
    from chunk_llama.server.options import ServeArgs
    from chunk_llama.settings import EngineArgs

    monkeypatch.setattr(replicas, "router_installed", lambda: False)
    with pytest.raises(UsageError, match="need sglang-router: pip install sglang-router"):
        replicas.serve_replicas(EngineArgs(), ServeArgs(data_parallel=2))
