"""The engine against stock per-request `generate` on tiny random Llamas."""

import copy
import random

import pytest
import torch
from helpers import stock_greedy, tiny_llama
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine


def prompts_with_shared_prefixes(seed=0, num=11):
    rng = random.Random(seed)
    systems = [[rng.randrange(6, 96) for _ in range(n)] for n in (70, 37)]
    prompts = [rng.choice(systems) + [rng.randrange(6, 96) for _ in range(rng.randint(1, 30))] for _ in range(num)]
    prompts.append([rng.randrange(6, 96) for _ in range(17)])
    prompts.append(list(prompts[0]))  # an exact duplicate
    return prompts


@pytest.mark.parametrize("num_kv_heads,max_batch_size,chunk_size", [(4, 3, 16), (2, 5, 16), (1, 32, 64)])
def test_greedy_equals_stock_while_sequences_join_and_leave(num_kv_heads, max_batch_size, chunk_size):
    stock = tiny_llama(num_kv_heads=num_kv_heads, eos=None)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=max_batch_size, chunk_size=chunk_size,
                              kv_cache_bytes=1 << 23)
    prompts = prompts_with_shared_prefixes()
    # EOS: a token some requests produce and others never do, so both finish reasons occur
    no_eos = GenerationConfig(max_new_tokens=30, do_sample=False, pad_token_id=0)
    free_running = [stock_greedy(stock, p, no_eos) for p in prompts]
    eos = next(t for out in free_running for t in out[2:] if any(t not in other for other in free_running))
    config = GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=[95, eos], pad_token_id=0)
    outputs = engine.generate(prompts, config)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == stock_greedy(stock, prompt, config)
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == ("stop" if out.token_ids[-1] in (95, eos) else "length")
    reasons = {o.finish_reason for o in outputs}
    assert reasons == {"stop", "length"}, "the workload must include early EOS"
    stats = engine.stats
    assert stats["peak_batch_size"] == min(max_batch_size, len(prompts))
    assert stats["prefill_tokens_reused"] > 0
    # everything was released: what stays is the retained prefix cache
    assert stats["chunks_in_use"] == stats["retained_chunks"] > 0
    assert engine.cache.tree.evict_all() == stats["retained_chunks"] and engine.cache.pool.num_used == 0
    assert stats["prefill_tokens_computed"] + stats["prefill_tokens_reused"] == sum(map(len, prompts))


def test_output_logits_equal_stock_scores():
    stock = tiny_llama(init=0.1)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22)
    prompts = prompts_with_shared_prefixes(seed=1, num=5)
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True)
    outputs = engine.generate(prompts, config)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = stock.generate(torch.tensor([prompt]), generation_config=config, return_dict_in_generate=True)
        expected = torch.stack([step[0] for step in ref.logits])
        assert out.logits.shape == (12, 96)
        assert (out.logits - expected).abs().max() <= 1e-4


def test_sampling_with_a_seed_is_reproducible_and_independent_of_the_batch():
    model = tiny_llama()
    prompts = prompts_with_shared_prefixes(num=6)
    config = GenerationConfig(max_new_tokens=15, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=123,
                              eos_token_id=None)
    alone = ChunkLlamaEngine(model, max_batch_size=1, kv_cache_bytes=1 << 22).generate(prompts[:1], config)
    batched = ChunkLlamaEngine(model, max_batch_size=8, kv_cache_bytes=1 << 22).generate(prompts, config)
    assert batched[0].token_ids == alone[0].token_ids
    assert len({tuple(o.token_ids) for o in batched}) > 1


def test_prompt_kinds_and_tokenizer_free_errors():
    engine = ChunkLlamaEngine(tiny_llama(), max_batch_size=2, kv_cache_bytes=1 << 22)
    config = GenerationConfig(max_new_tokens=2, do_sample=False)
    out = engine.generate([torch.tensor([7, 8, 9]), (7, 8)], config)
    assert [o.prompt_token_ids for o in out] == [[7, 8, 9], [7, 8]] and out[0].text is None
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(["hello"], config)


@pytest.mark.parametrize(
    "prompt,config,error,match",
    [
        ([], dict(max_new_tokens=2), ValueError, "empty"),
        ([1, 96], dict(max_new_tokens=2), ValueError, "vocabulary"),
        ([1, 2], dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        ([1] * 500, dict(max_new_tokens=20), ValueError, "max_position_embeddings"),
        ([1, 2.5], dict(max_new_tokens=2), TypeError, "ints"),
        (42, dict(max_new_tokens=2), TypeError, "prompt"),
    ],
)
def test_bad_requests_raise_clear_errors(prompt, config, error, match):
    engine = ChunkLlamaEngine(tiny_llama(), max_batch_size=2, kv_cache_bytes=1 << 22)
    with pytest.raises(error, match=match):
        engine.generate([[3, 4], prompt], GenerationConfig(**config))
    # the engine still serves afterwards
    assert len(engine.generate([[3, 4]], GenerationConfig(max_new_tokens=2))[0].token_ids) == 2


def test_bad_engine_arguments_and_closed_engine():
    with pytest.raises(ValueError, match="max_batch_size"):
        ChunkLlamaEngine(tiny_llama(), max_batch_size=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkLlamaEngine(tiny_llama(), chunk_size=-4)
    with pytest.raises(ValueError, match="too small"):
        ChunkLlamaEngine(tiny_llama(), kv_cache_bytes=10)
    per_chunk = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads, 16 tokens, head dim 16, fp32
    engine = ChunkLlamaEngine(tiny_llama(), kv_cache_bytes=20 * per_chunk, chunk_size=16)
    with pytest.raises(ValueError, match="raise kv_cache_bytes"):  # 500 tokens never fit in 320
        engine.generate([[3] * 400], GenerationConfig(max_new_tokens=100))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[3, 4]], GenerationConfig(max_new_tokens=2))


def test_small_memory_budget_preempts_and_still_matches_stock():
    stock = tiny_llama()
    model = copy.deepcopy(stock)
    # room for ~12 chunks of 16 tokens: a few requests at a time
    per_chunk = 2 * 2 * 2 * 16 * 16 * 4
    engine = ChunkLlamaEngine(model, max_batch_size=8, chunk_size=16, kv_cache_bytes=12 * per_chunk)
    rng = random.Random(5)
    prompts = [[rng.randrange(6, 96) for _ in range(rng.randint(10, 40))] for _ in range(10)]
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    outputs = engine.generate(prompts, config)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == stock_greedy(stock, prompt, config)
    assert engine.stats["peak_chunks_used"] <= 12 and engine.stats["preemptions"] > 0
    assert engine.stats["chunks_in_use"] == engine.stats["retained_chunks"]
