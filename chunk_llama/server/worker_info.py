"""What a server tells a router about itself, and which worker answered.

sglang-router (the cache-aware router `chunk-llama serve --data-parallel` puts in front
of several servers, one per model, `replicas.py`) asks each worker for `/model_info` and
`/server_info` (the older `/get_model_info`, `/get_server_info` too) when it registers it
(the model it registers the worker under is `served_model_name`, the base's). Every
response carries the worker's id in `X-Chunk-Llama-Worker`, and `/metrics` labels every
sample with it (`worker="..."`), so replicas' metrics stay apart when one scraper reads
them all.
"""

from __future__ import annotations

import os
import socket

from fastapi import FastAPI
from prometheus_client.registry import Collector

WORKER_HEADER = "X-Chunk-Llama-Worker"


def default_worker_id(port: int | None = None) -> str:
    """host:port (or host:pid) of this server: unique among the replicas of one router."""
    return f"{socket.gethostname()}:{port if port is not None else os.getpid()}"


def add_worker_routes(app: FastAPI, engine, model_names: list[str], worker_id: str) -> None:
    """`/model_info`, `/server_info` (and their older names) and the worker header."""

    def model_info():
        return {"model_path": model_names[0], "tokenizer_path": model_names[0], "served_model_names": model_names,
                "is_generation": True, "max_model_len": engine.max_model_len, "worker_id": worker_id}

    def server_info():
        stats = engine.stats
        return {"worker_id": worker_id, "version": _version(), "model_path": model_names[0],
                "served_model_name": model_names[0], "max_batch_size": engine.max_batch_size,
                "max_model_len": engine.max_model_len, "chunk_size": stats["chunk_size"],
                "kv_capacity_chunks": stats["kv_capacity_chunks"], "attention_backend": stats["attention_backend"],
                "prefix_caching": engine.cache.tree.retain_prefixes}

    for path, handler in (("/model_info", model_info), ("/get_model_info", model_info),
                          ("/server_info", server_info), ("/get_server_info", server_info)):
        app.add_api_route(path, handler, methods=["GET"])

    @app.middleware("http")
    async def name_the_worker(request, call_next):
        response = await call_next(request)
        response.headers[WORKER_HEADER] = worker_id
        return response


def _version() -> str:
    from chunk_llama.version import __version__

    return __version__


class WorkerLabels(Collector):
    """Every sample of `registry` with the label worker=<id> added."""

    def __init__(self, registry, worker_id: str):
        self.registry, self.worker_id = registry, worker_id

    def collect(self):
        for family in self.registry.collect():
            for sample in family.samples:
                sample.labels["worker"] = self.worker_id
            yield family
