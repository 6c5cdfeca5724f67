"""One sglang-router per served model: start, stop, look up, and their metrics as one page.

sglang-router's cache-aware policy keeps one radix tree of request text per model that its
workers register, and a chunk-llama worker registers one model (its base) whichever
adapter a request names; its multi-model mode (`--enable-igw`) registers one model per
worker URL and does not start offline (docs/ARCHITECTURE.md, "Replicas"). So the launcher
runs one router per model name over the workers that serve it (`RouterPool`), each with a
tree of its own, and the front (`model_front.py`) sends each request to its model's router.
A router is a small process (about 90 MB, ready in about a second); one starts when an
adapter is loaded and stops when it is unloaded.

`RouterMetrics` puts every router's Prometheus metrics on one page, each sample labelled
`router_model="<model>"` (two routers' samples would otherwise collide), served on
`--router-metrics-port` as the single router's were.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 60


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_command(worker_urls: list[str], port: int, policy: str, metrics_port: int) -> list[str]:
    """sglang-router's command line on 127.0.0.1 (only the front reaches it): `policy` over
    `worker_urls`, health checks every 2 s (a dead worker leaves the rotation within
    seconds), its Prometheus endpoint on `metrics_port`."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--health-check-interval-secs", "2", "--health-failure-threshold", "2", "--health-success-threshold", "1",
            "--log-level", "warn"]


@dataclass
class Router:
    model: str
    url: str
    metrics_port: int
    workers: list[str]
    proc: subprocess.Popen

    def alive(self) -> bool:
        return self.proc.poll() is None


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} was not healthy after {timeout:.0f} s")


class RouterPool:
    """The routers by model name: the base model's (`base`, over every worker) and one per
    adapter. Starting and stopping hold a lock; `url_for` reads a dict (the front's event loop
    calls it per request)."""

    def __init__(self, base: str, policy: str):
        self.base, self.policy = base, policy
        self.routers: dict[str, Router] = {}
        self._lock = threading.Lock()

    def start(self, model: str, worker_urls: list[str]) -> Router:
        """A router for `model` over `worker_urls`, healthy (replacing one already there)."""
        port, metrics_port = free_port(), free_port()
        proc = subprocess.Popen(router_command(worker_urls, port, self.policy, metrics_port))
        router = Router(model, f"http://127.0.0.1:{port}", metrics_port, list(worker_urls), proc)
        try:
            wait_healthy(router.url, proc, START_TIMEOUT_S)
        except RuntimeError:
            _stop(proc)
            raise
        with self._lock:
            old, self.routers[model] = self.routers.get(model), router
        if old is not None:
            _stop(old.proc)
        logger.info("router for %r on %s over %d workers", model, router.url, len(worker_urls))
        return router

    def stop(self, model: str) -> None:
        with self._lock:
            router = self.routers.pop(model, None)
        if router is not None:
            _stop(router.proc)

    def url_for(self, model: object) -> str:
        """The router of `model` (a request's `model` field); the base model's for any other
        value (its aliases, a name no worker serves, none at all: the worker answers) and while
        the model's own router is down (routed by text, as one router would)."""
        router = self.routers.get(model) if isinstance(model, str) else None
        if router is None or not router.alive():
            router = self.routers[self.base]
        return router.url

    def add_worker(self, url: str, models: list[str]) -> None:
        """A worker that joined at run time: each of its models' routers (sglang-router's
        `POST /workers`) and the routes of any adapter that has none yet."""
        for model in models:
            router = self.routers.get(model)
            if router is None:
                self.start(model, [url])
                continue
            httpx.post(router.url + "/workers", json={"url": url}, timeout=30).raise_for_status()
            router.workers.append(url)

    def remove_worker(self, url: str, timeout: float = 30) -> list[str]:
        """`url` out of every router's rotation (sglang-router's `DELETE /workers/{id}`, with each
        router's own id for it), back once none lists it (the routers remove in the
        background); an adapter's router left without workers stops (its model's requests go
        to the base model's router). Returns the models whose routers had it."""
        removed = []
        for model, router in list(self.routers.items()):
            listed = httpx.get(router.url + "/workers", timeout=timeout).json()["workers"]
            ids = [w["id"] for w in listed if w["url"].rstrip("/") == url]
            for worker_id in ids:
                httpx.delete(f"{router.url}/workers/{worker_id}", timeout=timeout).raise_for_status()
            deadline = time.monotonic() + timeout
            while ids and any(w["url"].rstrip("/") == url
                              for w in httpx.get(router.url + "/workers", timeout=timeout).json()["workers"]):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the router for {model!r} still lists {url} after {timeout:.0f} s")
                time.sleep(0.1)
            if ids or url in router.workers:
                removed.append(model)
            if url in router.workers:
                router.workers.remove(url)
            if not router.workers and model != self.base:
                self.stop(model)
        return removed

    def stop_all(self, timeout: float = 30) -> None:
        """Every router, each given `timeout` s for its running requests."""
        with self._lock:
            routers = list(self.routers.values())
        for router in routers:  # all at once, then wait
            if router.alive():
                router.proc.send_signal(signal.SIGTERM)
        for router in routers:
            _stop(router.proc, timeout)


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RouterMetrics(Collector):
    """Every router's Prometheus samples, labelled `router_model`, as one registry's."""

    def __init__(self, pool: RouterPool):
        self.pool = pool

    def collect(self):
        families = {}
        for router in list(self.pool.routers.values()):
            try:
                text = httpx.get(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=2).text
            except httpx.HTTPError:
                continue  # a router starting or gone: the next scrape has it
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, family)
                samples = [s._replace(labels={**s.labels, "router_model": router.model}) for s in family.samples]
                merged.samples = samples if merged is family else merged.samples + samples
        yield from families.values()
