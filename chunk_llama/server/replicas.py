"""`chunk-llama serve --data-parallel N`: N engine workers behind sglang-router, by model.

Each worker is a plain `chunk-llama serve` process on 127.0.0.1 (its own engine, its own
prefix cache) on a free port; on a machine with N or more GPUs worker i gets GPU i
(`CUDA_VISIBLE_DEVICES`), on the CPU the cores are split into N disjoint sets (each
worker pinned to its set, `OMP_NUM_THREADS` its size: two engines sharing all cores
would each run OpenMP teams that fight for them). Workers on other machines (`chunk-llama
serve` started there) join with `--worker-urls`. Then sglang-router (a Rust binary from
PyPI) routes with its cache-aware policy: each request to the worker whose past requests
share the longest prefix with it (a radix tree of what it sent where), unless the load is
too uneven, so each system prompt is computed on one worker and stays there.

A worker's prefix cache is keyed by the adapter that computed the K/V, so that tree must be
one per model name: one router per served model (the base, each adapter the workers list
at start, each adapter loaded later) over the workers that serve it (`router_pool.py`),
and a small front on the requested host and port that relays each request to the router
of its `model` and fans adapter loads out to every worker (`model_front.py`, which says why
not sglang-router's own multi-model mode).

The launcher only starts and stops: SIGTERM or SIGINT stops the front, the routers and the
workers (each drains as a single server does), and exits; a worker that dies is logged, and
the routers' health checks send new requests to the others. Why sglang-router and not Ray
Serve's prefix-affinity router: docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from chunk_llama.errors import UsageError
from chunk_llama.extras import missing
from chunk_llama.server.options import ChatArgs, DeployArgs
from chunk_llama.server.router_pool import RouterMetrics, RouterPool, free_port, wait_healthy
from chunk_llama.settings import EngineArgs, to_argv

logger = logging.getLogger(__name__)
__all__ = ["free_port", "serve_replicas"]  # free_port: the scripts' too


def cpu_sets(num_workers: int) -> list[set[int]]:
    """The cores this process may use, split into `num_workers` disjoint sets (one core at
    least each; with fewer cores than workers, workers share round-robin)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < num_workers:
        return [{cores[i % len(cores)]} for i in range(num_workers)]
    size = len(cores) // num_workers
    return [set(cores[i * size: (i + 1) * size]) for i in range(num_workers)]


def worker_environment(index: int, num_workers: int, device: str, cores: set[int]) -> dict[str, str]:
    """A worker's environment: its GPU, or its share of the cores' threads."""
    env = dict(os.environ)
    import torch

    if device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= num_workers:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    else:
        env["OMP_NUM_THREADS"] = str(len(cores))
    return env


