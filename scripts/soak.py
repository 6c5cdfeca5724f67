"""Soak test: many short requests over a few prefixes through the online API, with aborts.

    python scripts/soak.py                       # 2,000 requests, 20 prefixes, tiny random Llama
    python scripts/soak.py --num-requests 200    # the shortened run CI does (tests/test_reliability.py)

Afterwards: no request lost or duplicated, nothing left in the engine, no live
chunk in the pool (and none at all once the prefix cache is evicted), and the
process RSS within 5% of its value after warm-up. Prints the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import psutil
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from chunk_llama import ChunkLlamaEngine


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.2, eos_token_id=5, bos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def run_soak(num_requests: int = 2000, num_prefixes: int = 20, abort_rate: float = 0.1, max_in_flight: int = 48,
             seed: int = 0, kv_cache_bytes: int = 4 << 20) -> dict:
    rng = random.Random(seed)
    engine = ChunkLlamaEngine(tiny_model(seed), max_batch_size=16, chunk_size=16, kv_cache_bytes=kv_cache_bytes)
    prefixes = [[rng.randrange(6, 96) for _ in range(rng.randint(20, 150))] for _ in range(num_prefixes)]
    submitted, finished, aborted = set(), {}, set()
    warm_rss = None
    start = time.perf_counter()
    while len(finished) < num_requests:
        while len(submitted) < num_requests and len(submitted) - len(finished) < max_in_flight:
            prompt = rng.choice(prefixes) + [rng.randrange(6, 96) for _ in range(rng.randint(1, 30))]
            config = GenerationConfig(max_new_tokens=rng.randint(1, 12), do_sample=rng.random() < 0.5,
                                      seed=rng.randrange(1 << 30), eos_token_id=None)
            submitted.add(engine.add_request(prompt, config))
        in_flight = sorted(submitted - set(finished) - aborted)
        if in_flight and rng.random() < abort_rate:
            victim = rng.choice(in_flight)
            engine.abort(victim)
            aborted.add(victim)
        for delta in engine.step():
            if delta.finished:
                if delta.request_id in finished:
                    raise AssertionError(f"request {delta.request_id} finished twice")
                finished[delta.request_id] = delta.finish_reason
        if warm_rss is None and len(finished) >= num_requests // 10:
            warm_rss = rss_bytes()
    seconds = time.perf_counter() - start
    final_rss = rss_bytes()
    tree, pool = engine.cache.tree, engine.cache.pool
    figures = dict(
        requests=num_requests,
        seconds=round(seconds, 1),
        aborted=sum(r == "abort" for r in finished.values()),
        lost=len(submitted - set(finished)),
        unfinished_in_engine=engine.has_unfinished_requests() or engine.scheduler.has_work(),
        live_sequences=tree.num_seqs,
        live_chunks=tree.num_live_chunks,
        retained_chunks=tree.num_retained,
        chunks_in_use_after_evict=(tree.evict_all(), pool.num_used)[1],
        pool_capacity=pool.capacity,
        rss_after_warmup_mib=round(warm_rss / 2**20, 1),
        rss_final_mib=round(final_rss / 2**20, 1),
        rss_growth=round(final_rss / warm_rss - 1, 4),
        prefix_cache_hit_chunks=engine.stats["prefix_cache_hit_chunks"],
        evicted_chunks=engine.stats["evicted_chunks"],
        preemptions=engine.stats["preemptions"],
    )
    return figures


def check(figures: dict) -> list[str]:
    """The soak's pass conditions; returns what failed."""
    problems = []
    if figures["lost"] or figures["unfinished_in_engine"] or figures["live_sequences"] or figures["live_chunks"]:
        problems.append("requests or chunks left behind")
    if figures["chunks_in_use_after_evict"] != 0:
        problems.append("the pool is not back to its baseline (empty)")
    if figures["rss_growth"] > 0.05:
        problems.append(f"RSS grew {figures['rss_growth']:.1%} after warm-up")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--num-prefixes", type=int, default=20)
    parser.add_argument("--abort-rate", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    figures = run_soak(args.num_requests, args.num_prefixes, args.abort_rate, seed=args.seed)
    print(json.dumps(figures, indent=2))
    problems = check(figures)
    print("OK" if not problems else "FAILED: " + "; ".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
