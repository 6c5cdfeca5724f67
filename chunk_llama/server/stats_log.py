"""The periodic stats line of a busy server (logger `chunk_llama.server`, INFO):

    engine: 52.3 tokens/s generated, 16 running, 3 waiting, KV 41.2% used (12.0% cached prefixes),
    prefix-cache hits 97.8% of prompt tokens

figures over the last interval (`--stats-interval` seconds; 0: never), logged from the
engine loop after a step that produced tokens, so an idle server stays quiet.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("chunk_llama.server")


class StatsLogger:
    """Logs one line per `interval` seconds while steps produce tokens."""

    def __init__(self, metrics, engine, loop, interval: float):
        self.metrics, self.engine, self.loop, self.interval = metrics, engine, loop, interval
        self.last_time = time.monotonic()
        self.last_totals = dict(metrics.totals)

    def maybe_log(self) -> None:
        """Log the line if an interval has passed since the last one (engine loop thread)."""
        now = time.monotonic()
        if self.interval <= 0 or now - self.last_time < self.interval:
            return
        totals = dict(self.metrics.totals)
        delta = {k: totals[k] - self.last_totals[k] for k in totals}
        stats = self.engine.stats
        capacity = max(1, stats["kv_capacity_chunks"])
        running = self.loop.num_running
        hits = f"{delta['cache_hit'] / delta['prompt']:.1%}" if delta["prompt"] else "n/a (no request ended)"
        logger.info("engine: %.1f tokens/s generated, %d running, %d waiting, KV %.1f%% used (%.1f%% cached "
                    "prefixes), prefix-cache hits %s of prompt tokens", delta["generation"] / (now - self.last_time),
                    running, self.loop.num_waiting,
                    100 * (stats["chunks_in_use"] - stats["retained_chunks"]) / capacity,
                    100 * stats["retained_chunks"] / capacity, hits)
        self.last_time, self.last_totals = now, totals
