"""`/metrics` in the Prometheus text format (version 0.0.4), formatted here.

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
"""

from __future__ import annotations

import threading
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The counters, updated from the handlers and the engine loop (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.errors = 0
        self.prompt_tokens = 0
        self.cache_hit_tokens = 0
        self.generation_tokens = 0

    def on_request(self, endpoint: str, count: int = 1) -> None:
        """Engine requests were accepted."""
        with self._lock:
            self.requests[endpoint] += count

    def on_error(self) -> None:
        """A request was refused."""
        with self._lock:
            self.errors += 1

    def on_deltas(self, deltas) -> None:
        """New tokens of a step (engine loop thread)."""
        with self._lock:
            self.generation_tokens += sum(len(d.token_ids) for d in deltas)

    def on_finish(self, output) -> None:
        """A sample ended (engine loop thread); its prompt and cache hits count once per request."""
        with self._lock:
            self.finished[output.finish_reason] += 1
            if output.index == 0:
                self.prompt_tokens += len(output.prompt_token_ids)
                self.cache_hit_tokens += output.num_cached_tokens

    def render(self, engine, loop) -> str:
        """The exposition text: these counters, the engine's figures and the loop's gauges."""
        stats = engine.stats
        per_chunk = stats["bytes_per_chunk"]
        retained = stats["retained_chunks"]
        running = loop.num_running
        with self._lock:
            lines = []
            _family(
                lines,
                "requests_total",
                "counter",
                "Engine requests accepted (one per prompt).",
                [({"endpoint": e}, n) for e, n in sorted(self.requests.items())] or [({}, 0)],
            )
            _family(
                lines,
                "request_errors_total",
                "counter",
                "Requests refused with a 4xx error.",
                [({}, self.errors)],
            )
            _family(
                lines,
                "requests_finished_total",
                "counter",
                "Samples finished, by finish reason.",
                [({"reason": r}, n) for r, n in sorted(self.finished.items())] or [({}, 0)],
            )
            _family(
                lines,
                "prompt_tokens_total",
                "counter",
                "Prompt tokens of requests, counted when one ends.",
                [({}, self.prompt_tokens)],
            )
            _family(
                lines,
                "prefix_cache_hit_tokens_total",
                "counter",
                "Prompt tokens served by the prefix cache (not computed), counted when a request ends.",
                [({}, self.cache_hit_tokens)],
            )
            _family(
                lines,
                "generation_tokens_total",
                "counter",
                "Tokens generated.",
                [({}, self.generation_tokens)],
            )
        _family(
            lines,
            "prefill_tokens_computed_total",
            "counter",
            "Prompt tokens computed by prefill.",
            [({}, stats["prefill_tokens_computed"])],
        )
        _family(lines, "requests_running", "gauge", "Requests in the running batch.", [({}, running)])
        _family(
            lines,
            "requests_waiting",
            "gauge",
            "Requests queued, not yet running.",
            [({}, max(0, loop.num_in_flight - running))],
        )
        _family(
            lines,
            "kv_cache_used_bytes",
            "gauge",
            "K/V bytes held by running requests.",
            [({}, (stats["chunks_in_use"] - retained) * per_chunk)],
        )
        _family(
            lines,
            "kv_cache_retained_bytes",
            "gauge",
            "K/V bytes of finished prefixes kept as prefix cache.",
            [({}, retained * per_chunk)],
        )
        _family(
            lines,
            "kv_cache_capacity_bytes",
            "gauge",
            "K/V bytes of the whole pool.",
            [({}, stats["kv_capacity_chunks"] * per_chunk)],
        )
        return "\n".join(lines) + "\n"


def _family(lines: list[str], name: str, kind: str, help_text: str, samples) -> None:
    name = "chunk_llama_" + name
    lines.append(f"# HELP {name} {help_text}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")
