"""`/metrics` (Prometheus) with `prometheus_client`, one registry per app.

Counters (since the server started):
  chunk_llama_requests_total{endpoint}            engine requests accepted (one per prompt)
  chunk_llama_request_errors_total                requests refused with a 4xx error
  chunk_llama_requests_finished_total{reason}     samples finished: stop, length or abort
  chunk_llama_prompt_tokens_total                 prompt tokens of requests (counted when one ends)
  chunk_llama_prefix_cache_hit_tokens_total       prompt tokens the prefix cache served (as `usage`'s
                                                  cached_tokens; counted when a request ends)
  chunk_llama_generation_tokens_total             tokens generated
  chunk_llama_prefill_tokens_computed_total       prompt tokens the engine's prefill computed
Gauges (now):
  chunk_llama_requests_running / _waiting         requests in the batch / queued
  chunk_llama_kv_cache_used_bytes                 K/V held by running requests
  chunk_llama_kv_cache_retained_bytes             K/V of finished prefixes kept as prefix cache
  chunk_llama_kv_cache_capacity_bytes             the whole pool
Histograms (seconds, per request; lengths in tokens):
  chunk_llama_time_to_first_token_seconds         arrival to first token
  chunk_llama_inter_token_latency_seconds         between a sample's consecutive steps with new tokens
  chunk_llama_e2e_request_latency_seconds         arrival to finish
  chunk_llama_queue_time_seconds                  arrival to the start of the step that admitted it
  chunk_llama_prompt_length_tokens / _generation_length_tokens
"""

from __future__ import annotations

import threading
import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

prometheus_client.disable_created_metrics()  # the *_created samples would double every family
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    """The server's metrics, updated from the handlers and the engine loop (thread-safe), and
    read at scrape time from the engine and the loop (`bind`)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("chunk_llama_requests", "Engine requests accepted (one per prompt).",
                                ["endpoint"], registry=r)
        self.errors = Counter("chunk_llama_request_errors", "Requests refused with a 4xx error.", registry=r)
        self.finished = Counter("chunk_llama_requests_finished", "Samples finished, by finish reason.", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("chunk_llama_prompt_tokens", "Prompt tokens of requests, counted when one ends.",
                                     registry=r)
        self.cache_hit_tokens = Counter("chunk_llama_prefix_cache_hit_tokens", "Prompt tokens served by the prefix "
                                        "cache (not computed), counted when a request ends.", registry=r)
        self.generation_tokens = Counter("chunk_llama_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("chunk_llama_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("chunk_llama_inter_token_latency_seconds", "Between a sample's consecutive new tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("chunk_llama_e2e_request_latency_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram("chunk_llama_queue_time_seconds", "Arrival to the start of the step that "
                                    "admitted the request.", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_length = Histogram("chunk_llama_prompt_length_tokens", "Prompt tokens per request.",
                                       buckets=LENGTH_BUCKETS, registry=r)
        self.generation_length = Histogram("chunk_llama_generation_length_tokens", "Tokens generated per sample.",
                                           buckets=LENGTH_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._last_token: dict[tuple[int, int], float] = {}  # (request, sample) -> time of its last new token
        self.totals = {"generation": 0, "prompt": 0, "cache_hit": 0}  # plain tallies for the stats line

    def bind(self, engine, loop) -> None:
        """Read the engine's figures and the loop's gauges at scrape time."""
        self.registry.register(_EngineCollector(engine, loop))

    def on_request(self, endpoint: str, count: int = 1) -> None:
        """Engine requests were accepted."""
        self.requests.labels(endpoint).inc(count)

    def on_error(self) -> None:
        """A request was refused."""
        self.errors.inc()

    def on_admitted(self, arrival_times: list[float], step_start: float) -> None:
        """Requests admitted by the step that started at `step_start` (engine loop thread)."""
        for arrival in arrival_times:
            self.queue_time.observe(max(0.0, step_start - arrival))

    def on_deltas(self, deltas) -> None:
        """New tokens of a step (engine loop thread)."""
        now = time.perf_counter()
        count = 0
        with self._lock:
            for delta in deltas:
                if not delta.token_ids:
                    continue
                count += len(delta.token_ids)
                key = (delta.request_id, delta.index)
                if key in self._last_token:
                    self.itl.observe(now - self._last_token[key])
                self._last_token[key] = now
                if delta.finished:
                    self._last_token.pop(key, None)
            self.totals["generation"] += count
        self.generation_tokens.inc(count)

    def on_finish(self, output) -> None:
        """A sample ended (engine loop thread); its prompt and cache hits count once per request."""
        self.finished.labels(output.finish_reason).inc()
        self.generation_length.observe(len(output.token_ids))
        with self._lock:
            self._last_token.pop((output.request_id, output.index), None)
            if output.index == 0:
                self.totals["prompt"] += len(output.prompt_token_ids)
                self.totals["cache_hit"] += output.num_cached_tokens
        if output.index == 0:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.cache_hit_tokens.inc(output.num_cached_tokens)
            self.prompt_length.observe(len(output.prompt_token_ids))
            if output.first_token_time is not None:
                self.ttft.observe(output.first_token_time - output.arrival_time)
            if output.finish_time is not None:
                self.e2e.observe(output.finish_time - output.arrival_time)

    def label_worker(self, worker_id: str) -> None:
        """Every sample exposed from now on carries worker=<worker_id> (replicas behind a router)."""
        from chunk_llama.server.worker_info import WorkerLabels

        self._exposed = CollectorRegistry(auto_describe=True)
        self._exposed.register(WorkerLabels(self.registry, worker_id))

    def render(self) -> bytes:
        """The exposition text."""
        return prometheus_client.generate_latest(getattr(self, "_exposed", None) or self.registry)


class _EngineCollector:
    """The engine's prefill counter and the KV and batch gauges, read when scraped."""

    def __init__(self, engine, loop):
        self.engine, self.loop = engine, loop

    def collect(self):
        stats = self.engine.stats
        per_chunk, retained = stats["bytes_per_chunk"], stats["retained_chunks"]
        running = self.loop.num_running
        yield CounterMetricFamily("chunk_llama_prefill_tokens_computed", "Prompt tokens computed by prefill.",
                                  value=stats["prefill_tokens_computed"])
        for name, help_text, value in [
            ("requests_running", "Requests in the running batch.", running),
            ("requests_waiting", "Requests queued, not yet running.", max(0, self.loop.num_in_flight - running)),
            ("kv_cache_used_bytes", "K/V bytes held by running requests.",
             (stats["chunks_in_use"] - retained) * per_chunk),
            ("kv_cache_retained_bytes", "K/V bytes of finished prefixes kept as prefix cache.", retained * per_chunk),
            ("kv_cache_capacity_bytes", "K/V bytes of the whole pool.", stats["kv_capacity_chunks"] * per_chunk),
        ]:
            yield GaugeMetricFamily("chunk_llama_" + name, help_text, value=value)
