"""Chunked prefill: prompts longer than a step's token budget are prefilled in pieces,
interleaved with the decode of running requests, and still equal stock `generate`."""

import copy
import random

import pytest
import torch
from helpers import assert_tree_consistent, fail_next_forward, stock_greedy, tiny_llama, tree_snapshot
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)


def shared_prompts(seed: int, num: int, system_len: int = 45) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(6, 96) for _ in range(system_len)]
    return [system[: rng.randint(0, system_len)] + [rng.randrange(6, 96) for _ in range(rng.randint(1, 40))]
            for _ in range(num)]


def run_all(engine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    return outputs


@pytest.mark.parametrize("budget", [1, 7, 13, 16, 40])
def test_greedy_equals_stock_with_budgets_that_split_prompts_mid_chunk(budget):
    stock = tiny_llama(num_kv_heads=1)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22,
                              max_prefill_tokens=budget)
    prompts = shared_prompts(seed=budget, num=7)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == [stock_greedy(stock, p, GREEDY) for p in prompts]
    stats = engine.stats
    assert stats["prefill_steps"] >= -(-max(map(len, prompts)) // budget)
    assert stats["prefill_tokens_computed"] + stats["prefill_tokens_reused"] == sum(map(len, prompts))
    assert_tree_consistent(engine.cache.tree)


def test_teacher_forced_logits_and_seeded_samples_equal_stock_in_pieces():
    stock = tiny_llama(init=0.1)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 22,
                              max_prefill_tokens=11)
    prompts = shared_prompts(seed=3, num=4)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True)
    for prompt, out in zip(prompts, engine.generate(prompts, config)):
        with torch.no_grad():
            ref = stock.generate(torch.tensor([prompt]), generation_config=config, return_dict_in_generate=True)
        assert (out.logits - torch.stack([step[0] for step in ref.logits])).abs().max() <= 1e-4
    # n samples of a long prompt: one sample is prefilled in pieces, the others join at
    # its last piece and share its chunks; their draws equal stock's with the same seed
    sampled = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=30, num_return_sequences=3, seed=7,
                               eos_token_id=None, pad_token_id=0)
    prompt = prompts[0] + prompts[1]
    outputs = engine.generate([prompt], sampled)
    torch.manual_seed(7)
    with torch.no_grad():
        expected = stock.generate(torch.tensor([prompt]), generation_config=sampled)[:, len(prompt):].tolist()
    assert [o.token_ids for o in outputs] == expected


def test_running_requests_decode_beside_the_pieces_of_a_long_prompt(monkeypatch):
    """Each piece's step is one mixed forward: the short request's next token rides with it."""
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22,
                              max_prefill_tokens=32)
    rng = random.Random(5)
    short = [rng.randrange(6, 96) for _ in range(10)]
    long_prompt = [rng.randrange(6, 96) for _ in range(200)]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    short_id = engine.add_request(short, config)
    engine.step()
    long_id = engine.add_request(long_prompt, config)
    forwards = []
    forward = engine.runner._forward
    monkeypatch.setattr(engine.runner, "_forward", lambda *a, **k: forwards.append(a[0].shape) or forward(*a, **k))
    decode_forward = engine.runner._decode_forward  # (a plain decode step's: none is expected here)
    monkeypatch.setattr(engine.runner, "_decode_forward",
                        lambda step: forwards.append(step.input_ids.shape) or decode_forward(step))
    short_tokens, long_tokens = [], []
    for _ in range(-(-200 // 32)):  # 32-token pieces
        deltas = {d.request_id: d for d in engine.step()}
        short_tokens.append(len(deltas[short_id].token_ids))
        long_tokens.append(len(deltas[long_id].token_ids) if long_id in deltas else 0)
    # the short request got a token in every step while the long prompt went in pieces,
    # in one forward per step with the piece; the long one its first in the last piece's step
    assert short_tokens == [1] * 7 and long_tokens == [0] * 6 + [1]
    assert forwards == [(1, 33)] * 6 + [(1, 200 - 6 * 32 + 1)]
    outputs = run_all(engine)
    assert outputs[long_id].token_ids == stock_greedy(stock, long_prompt, config)
    assert outputs[short_id].token_ids == stock_greedy(stock, short, config)


@pytest.mark.parametrize("exception", [RuntimeError, KeyboardInterrupt])
def test_a_failed_piece_leaves_the_partial_prompt_as_it_was(exception):
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22,
                              max_prefill_tokens=24)
    rng = random.Random(9)
    prompt = [rng.randrange(6, 96) for _ in range(100)]
    request_id = engine.add_request(prompt, GREEDY)
    engine.step()
    engine.step()  # two pieces in the tree, 48 tokens
    tree = engine.cache.tree
    before = tree_snapshot(tree)
    state = (list(engine.scheduler.partial), engine.stats["prefill_tokens_computed"])

    fail_next_forward(engine.model, exception)
    with pytest.raises(exception, match="injected"):
        engine.step()
    assert tree_snapshot(tree) == before
    assert (list(engine.scheduler.partial), engine.stats["prefill_tokens_computed"]) == state
    assert run_all(engine)[request_id].token_ids == stock_greedy(stock, prompt, GREEDY)
    assert_tree_consistent(tree)


def test_aborting_or_preempting_a_partial_prompt_frees_its_chunks():
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22,
                              max_prefill_tokens=20)
    rng = random.Random(11)
    prompt = [rng.randrange(6, 96) for _ in range(90)]
    request_id = engine.add_request(prompt, GREEDY)
    engine.step()
    engine.step()
    engine.abort(request_id)
    deltas = engine.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [(request_id, "abort")]
    assert not engine.scheduler.partial and not engine.cache.tree.seq_ids
    # the 40 prefilled tokens stay as a prefix cache: two full chunks and the partly filled third
    assert engine.cache.tree.num_retained == 3
    assert_tree_consistent(engine.cache.tree)
    # a preempted partial prompt goes back to the queue and comes back mostly cached
    other = engine.add_request(prompt[:30], GREEDY)
    again = engine.add_request(prompt, GREEDY)
    engine.step()  # `other` is prefilled (its 30 tokens are mostly cached) and `again` starts
    assert [s.request_id for s in engine.scheduler.partial] == [again]
    victims = engine.scheduler.preempt_newest()
    assert [v.request_id for v in victims] == [again] and list(engine.scheduler.waiting) == victims
    outputs = run_all(engine)
    assert outputs[again].token_ids == stock_greedy(stock, prompt, GREEDY)
    assert outputs[other].token_ids == stock_greedy(stock, prompt[:30], GREEDY)
    assert_tree_consistent(engine.cache.tree)


def test_prompts_up_to_max_position_embeddings():
    stock = tiny_llama(max_position_embeddings=2048)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=2, chunk_size=64, kv_cache_bytes=1 << 24,
                              max_prefill_tokens=512)
    rng = random.Random(13)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    prompt = [rng.randrange(6, 96) for _ in range(2048 - 4)]
    assert engine.generate([prompt], config)[0].token_ids == stock_greedy(stock, prompt, config)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([prompt + [7]], config)
