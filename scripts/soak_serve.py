"""HTTP soak of the server: thousands of requests with random sizes and options, clients that
drop mid-stream or time out while queued or in prefill, and invalid bodies, against a real
`chunk-llama serve` on 127.0.0.1 (a subprocess, whose RSS is measured).

    python scripts/soak_serve.py                            # 2,000 requests, the default model
    python scripts/soak_serve.py --num-requests 200 --tiny  # a tiny random Llama (what CI's test does)

Afterwards, with the server idle: no request running or waiting, no K/V held by a request
(`kv_cache_used_bytes` 0), the retained prefix cache within the pool, `/metrics` consistent with
what was sent (every accepted sample finished once; invalid bodies counted as errors), no 5xx,
the server's RSS within 5% of its value after warm-up (the first quarter of the requests), and
exit code 0 on SIGTERM. Prints the figures as JSON.
`drive` and `check` serve any server URL (tests/test_server_attack.py runs them on a tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from chunk_llama.server.replicas import free_port

KINDS = {  # kind of client -> weight
    "complete": 4,     # /v1/completions, n 1 or 2, maybe stop strings and logprobs, read whole
    "chat": 2,         # /v1/chat/completions, read whole
    "stream": 3,       # a streamed completion or chat, read to [DONE]
    "stream_drop": 2,  # a stream the client closes after a few events
    "timeout_drop": 1, # a client that gives up after 10-300 ms: while queued or in prefill
    "invalid": 1,      # a body the server must refuse with a 4xx
}
INVALID_BODIES = [  # MODEL: the served model's name, so each is refused for its own fault
    b"{not json",
    b'{"model": "MODEL", "prompt": "w7", "max_tokens": NaN}',
    b'{"model": "MODEL", "prompt": "\xff\xfe"}',
    b'{"model": "MODEL", "prompt": "w7", "max_tokens": -3}',
    b'{"model": "MODEL", "prompt": "w7", "n": 100000, "temperature": 1}',
    b'{"model": "MODEL", "prompt": "w7", "stop": ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8", "w9", "w10", '
    b'"w11", "w12", "w13", "w14", "w15", "w16", "w17"]}',
    b'{"model": "MODEL", "prompt": "w7", "max_tokens": 100000000}',
    b'{"model": "MODEL", "prompt": "w7", "logprobs": 6}',
    b'{"model": "no-such-model", "prompt": "w7"}',
    b'[]',
]


def words(rng: random.Random, count: int) -> str:
    """`count` words w6..w95: ordinary tokens of the tiny test vocabulary, short tokens of real ones."""
    return " ".join(f"w{rng.randrange(6, 96)}" for _ in range(count))


def metrics(client: httpx.Client) -> dict[str, float]:
    """/metrics as {sample name with labels: value}, labels other than `reason` and `endpoint` dropped
    (the worker label of a replica) and samples summed over them."""
    values: dict[str, float] = Counter()
    for line in client.get("/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] += float(value)
    return dict(values)


def total(values: dict[str, float], prefix: str) -> float:
    """The sum of a counter's samples over its labels."""
    return sum(v for k, v in values.items() if k == prefix or k.startswith(prefix + "{"))


