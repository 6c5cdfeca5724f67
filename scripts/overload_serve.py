"""Overload: requests arriving at 3x what the server completes, against its bounded queue.

    python scripts/overload_serve.py --tiny                 # a tiny random Llama
    python scripts/overload_serve.py --max-tokens 32        # the default model

`chunk-llama serve` (a subprocess on 127.0.0.1, `--max-waiting-requests`) first gets a closed
loop of `--max-batch-size` clients for `--seconds`: its capacity in requests per second. Then
requests arrive by a Poisson process at `--factor` times that rate for `--seconds`, each a
streamed completion of `--max-tokens` tokens. Reported: accepted throughput (requests
completed per second), the share refused with 429 (and that each carried Retry-After), p50/p99
time to first token of the accepted ones, and /health's p99 latency meanwhile; then SIGTERM
and the time the server took to drain and exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import tempfile
import time

import httpx
from soak_serve import free_port, save_tiny_model, start_server, words


async def one(client: httpx.AsyncClient, model: str, rng: random.Random, max_tokens: int) -> dict:
    """One streamed completion: its status, Retry-After, time to first token and end."""
    body = {"model": model, "prompt": words(rng, rng.randint(20, 60)), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    result = {"status": None, "ttft": None, "retry_after": None}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        result["status"], result["retry_after"] = response.status_code, response.headers.get("retry-after")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and result["ttft"] is None:
                result["ttft"] = time.perf_counter() - start
    result["end"] = time.perf_counter()
    return result


async def closed_loop(url, model, clients, seconds, max_tokens) -> float:
    """Requests per second `clients` back-to-back clients complete."""
    done, stop_at = [0], time.perf_counter() + seconds

    async def client_loop(i):
        rng = random.Random(i)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            while time.perf_counter() < stop_at:
                if (await one(client, model, rng, max_tokens))["status"] == 200:
                    done[0] += 1

    start = time.perf_counter()
    await asyncio.gather(*(client_loop(i) for i in range(clients)))
    return done[0] / (time.perf_counter() - start)


async def open_loop(url, model, rate, seconds, max_tokens) -> dict:
    """Poisson arrivals at `rate` per second for `seconds`; /health probed every 0.2 s meanwhile."""
    rng = random.Random(0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        tasks, health, start = [], [], time.perf_counter()

        async def probe():
            async with httpx.AsyncClient(base_url=url, timeout=10) as probe_client:
                while time.perf_counter() - start < seconds:
                    t = time.perf_counter()
                    await probe_client.get("/health")
                    health.append(time.perf_counter() - t)
                    await asyncio.sleep(0.2)

        prober = asyncio.create_task(probe())
        t = 0.0
        while t < seconds:
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, model, random.Random(rng.random()), max_tokens)))
            t += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
        await prober
    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    ttfts = sorted(r["ttft"] for r in accepted if r["ttft"] is not None)
    span = max(r["end"] for r in results) - start
    return {"sent": len(results), "accepted": len(accepted), "refused_429": len(refused),
            "other_status": len(results) - len(accepted) - len(refused),
            "share_429": round(len(refused) / len(results), 3),
            "all_429_with_retry_after": all(r["retry_after"] for r in refused),
            "accepted_rps": round(len(accepted) / span, 2),
            "ttft_p50_s": round(statistics.median(ttfts), 3),
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3),
            "health_p99_s": round(sorted(health)[int(0.99 * (len(health) - 1))], 4)}


async def drain(url, model, proc, clients, max_tokens) -> dict:
    """A full batch running, then SIGTERM: how long until the process exits, and how the
    running requests ended."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        tasks = [asyncio.create_task(one(client, model, random.Random(i), max_tokens)) for i in range(clients)]
        await asyncio.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        start = time.perf_counter()
        results = await asyncio.gather(*tasks)
        while proc.poll() is None and time.perf_counter() - start < 120:
            await asyncio.sleep(0.05)
    return {"drain_running": clients, "drain_completed_200": sum(r["status"] == 200 for r in results),
            "drain_sigterm_to_exit_s": round(time.perf_counter() - start, 2), "exit_code": proc.poll()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the default model")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-waiting-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--max-batch-size", str(args.max_batch_size), "--max-waiting-requests", str(args.max_waiting_requests)]
    with tempfile.TemporaryDirectory() as folder:
        if args.tiny:
            save_tiny_model(folder)
        proc = start_server(folder if args.tiny else None, port, flags)
        try:
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            capacity = asyncio.run(closed_loop(url, model, args.max_batch_size, args.seconds, args.max_tokens))
            figures = {"capacity_rps": round(capacity, 2), "arrival_rps": round(args.factor * capacity, 2)}
            figures.update(asyncio.run(open_loop(url, model, args.factor * capacity, args.seconds, args.max_tokens)))
            figures.update(asyncio.run(drain(url, model, proc, args.max_batch_size, args.max_tokens)))
        finally:
            if proc.poll() is None:
                proc.kill()
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
