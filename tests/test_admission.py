"""Admission budget, preemption and requeue order, and prefix-cache bookkeeping."""

import copy
import random

import pytest
import torch
from helpers import fail_next_forward, stock_greedy, tiny_llama
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.kv import ChunkPool, PrefixTree

GREEDY = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)


def test_the_prefill_budget_counts_uncached_tokens_only():
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 22,
                              max_prefill_tokens=64)
    rng = random.Random(0)
    long_prompt = [rng.randrange(6, 96) for _ in range(300)]
    engine.generate([long_prompt], GREEDY)  # now cached
    prompts = [long_prompt + [rng.randrange(6, 96) for _ in range(5)] for _ in range(6)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    before = engine.stats["prefill_steps"]
    engine.step()
    # each needs ~5-17 uncached tokens, not 305: all six fit one step's budget of 64
    assert len(engine.scheduler.running) == 6 and engine.stats["prefill_steps"] == before + 1
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    assert [outputs[i].token_ids for i in ids] == [stock_greedy(stock, p, GREEDY) for p in prompts]
    # the budget holds for uncached prompts: a 300-token prompt goes in 64-token pieces
    fresh = [[rng.randrange(6, 96) for _ in range(300)] for _ in range(3)]
    for p in fresh:
        engine.add_request(p, GREEDY)
    computed = engine.stats["prefill_tokens_computed"]
    engine.step()
    assert engine.stats["prefill_tokens_computed"] - computed == 64
    assert not engine.scheduler.running and len(engine.scheduler.partial) == 1


def test_preemption_takes_the_request_that_arrived_last_not_the_last_admitted():
    engine = ChunkLlamaEngine(tiny_llama(), max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 22)
    ids = [engine.add_request([7 + i] * 20, GREEDY) for i in range(3)]
    engine.step()
    scheduler = engine.scheduler
    # the oldest request readmitted after a preemption sits last in the running list
    scheduler.running.append(scheduler.running.pop(0))
    victims = scheduler.preempt_newest()
    assert {v.request_id for v in victims} == {ids[2]} and scheduler.num_preemptions == 1
    victims = scheduler.preempt_newest()
    assert {v.request_id for v in victims} == {ids[1]}
    assert [s.request_id for s in scheduler.waiting] == [ids[1], ids[2]]  # arrival order


def test_a_failed_prefill_requeues_in_arrival_order_ahead_of_later_arrivals():
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 22)
    rng = random.Random(1)
    prompts = [[rng.randrange(6, 96) for _ in range(rng.randint(5, 40))] for _ in range(5)]
    ids = [engine.add_request(p, GREEDY) for p in prompts]

    fail_next_forward(engine.model)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert [s.request_id for s in engine.scheduler.waiting] == ids and not engine.scheduler.running
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    starts = [outputs[i].first_token_time for i in ids]
    assert starts == sorted(starts)  # first come, first served, failure or not
    assert [outputs[i].token_ids for i in ids] == [stock_greedy(stock, p, GREEDY) for p in prompts]


def test_a_partial_match_on_a_retained_chunk_shares_it():
    """A prefix ending inside a retained chunk: the chunk is split where the prompts part
    and revived (a hit, and live again), nothing copied; its other slots stay in place."""
    pool = ChunkPool(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=4, capacity=6, dtype=torch.float32)
    tree = PrefixTree(pool, retain_prefixes=True)
    tree.insert(0, [1, 2, 3, 4])
    tree.insert(1, [5, 6, 7, 8])
    (a,), (b,) = tree.chunk_ids(0), tree.chunk_ids(1)
    tree.remove(0)
    tree.remove(1)
    assert tree.retained_ids() == [a, b] and tree.num_revived == 0
    assert tree.insert(2, [1, 2, 9]) == 2
    assert tree.num_revived == 1 and tree.retained_ids() == [b]
    assert tree.segments(2)[0] == (a, 0, 2) and tree.match_len([1, 2, 3, 4]) == 4  # the rest of a still found
    tree.insert(3, [9] * 12)  # the 3 free chunks
    assert tree.num_evicted == 0
    tree.insert(4, [8] * 4)  # one more: b goes, a is live
    assert tree.num_evicted == 1 and tree.retained_ids() == []