def _worker_start(cores: set[int] | None) -> None:
    """In the worker, before it runs: its cores, and SIGINT back to its default (a launcher
    started in the background has it ignored, and the worker stops on it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if cores is not None:
        os.sched_setaffinity(0, cores)


def served_models(urls: list[str], key: str | None) -> tuple[str | None, dict[str, list[str]]]:
    """The base model's name and, per adapter, the workers that serve it: what each worker's
    `/v1/models` lists (a worker that does not answer serves the base model only, here)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base, adapters = None, {}
    for url in urls:
        try:
            listing = httpx.get(url + "/v1/models", headers=headers, timeout=10).raise_for_status().json()["data"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            logger.warning("%s did not list its models (%s): routed as the base model's only", url, error)
            continue
        for model in listing:
            if model.get("parent"):
                adapters.setdefault(model["id"], []).append(url)
            elif base is None:
                base = model["id"]
    return base, adapters


def router_installed() -> bool:
    return not missing("router")


def serve_replicas(engine_args: EngineArgs, serve_args, deploy: DeployArgs | None = None,
                   chat: ChatArgs | None = None) -> None:
    """Start the workers, the routers and the front, and stop them all on SIGTERM/SIGINT
    (see the module doc). `deploy` (`server.options.DeployArgs`: keys, limits, timeouts,
    drain) goes to every local worker, which applies it as a single server does: the front
    and the routers forward each request with its headers, so a worker answers 401, 413 or
    429 itself; the keys in the workers' environment, never on a command line."""
    import uvicorn
    from prometheus_client import CollectorRegistry, start_http_server

    from chunk_llama.server.http import uvicorn_config
    from chunk_llama.server.main import configure_logging, model_name_for
    from chunk_llama.server.model_front import create_front

    deploy = deploy or DeployArgs()
    if not router_installed():
        raise UsageError("--data-parallel and --worker-urls need sglang-router: pip install sglang-router "
                         "(or chunk-llama[router])")
    args = serve_args
    configure_logging(args.log_level)
    num_local = args.data_parallel
    worker_args = dataclasses.replace(args, host="127.0.0.1", data_parallel=1, worker_urls=None)
    procs: list[tuple[str, subprocess.Popen]] = []
    pool = server = front_thread = None
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for index, cores in enumerate(cpu_sets(num_local) if num_local else []):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv = [sys.executable, "-m", "chunk_llama.cli", "serve", *to_argv(engine_args),
                    *to_argv(dataclasses.replace(worker_args, port=port, worker_id=f"{socket.gethostname()}:{port}")),
                    *to_argv(dataclasses.replace(deploy, api_key=None)), *to_argv(chat or ChatArgs())]
            env = worker_environment(index, num_local, engine_args.device, cores)
            env.pop("CHUNK_LLAMA_API_KEY", None)
            if deploy.api_key:
                env["CHUNK_LLAMA_API_KEY"] = ",".join(deploy.api_key)
            pinned = "OMP_NUM_THREADS" in env
            procs.append((url, subprocess.Popen(argv, env=env, preexec_fn=functools.partial(
                _worker_start, cores if pinned else None))))
            logger.info("worker %d: %s (%s)", index, url, f"cores {sorted(cores)}" if pinned else "its GPU")
        for url, proc in procs:
            wait_healthy(url, proc, args.worker_start_timeout)
        urls = [url for url, _ in procs] + [url.rstrip("/") for url in args.worker_urls or []]
        keys = deploy.keys()
        base, adapters = served_models(urls, keys[0] if keys else None)
        base = base or (args.served_model_name or [model_name_for(engine_args.model)])[0]
        pool = RouterPool(base, args.router_policy)
        with ThreadPoolExecutor(4) as starting:  # about a second each
            list(starting.map(lambda model_urls: pool.start(*model_urls), [(base, urls), *adapters.items()]))
        registry = CollectorRegistry()
        registry.register(RouterMetrics(pool))
        start_http_server(args.router_metrics_port or free_port(), addr="127.0.0.1", registry=registry)
        server = uvicorn.Server(uvicorn_config(
            create_front(pool, urls, max_body=deploy.max_request_bytes), host=args.host, port=args.port,
            header_timeout=deploy.header_timeout, keep_alive_timeout=deploy.keep_alive_timeout,
            log_level=args.log_level, log_config=None, access_log=False,  # each worker logs its requests
            timeout_graceful_shutdown=deploy.drain_timeout + 5))
        # In a thread of its own: this one keeps the signals (uvicorn leaves them alone there).
        front_thread = threading.Thread(target=server.run, name="chunk-llama-front", daemon=True)
        front_thread.start()
        while not server.started and front_thread.is_alive():
            time.sleep(0.05)
        if not server.started:
            raise RuntimeError(f"the front did not start on {args.host}:{args.port} (see its log above)")
        print(f"routing {len(urls)} workers on http://{args.host}:{args.port}/v1 ({args.router_policy}, one router "
              f"per model: {', '.join(pool.routers)})", file=sys.stderr, flush=True)
        reported = set()
        while not stopping and front_thread.is_alive() and pool.routers[base].alive():
            watched = [*procs, *((f"the router of {model!r}", r.proc) for model, r in list(pool.routers.items()))]
            for name, proc in watched:
                if proc.poll() is not None and proc.pid not in reported:
                    reported.add(proc.pid)
                    logger.warning("%s exited with code %s", name, proc.returncode)
            time.sleep(0.5)
    finally:
        if server is not None:
            server.should_exit = True  # no new requests: the front stops, the routers after it
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # each worker drains its running requests
        if pool is not None:
            pool.stop_all(timeout=30 + deploy.drain_timeout)
        for _, proc in procs:
            try:
                proc.wait(timeout=60 + deploy.drain_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        if front_thread is not None:
            front_thread.join(10)