def one_request(url: str, model: str, kind: str, rng: random.Random, prefixes: list[str], headers: dict) -> dict:
    """Send one request of `kind`; what the client saw (status, samples the server owes, tokens)."""
    prompt = rng.choice(prefixes) + " " + words(rng, rng.randint(1, 40))
    max_tokens = rng.randint(1, 24)
    result = {"kind": kind, "status": None, "samples": 0, "completion_tokens": 0}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        if kind == "invalid":
            response = client.post("/v1/completions", content=rng.choice(INVALID_BODIES).replace(b"MODEL", model.encode()),
                                   headers={"content-type": "application/json"})
            result["status"] = response.status_code
            return result
        chat = kind == "chat" or (kind.startswith("stream") and rng.random() < 0.5)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        if kind == "complete":
            body["n"] = rng.choice([1, 2])
            if body["n"] > 1:  # greedy would give two equal choices: a 400
                body["temperature"] = 0.8
            if rng.random() < 0.3:
                body["stop"] = [f"w{rng.randrange(6, 96)}"]
            if rng.random() < 0.3:
                body["logprobs"] = 2
        if kind.startswith("stream"):
            body["stream"] = True
            drop_after = rng.randint(1, 4) if kind == "stream_drop" else None
            with client.stream("POST", path, json=body) as response:
                result["status"] = response.status_code
                for count, line in enumerate(response.iter_lines(), 1):
                    if drop_after is not None and count >= drop_after:
                        break  # closing the response drops the connection
                    if line == "data: [DONE]":
                        result["samples"] = 1
            return result
        if kind == "timeout_drop":
            try:
                response = client.post(path, json=body, timeout=rng.uniform(0.01, 0.3))
            except httpx.TimeoutException:
                result["status"] = "dropped"
                return result
        else:
            response = client.post(path, json=body)
        result["status"] = response.status_code
        if response.status_code == 200:
            result["samples"] = body.get("n", 1)
            result["completion_tokens"] = response.json()["usage"]["completion_tokens"]
        return result


def drive(url: str, model: str, num_requests: int, *, concurrency: int = 16, seed: int = 0,
          api_key: str | None = None, on_progress=None) -> dict:
    """Send `num_requests` random requests (`KINDS`) with `concurrency` clients; returns the tally:
    {"by_kind_status": {kind: {status: count}}, "samples_owed", "completion_tokens", "seconds"}.
    `on_progress(done)` is called after each request (the soak samples RSS with it)."""
    rng = random.Random(seed)
    prefixes = [words(rng, rng.randint(20, 120)) for _ in range(8)]
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=num_requests)
    seeds = [rng.randrange(1 << 30) for _ in range(num_requests)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    done, lock = [0], threading.Lock()

    def run(i):
        result = one_request(url, model, kinds[i], random.Random(seeds[i]), prefixes, headers)
        with lock:
            done[0] += 1
            if on_progress is not None:
                on_progress(done[0])
        return result

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(run, range(num_requests)))
    tally: dict[str, Counter] = {}
    for r in results:
        tally.setdefault(r["kind"], Counter())[str(r["status"])] += 1
    return {"by_kind_status": {k: dict(v) for k, v in tally.items()},
            "samples_owed": sum(r["samples"] for r in results),
            "extra_samples": sum(r["samples"] - 1 for r in results if r["samples"] > 1),
            "completion_tokens": sum(r["completion_tokens"] for r in results),
            "seconds": round(time.perf_counter() - start, 1)}


def wait_idle(client: httpx.Client, timeout: float = 60.0) -> dict[str, float]:
    """/metrics once no request runs or waits and no K/V is held by one (or at `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(client)
        idle = (values.get("chunk_llama_requests_running", 0) == 0 and values.get("chunk_llama_requests_waiting", 0) == 0
                and values.get("chunk_llama_kv_cache_used_bytes", 0) == 0)
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def check(url: str, tally: dict, before: dict[str, float], api_key: str | None = None) -> tuple[dict, list[str]]:
    """The soak's pass conditions against `/metrics` (`before`: a scrape before `drive`); returns the
    figures and what failed."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {}) as client:
        after = wait_idle(client)
        alive = client.get("/health", timeout=10).status_code == 200

    def delta(name):
        return total(after, name) - total(before, name)

    statuses = Counter()
    for by_status in tally["by_kind_status"].values():
        statuses.update(by_status)
    kinds = tally["by_kind_status"]
    invalid = sum(kinds.get("invalid", {}).values())
    accepted, finished = delta("chunk_llama_requests_total"), delta("chunk_llama_requests_finished_total")
    figures = {
        "statuses": dict(statuses),
        "server_5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
        "alive": alive,
        "accepted": accepted,
        "finished_samples": finished,
        "aborted_samples": total(after, 'chunk_llama_requests_finished_total{reason="abort"}')
        - total(before, 'chunk_llama_requests_finished_total{reason="abort"}'),
        "errors": delta("chunk_llama_request_errors_total"),
        "generation_tokens": delta("chunk_llama_generation_tokens_total"),
        "kv_used_bytes": after.get("chunk_llama_kv_cache_used_bytes"),
        "kv_retained_bytes": after.get("chunk_llama_kv_cache_retained_bytes"),
        "kv_capacity_bytes": after.get("chunk_llama_kv_cache_capacity_bytes"),
    }
    problems = []
    if figures["server_5xx"] or not alive:
        problems.append(f"5xx answers or a dead server: {figures['statuses']}, alive {alive}")
    if any(s not in ("400", "413", "422") for s in kinds.get("invalid", {})):
        problems.append(f"an invalid body got something else than a 4xx: {kinds['invalid']}")
    if figures["kv_used_bytes"] != 0 or after.get("chunk_llama_requests_running") or after.get(
            "chunk_llama_requests_waiting"):
        problems.append("requests or their K/V left behind when idle")
    if figures["kv_retained_bytes"] > figures["kv_capacity_bytes"]:
        problems.append("retained K/V beyond the pool")
    if finished != accepted + tally["extra_samples"]:  # only "complete" asks n=2, and it never drops
        problems.append(f"{finished} samples finished for {accepted} requests accepted "
                        f"(+{tally['extra_samples']} second samples)")
    if figures["errors"] != invalid:
        problems.append(f"{figures['errors']} errors counted for {invalid} invalid bodies sent")
    if figures["generation_tokens"] < tally["completion_tokens"]:
        problems.append("fewer tokens counted than the clients received")
    return figures, problems


