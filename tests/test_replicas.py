"""`chunk-llama serve --data-parallel 2`: two engine workers behind sglang-router (one per
model, behind the front) on 127.0.0.1, as a user runs it (a subprocess), against
`engine.generate` on the same model; the official `openai` client where it matters."""

import contextlib
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
                # what its partial last chunk recomputes). Which worker a new system prompt goes to is the
                # router's choice on a cache miss (by load: some runs put all three on one worker), so the
                # test asserts each prompt's requests stay on one, not that both workers were used.
                by_system = [{a.headers["X-Chunk-Llama-Worker"] for a in answers[k::NUM_SYSTEMS]}
                             for k in range(NUM_SYSTEMS)]
                assert all(len(w) == 1 for w in by_system), by_system
                assert computed[policy] <= NUM_SYSTEMS * SYSTEM_WORDS + 16 * 5 + 3 * 64, computed
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
        load = httpx.post(replicas.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"},
                          timeout=60)
        assert load.status_code == 401, load.text  # every worker checks the key of a load too
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


@pytest.fixture(scope="module")
def adapters(model_folder, prompts, tmp_path_factory):
    """Adapters a and b (served from the start) and c (loaded later), and what
    `engine.generate` answers to `prompts[0]` under each and the base."""
    pytest.importorskip("peft")
    folder = tmp_path_factory.mktemp("adapters")
    model, tokenizer = load_model(str(model_folder), device="cpu")
    folders = {name: make_adapter(model, str(folder / name), seed=i, scale=3.0, **SPECS[name])
               for i, name in enumerate("abc")}
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=4, lora_modules=folders)
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = {name: engine.generate([prompts[0]], config, adapter=name)[0].text for name in ("a", "b", "c", None)}
    assert len(set(expected.values())) == 4
    return folders, expected


@pytest.fixture(scope="module")
def lora_replicas(model_folder, adapters, tmp_path_factory):
    """Two workers serving adapters a and b, routed by model (the routers' metrics on a known
    port; a chat template, for chat and the Responses API)."""
    folders, _ = adapters
    metrics_port = free_port()
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    replicas = Replicas(str(model_folder), model_folder.name, "cache_aware", "--kv-cache-bytes", str(16 << 20),
                        "--router-metrics-port", str(metrics_port), "--chat-template", str(template),
                        "--lora-modules", *(f"{name}={folders[name]}" for name in "ab"))
    replicas.metrics_port = metrics_port
    yield replicas
    output = replicas.stop()
    assert replicas.proc.returncode == 0, output[-2000:]
    assert not [c for c in replicas.children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def served_by(replicas: Replicas) -> dict[str, list[str]]:
    """Each local worker's /v1/models, asked of the worker itself: worker id -> model ids."""
    found = {}
    for child in replicas.children:
        argv = child.cmdline()
        if "serve" in argv and "--worker-id" in argv:
            port = argv[argv.index("--port") + 1]
            listing = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
            found[argv[argv.index("--worker-id") + 1]] = [m["id"] for m in listing]
    return found


def test_requests_are_routed_by_model_not_by_text_alone(lora_replicas, adapters, prompts):
    """`--lora-modules` with `--data-parallel 2`: both workers serve the adapters, a request's
    `model` selects its adapter (the answers `engine.generate` gives under it) and its router:
    each model has a cache-aware tree of its own, since a worker's prefix cache keeps each
    adapter's K/V apart. The same long system prompt under a and under b: repeated under a,
    it stays on a's worker; under b, it goes where b's own requests lead (here, away from
    a's worker), which one router for all models (text alone) would not do."""
    import openai

    folders, expected = adapters
    replicas, base = lora_replicas, lora_replicas.model
    assert {tuple(models) for models in served_by(replicas).values()} == {(base, "a", "b")}
    client = openai.OpenAI(base_url=replicas.url + "/v1", api_key="none", max_retries=0)
    listed = {m.id: m for m in client.models.list().data}
    assert list(listed) == [base, "a", "b"] and listed["a"].parent == base and listed["a"].root == folders["a"]

    def ask(model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, str]:
        raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                          temperature=0)
        return raw.headers["X-Chunk-Llama-Worker"], raw.parse().choices[0].text

    for name in ("a", "b", None):
        assert ask(name or base, prompts[0])[1] == expected[name], name
    system = prompts[4].rsplit(" ", 5)[0]  # a system prompt of 150 words no request has sent yet
    on_a = {ask("a", f"{system} w{i} w{i + 1}", 1)[0] for i in range(10, 13)}
    assert len(on_a) == 1, on_a  # under a, the system prompt stays where it was computed
    worker_a = on_a.pop()
    # b's router has seen none of it. A request its tree does not match goes to the least
    # loaded worker (while idle, always the same one): see where an unrelated prompt under b
    # goes; if that is a's worker, a stream held there under b makes it the busier, so the
    # system prompt under b goes to the other. One router for all models would send it to
    # a's worker either way: there its text matches.
    first_b, _ = ask("b", "x7 x8 x9 w10", 1)
    with contextlib.ExitStack() as hold:
        if first_b == worker_a:
            held = hold.enter_context(client.completions.with_streaming_response.create(
                model="b", prompt="y1 y2 w11", max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True}))
            assert held.headers["X-Chunk-Llama-Worker"] == worker_a
        on_b, _ = ask("b", f"{system} w20 w21", 1)
    assert on_b != worker_a, "the system prompt under b followed a's requests: routed by text alone"
    assert ask("b", f"{system} w22 w23", 1)[0] == on_b  # and stays where b computed it


