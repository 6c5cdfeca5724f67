"""Replicas behind the cache-aware router (`chunk-llama serve --data-parallel 2`) against
round-robin routing, and what the router costs per request.

    python scripts/bench_replicas.py --limit 10 --max-tokens 16
    python scripts/bench_replicas.py --overhead-only --rounds 20

Workload: the shipped ToolQA-style prompt set (4 applications, each a long system prompt
with worked examples; `--limit` questions per application), the apps' questions
in a random order (`--seed`; each app's questions in order), `--clients` at a time, greedy.
For each policy (cache_aware, round_robin) one launch of 2 workers (the default model,
each worker one of the 2 cores) and the router: prompt tokens, tokens the workers'
prefills computed, tokens their prefix caches served (from each worker's /metrics), and
the hit rate (served / prompt). Routing overhead: a 1-token completion straight to a
worker, through the (base model's) router alone, and through the front that picks the
router by model and the router, interleaved, `--rounds` times each, medians.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from bench_serve import toolqa_chats  # noqa: E402
from test_replicas import Replicas  # noqa: E402

from chunk_llama.ops.cpu import isa  # noqa: E402
from chunk_llama.server.main import model_name_for  # noqa: E402


def arrivals(chats_by_app: list[list], seed: int) -> list:
    """The apps' chats in a random order (seeded), each app's own in order: strict A, B, C, D
    alternation would let round-robin over two workers keep each app on one worker by accident."""
    rng = random.Random(seed)
    queues = [list(chats) for chats in chats_by_app]
    out = []
    while any(queues):
        out.append(rng.choice([q for q in queues if q]).pop(0))
    return out


def worker_counter(worker: str, name: str) -> float:
    port = int(worker.rsplit(":", 1)[1])
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return float(re.search(rf'^{name}{{[^}}]*worker="{re.escape(worker)}"[^}}]*}} (\S+)$', text, re.M).group(1))


SERVER_ARGS = ("--kv-cache-bytes", str(2 << 30), "--max-batch-size", "16")


def run_policy(path: str, policy: str, chats: list, max_tokens: int, clients: int) -> dict:
    replicas = Replicas(path, model_name_for(path), policy, *SERVER_ARGS)
    try:
        def ask(messages):
            body = {"model": replicas.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            answer = httpx.post(replicas.url + "/v1/chat/completions", json=body, timeout=600)
            answer.raise_for_status()
            return answer.headers["X-Chunk-Llama-Worker"], answer.json()["usage"]

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(ask, chats))
        seconds = time.perf_counter() - start
        workers = sorted({w for w, _ in results})
        prompt = sum(u["prompt_tokens"] for _, u in results)
        computed = sum(worker_counter(w, "chunk_llama_prefill_tokens_computed_total") for w in workers)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for _, u in results)
        per_worker = {w: sum(1 for x, _ in results if x == w) for w in workers}
        return dict(policy=policy, requests=len(chats), prompt=prompt, computed=computed, cached=cached,
                    hit_rate=cached / prompt, seconds=seconds, per_worker=per_worker)
    finally:
        replicas.stop()


def router_overhead(path: str, rounds: int) -> dict[str, float]:
    """Medians (ms) of a 1-token completion straight to a worker, through the router alone
    and through the front and the router (what clients use), interleaved."""
    import psutil

    replicas = Replicas(path, model_name_for(path), "cache_aware", *SERVER_ARGS)
    try:
        body = {"model": replicas.model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
        first = httpx.post(replicas.url + "/v1/completions", json=body, timeout=60)
        worker_url = "http://127.0.0.1:" + first.headers["X-Chunk-Llama-Worker"].rsplit(":", 1)[1]
        listening = [conn.laddr.port for child in psutil.Process(replicas.proc.pid).children(recursive=True)
                     if "router" in " ".join(child.cmdline())
                     for conn in child.net_connections(kind="tcp") if conn.status == psutil.CONN_LISTEN]
        router_url = next(f"http://127.0.0.1:{port}" for port in listening  # not its metrics port
                          if httpx.get(f"http://127.0.0.1:{port}/get_loads", timeout=10).status_code == 200)
        times = {"worker": [], "router": [], "front": []}
        with httpx.Client() as client:
            for _ in range(rounds):
                for name, url in (("worker", worker_url), ("router", router_url), ("front", replicas.url)):
                    start = time.perf_counter()
                    client.post(url + "/v1/completions", json=body, timeout=60).raise_for_status()
                    times[name].append((time.perf_counter() - start) * 1e3)
        return {name: statistics.median(values) for name, values in times.items()}
    finally:
        replicas.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=10, help="questions per application")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--overhead-only", action="store_true")
    parser.add_argument("--seed", type=int, default=0, help="of the arrival order")
    args = parser.parse_args()
    from chunk_llama.loading import default_model_path

    path = default_model_path()
    print(f"# {isa.describe_host()}; 2 workers of the default model, one core each; {time.strftime('%Y-%m-%d')}")
    if not args.overhead_only:
        chats = toolqa_chats(args.limit)
        by_app: dict[str, list] = {}
        for chat in chats:
            by_app.setdefault(chat[0]["content"], []).append(chat)
        ordered = arrivals(list(by_app.values()), args.seed)
        print("| policy | requests | prompt tokens | prefill computed | served from cache | hit rate | requests per "
              "worker | seconds |")
        print("|---|---|---|---|---|---|---|---|")
        for policy in ("cache_aware", "round_robin"):
            r = run_policy(path, policy, ordered, args.max_tokens, args.clients)
            print(f"| {policy} | {r['requests']} | {r['prompt']} | {r['computed']:.0f} | {r['cached']} | "
                  f"{r['hit_rate']:.1%} | {', '.join(map(str, r['per_worker'].values()))} | {r['seconds']:.1f} |",
                  flush=True)
    ms = router_overhead(path, args.rounds)
    print(f"routing overhead: 1-token completion {ms['worker']:.1f} ms straight to a worker, {ms['router']:.1f} ms "
          f"through the router ({ms['router'] - ms['worker']:+.1f} ms), {ms['front']:.1f} ms through the front and "
          f"the router ({ms['front'] - ms['router']:+.1f} ms more; medians of {args.rounds}, interleaved)")


if __name__ == "__main__":
    main()
