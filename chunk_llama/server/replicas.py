"""`chunk-llama serve --data-parallel N`: N engine workers behind sglang-router.

Each worker is a plain `chunk-llama serve` process on 127.0.0.1 (its own engine, its own
prefix cache) on a free port; on a machine with N or more GPUs worker i gets GPU i
(`CUDA_VISIBLE_DEVICES`), on the CPU the cores are split into N disjoint sets (each
worker pinned to its set, `OMP_NUM_THREADS` its size: two engines sharing all cores
would each run OpenMP teams that fight for them). Then sglang-router (a Rust binary
from PyPI) serves the OpenAI API on the requested host and port and routes each
request with its cache-aware policy: to the worker whose past requests share the
longest prefix with it (a radix tree of what it sent where), unless the load is too
uneven. So each system prompt is computed on one worker and stays there. Workers on
other machines (`chunk-llama serve` started there) join with `--worker-urls`.

The launcher only starts and stops: SIGTERM or SIGINT stops the router, then the
workers (each drains as a single server does), and exits; a worker that dies is
logged, and the router's health checks send new requests to the others. Why
sglang-router and not Ray Serve's prefix-affinity router: docs/ARCHITECTURE.md.
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
import time

import httpx

from chunk_llama.errors import UsageError
from chunk_llama.extras import missing
from chunk_llama.server.options import ChatArgs, DeployArgs
from chunk_llama.settings import EngineArgs, to_argv

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} was not healthy after {timeout:.0f} s")


def router_command(args, worker_urls: list[str]) -> list[str]:
    """sglang-router's command line: cache-aware routing over `worker_urls`, health checks
    every 2 s (a dead worker leaves the rotation within seconds), its Prometheus endpoint
    on `--router-metrics-port` (a free port when 0)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.port),
            "--worker-urls", *worker_urls, "--policy", args.router_policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(args.router_metrics_port or free_port()),
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2", "--health-success-threshold", "1",
            "--log-level", "warn"]


def router_installed() -> bool:
    return not missing("router")


def serve_replicas(engine_args: EngineArgs, serve_args, deploy: DeployArgs | None = None,
                   chat: ChatArgs | None = None) -> None:
    """Start the workers and the router, and stop them all on SIGTERM/SIGINT (see the module doc).
    `deploy` (`server.options.DeployArgs`: keys, limits, timeouts, drain) goes to every local
    worker, which applies it as a single server does: the router forwards each request with its
    headers, so a worker answers 401, 413 or 429 itself; the keys in the workers' environment,
    never on a command line."""
    deploy = deploy or DeployArgs()
    if not router_installed():
        raise UsageError("--data-parallel and --worker-urls need sglang-router: pip install sglang-router "
                         "(or chunk-llama[router])")
    args = serve_args
    num_local = args.data_parallel
    worker_args = dataclasses.replace(args, host="127.0.0.1", data_parallel=1, worker_urls=None)
    procs: list[tuple[str, subprocess.Popen]] = []
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
            _wait_healthy(url, proc, args.worker_start_timeout)
        urls = [url for url, _ in procs] + list(args.worker_urls or [])
        router = subprocess.Popen(router_command(args, urls))
        procs.append((f"router on {args.host}:{args.port}", router))
        _wait_healthy(f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}", router,
                      60)
        print(f"routing {len(urls)} workers on http://{args.host}:{args.port}/v1 ({args.router_policy})",
              file=sys.stderr, flush=True)
        alive = {url for url, _ in procs}
        while not stopping and router.poll() is None:
            for url, proc in procs:
                if url in alive and proc.poll() is not None:
                    alive.discard(url)
                    logger.warning("%s exited with code %s", url, proc.returncode)
            time.sleep(0.5)
    finally:
        for _, proc in reversed(procs):  # the router first: no new requests reach the workers
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _, proc in reversed(procs):
            try:
                proc.wait(timeout=60 + deploy.drain_timeout)  # a worker drains its running requests first
            except subprocess.TimeoutExpired:
                proc.kill()
