"""Reliability: random join/leave/abort schedules against stock logits, bad input
while others run, a tight memory budget for 200 requests, and a short soak."""

import copy
import os
import random
import sys

import pytest
import torch
from helpers import tiny_llama
from transformers import GenerationConfig

from chunk_llama import ChunkCache, ChunkLlamaEngine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
PER_CHUNK_16 = 2 * 2 * 2 * 16 * 16 * 4


def teacher_forced_logits(model, prompt, generated):
    """Stock logits for each generated position, from one forward over the whole text."""
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_join_leave_abort_schedules_match_stock_logits(seed):
    rng = random.Random(seed)
    stock = tiny_llama(init=0.1, eos=None, seed=seed)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=rng.choice([2, 5, 16]), chunk_size=16,
                              kv_cache_bytes=rng.choice([24, 200]) * PER_CHUNK_16)
    systems = [[rng.randrange(6, 96) for _ in range(rng.randint(10, 80))] for _ in range(3)]
    prompts, outputs = {}, {}
    for _ in range(400):
        if len(prompts) < 20 and rng.random() < 0.4:
            prompt = rng.choice(systems)[: rng.randint(1, 80)] + [rng.randrange(6, 96) for _ in range(rng.randint(0, 12))]
            config = GenerationConfig(max_new_tokens=rng.randint(1, 14), do_sample=False, output_logits=True)
            prompts[engine.add_request(prompt, config)] = prompt
        live = [r for r in prompts if r not in outputs]
        if live and rng.random() < 0.05:
            engine.abort(rng.choice(live))
        for delta in engine.step():
            if delta.finished:
                outputs[delta.request_id] = delta.output
        if len(prompts) == 20 and not engine.has_unfinished_requests():
            break
    assert sorted(outputs) == sorted(prompts)
    for request_id, out in outputs.items():
        if not out.token_ids:
            assert out.finish_reason == "abort"
            continue
        expected = teacher_forced_logits(stock, prompts[request_id], out.token_ids)
        assert (out.logits - expected).abs().max() <= 1e-4
        assert out.token_ids == expected.argmax(-1).tolist()


def with_max_new_tokens(n):
    config = GenerationConfig(max_new_tokens=5)  # its constructor refuses n <= 0; a later assignment does not
    config.max_new_tokens = n
    return config


def test_bad_input_raises_and_the_running_requests_finish_correctly():
    stock = tiny_llama(eos=None)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=24 * PER_CHUNK_16)
    config = GenerationConfig(max_new_tokens=10, do_sample=False)
    good = {engine.add_request(p, config): p for p in ([7, 8, 9] * 10, [7, 8, 9] * 5 + [11])}
    engine.step()
    bad = [
        ([], config, ValueError, "empty prompt"),
        ([3, 96], config, ValueError, "outside the vocabulary"),
        ([3, -1], config, ValueError, "outside the vocabulary"),
        ([3] * 500, GenerationConfig(max_new_tokens=20), ValueError, "max_position_embeddings"),
        ([3], with_max_new_tokens(0), ValueError, "max_new_tokens must be positive"),
        ([3], with_max_new_tokens(-2), ValueError, "max_new_tokens must be positive"),
        ([3] * 100, GenerationConfig(max_new_tokens=1000), ValueError, "max_position_embeddings"),
        ([3] * 300, GenerationConfig(max_new_tokens=200), ValueError, "raise kv_cache_bytes"),
        ("text", config, ValueError, "tokenizer"),
        ([3], "greedy", TypeError, "GenerationConfig"),
        (3.5, config, TypeError, "prompt"),
    ]
    outputs = {}
    for prompt, cfg, error, match in bad:
        with pytest.raises(error, match=match):
            engine.add_request(prompt, cfg)
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    while engine.has_unfinished_requests():
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    assert sorted(outputs) == sorted(good)
    for request_id, prompt in good.items():
        expected = teacher_forced_logits(stock, prompt, outputs[request_id].token_ids).argmax(-1).tolist()
        assert outputs[request_id].token_ids == expected and len(expected) == 10


def test_bad_engine_and_cache_configuration():
    model = tiny_llama()
    for kwargs, error, match in [
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=2.5), TypeError, "chunk_size"),
        (dict(max_batch_size=-1), ValueError, "max_batch_size"),
        (dict(max_prefill_tokens=0), ValueError, "max_prefill_tokens"),
        (dict(kv_cache_bytes=PER_CHUNK_16 - 1, chunk_size=16), ValueError, "too small"),
        (dict(kv_cache_bytes="1GB"), TypeError, "kv_cache_bytes"),
        (dict(kv_dtype="float64"), ValueError, "kv_dtype=float64 under a float32 model on cpu"),
        (dict(kv_dtype="fp8"), ValueError, "kv_dtype must be auto or one of"),
        (dict(kv_dtype=torch.int8), ValueError, "kv_dtype=int8 under a float32 model"),
        (dict(kv_dtype=16), TypeError, "kv_dtype must be a torch.dtype"),
    ]:
        with pytest.raises(error, match=match):
            ChunkLlamaEngine(model, **kwargs)
    # a cache in a dtype the model's cannot use, or made for another dtype: a clear error, not silent casts
    with pytest.raises(ValueError, match="kv_dtype=float64 under a float32 model"):
        ChunkCache(model, chunk_size=16, kv_cache_bytes=1 << 20, kv_dtype=torch.float64)
    cache = ChunkCache(model.config, chunk_size=16, kv_cache_bytes=1 << 20, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 on cpu but this ChunkCache was made for torch.bfloat16"):
        model.generate(torch.tensor([[3, 4, 5]]), past_key_values=cache, max_new_tokens=2, do_sample=False)
    engine = ChunkLlamaEngine(model, chunk_size=16, kv_cache_bytes=1 << 20)
    engine.close()
    for call in (lambda: engine.add_request([3]), engine.step, lambda: engine.generate([[3]])):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_two_hundred_requests_under_a_tight_budget_equal_an_unconstrained_run():
    model = tiny_llama(eos=None)
    rng = random.Random(11)
    systems = [[rng.randrange(6, 96) for _ in range(n)] for n in (120, 75, 40)]
    prompts = [rng.choice(systems) + [rng.randrange(6, 96) for _ in range(rng.randint(5, 60))] for _ in range(200)]
    config = GenerationConfig(max_new_tokens=8, do_sample=False)
    free = ChunkLlamaEngine(copy.deepcopy(model), max_batch_size=32, chunk_size=16, kv_cache_bytes=4000 * PER_CHUNK_16)
    tight = ChunkLlamaEngine(copy.deepcopy(model), max_batch_size=32, chunk_size=16, kv_cache_bytes=24 * PER_CHUNK_16)
    expected = free.generate(prompts, config)
    got = tight.generate(prompts, config)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    stats = tight.stats
    assert stats["peak_chunks_used"] <= 24 and stats["peak_batch_size"] < 8  # only a few at a time
    assert stats["evicted_chunks"] > 0 and stats["prefix_cache_hit_chunks"] > 0
    assert tight.cache.tree.num_live_chunks == 0


def test_short_soak_returns_to_baseline():
    from soak import check, run_soak

    figures = run_soak(num_requests=200, num_prefixes=20, abort_rate=0.15, seed=3)
    assert figures["aborted"] > 0 and figures["lost"] == 0
    assert check(figures) == [], figures