def save_tiny_model(folder: str) -> None:
    """A tiny random Llama (scripts/soak.py's) with a word-level tokenizer and a chat template, saved."""
    from soak import tiny_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="w5", unk_token="w0")
    tokenizer.chat_template = "{% for m in messages %}w3 {{ m['content'] }} {% endfor %}w4"
    model = tiny_model()
    model.config.max_position_embeddings = 4096
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def start_server(model_folder: str | None, port: int, flags: list[str] = ()) -> subprocess.Popen:
    """`chunk-llama serve` on 127.0.0.1:`port` (the default model when `model_folder` is None)."""
    argv = [sys.executable, "-m", "chunk_llama.cli", "serve", "--port", str(port), "--log-level", "warning",
            *(["--model", model_folder, "--kv-cache-bytes", str(8 << 20)] if model_folder else []), *flags]
    proc = subprocess.Popen(argv)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the default model")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as folder:
        if args.tiny:
            save_tiny_model(folder)
        proc = start_server(folder if args.tiny else None, port)
        server, rss = psutil.Process(proc.pid), {}
        name = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]

        def sample_rss(done):  # every tenth of the requests; warm-up: the first quarter
            if done % max(1, args.num_requests // 10) == 0:
                rss.setdefault("trace", []).append(round(server.memory_info().rss / 2**20, 1))
            if done == args.num_requests // 4:
                rss["warm"] = server.memory_info().rss
        try:
            with httpx.Client(base_url=url) as client:
                before = metrics(client)
            tally = drive(url, name, args.num_requests, concurrency=args.concurrency, seed=args.seed,
                          on_progress=sample_rss)
            figures, problems = check(url, tally, before)
            final = server.memory_info().rss
            proc.send_signal(signal.SIGTERM)
            stop_start = time.monotonic()
            figures["exit_code"] = proc.wait(timeout=120)
            figures["stop_seconds"] = round(time.monotonic() - stop_start, 2)
        finally:
            if proc.poll() is None:
                proc.kill()
    figures.update(requests=args.num_requests, seconds=tally["seconds"], by_kind=tally["by_kind_status"],
                   rss_after_warmup_mib=round(rss["warm"] / 2**20, 1), rss_final_mib=round(final / 2**20, 1), rss_trace_mib=rss["trace"],
                   rss_growth=round(final / rss["warm"] - 1, 4))
    if figures["rss_growth"] > 0.05:
        problems.append(f"RSS grew {figures['rss_growth']:.1%} after warm-up")
    if figures["exit_code"] != 0:
        problems.append(f"the server exited with {figures['exit_code']} on SIGTERM")
    print(json.dumps(figures, indent=2))
    print("OK" if not problems else "FAILED: " + "; ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