def test_an_adapter_loaded_through_the_router_reaches_every_worker(lora_replicas, adapters, prompts):
    """`POST /v1/load_lora_adapter` to the router's address: every worker loads it, requests
    name it (streamed, chat and Responses too) and get its answers, the routers' metrics have
    its router; unloaded the same way, it is gone from every worker and a request naming it
    is a 400 naming it. A load that one worker refuses is undone on the others."""
    import openai

    folders, expected = adapters
    replicas, base = lora_replicas, lora_replicas.model
    client = openai.OpenAI(base_url=replicas.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="model 'c' does not exist here"):
        client.completions.create(model="c", prompt=prompts[0], max_tokens=1)
    loaded = httpx.post(replicas.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folders["c"]},
                        timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert set(map(tuple, served_by(replicas).values())) == {(base, "a", "b", "c")}
    assert [m.id for m in client.models.list().data] == [base, "a", "b", "c"]
    streamed = client.completions.create(model="c", prompt=prompts[0], max_tokens=MAX_TOKENS, temperature=0,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected["c"]
    chat = client.chat.completions.create(model="c", messages=[{"role": "user", "content": "w7 w8"}], max_tokens=2)
    assert chat.model == "c" and chat.choices[0].message.content
    # what sglang-router writes into a Responses body (stream: null, top_k: -1, ...) is accepted
    assert client.responses.create(model="c", input="w7 w8", max_output_tokens=2).model == "c"
    again = httpx.post(replicas.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folders["c"]},
                       timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.text  # and c stays on every worker
    assert set(map(tuple, served_by(replicas).values())) == {(base, "a", "b", "c")}
    metrics = httpx.get(f"http://127.0.0.1:{replicas.metrics_port}/metrics", timeout=10).text
    assert {f'router_model="{m}"' for m in (base, "a", "b", "c")} <= set(re.findall(r'router_model="[^"]+"', metrics))

    unloaded = httpx.post(replicas.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert set(map(tuple, served_by(replicas).values())) == {(base, "a", "b")}
    with pytest.raises(openai.BadRequestError, match="model 'c' does not exist here"):
        client.completions.create(model="c", prompt=prompts[0], max_tokens=1)
    missing = httpx.post(replicas.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60)
    assert missing.status_code == 404, missing.text

    # A load one worker refuses (c loaded on it by hand first) is undone on the other.
    lone, other = sorted(served_by(replicas))
    lone_url = "http://127.0.0.1:" + lone.rsplit(":", 1)[1]
    body = {"lora_name": "c", "lora_path": folders["c"]}
    assert httpx.post(lone_url + "/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
    refused = httpx.post(replicas.url + "/v1/load_lora_adapter", json=body, timeout=60)
    assert refused.status_code == 400 and "already been loaded" in refused.text
    assert served_by(replicas) == {lone: [base, "a", "b", "c"], other: [base, "a", "b"]}
    assert httpx.post(lone_url + "/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60).status_code == 200


def test_a_worker_removed_through_the_front_leaves_every_router_and_joins_again(lora_replicas, prompts):
    """`DELETE /workers/{id}` at the front (the id its `GET /workers` lists, as sglang-router's
    own API takes it): the worker leaves every model's router, not the base model's alone, and
    the answer comes once none routes there: requests under an adapter whose router sent them
    to it (its prefix tree matching) go to the other worker. Unknown, the id is a 4xx; `POST
    /workers` brings the worker back."""
    import openai

    replicas, base = lora_replicas, lora_replicas.model
    client = openai.OpenAI(base_url=replicas.url + "/v1", api_key="none", max_retries=0)

    def ask(model: str, prompt: str) -> str:
        raw = client.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
        return raw.headers["X-Chunk-Llama-Worker"]

    def listed() -> list[dict]:
        return httpx.get(replicas.url + "/workers", timeout=10).json()["workers"]

    assert len(listed()) == 2
    system = prompts[5].rsplit(" ", 5)[0]
    gone = {ask("a", f"{system} v{i}") for i in range(3)}
    assert len(gone) == 1, gone  # under a, the prompt stays on the worker that computed it
    gone = gone.pop()
    entry = next(w for w in listed() if w["url"].rstrip("/").rsplit(":", 1)[1] == gone.rsplit(":", 1)[1])
    removed = httpx.delete(f"{replicas.url}/workers/{entry['id']}", timeout=120)
    assert removed.status_code == 200, removed.text
    assert removed.json()["url"] == entry["url"].rstrip("/") and set(removed.json()["models"]) == {base, "a", "b"}
    remaining = listed()
    assert len(remaining) == 1 and remaining[0]["id"] != entry["id"]
    for model in ("a", "b", base):
        assert gone not in {ask(model, f"{system} v{i}") for i in range(6)}, model
    unknown = httpx.delete(f"{replicas.url}/workers/{entry['id']}", timeout=30)
    assert 400 <= unknown.status_code < 500, unknown.text
    by_url = httpx.delete(f"{replicas.url}/workers/{entry['url']}", timeout=30)
    assert by_url.status_code == 404 and "routed to by no router" in by_url.text

    joined = httpx.post(replicas.url + "/workers", json={"url": entry["url"]}, timeout=120)
    assert joined.status_code == 200 and joined.json()["models"] == [base, "a", "b"], joined.text
    deadline = time.monotonic() + 60  # (sglang-router adds a worker in the background)
    while len(listed()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(listed()) == 2


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
