"""The online API, prefix retention, admission, sampling options and stop strings."""

import copy
import random
import threading

import pytest
import torch
from helpers import stock_greedy, tiny_llama, tiny_tokenizer
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine
from chunk_llama.kv import ChunkPool, PrefixTree

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
PER_CHUNK_16 = 2 * 2 * 2 * 16 * 16 * 4  # one 16-token chunk of tiny_llama: K+V, 2 layers, 2 heads, d=16, fp32


def run_until_done(engine, deltas_by_request=None):
    outputs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if deltas_by_request is not None:
                deltas_by_request.setdefault(delta.request_id, []).append(delta)
            if delta.finished:
                outputs[(delta.request_id, delta.index)] = delta.output
    return outputs


def random_prompts(seed, num, shared_len=40):
    rng = random.Random(seed)
    shared = [rng.randrange(6, 96) for _ in range(shared_len)]
    return [shared + [rng.randrange(6, 96) for _ in range(rng.randint(1, 20))] for _ in range(num)]


def test_staggered_arrivals_and_aborts_leave_the_others_exact():
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 22)
    config = GenerationConfig(max_new_tokens=12, **GREEDY)
    prompts = random_prompts(0, 7)
    ids, deltas, outputs = [], {}, {}
    for step in range(200):
        if step % 2 == 0 and len(ids) < len(prompts):  # one arrival every other step
            ids.append(engine.add_request(prompts[len(ids)], config))
        if step == 3:
            engine.abort(ids[1])  # running by now
        if step == 5:
            engine.abort(ids[2])  # still waiting behind the batch limit, or running
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
            if delta.finished:
                outputs[delta.request_id] = delta.output
        if len(ids) == len(prompts) and not engine.has_unfinished_requests():
            break
    assert set(outputs) == set(ids)
    for request_id, prompt in zip(ids, prompts):
        out = outputs[request_id]
        streamed = [t for d in deltas[request_id] for t in d.token_ids]
        assert streamed == out.token_ids  # deltas concatenate to the output, nothing twice
        if request_id in (ids[1], ids[2]):
            assert out.finish_reason == "abort"
            assert out.token_ids == stock_greedy(stock, prompt, config)[: len(out.token_ids)]
        else:
            assert out.finish_reason in ("length", "stop")
            assert out.token_ids == stock_greedy(stock, prompt, config)
    assert engine.cache.tree.num_seqs == 0
    with pytest.raises(ValueError, match="unknown request id"):
        engine.abort(10_000)


def test_retained_prefix_is_hit_after_everyone_left():
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22)
    config = GenerationConfig(max_new_tokens=5, **GREEDY)
    first, later = random_prompts(1, 2, shared_len=70)
    engine.generate([first], config)
    assert engine.cache.tree.num_seqs == 0 and engine.stats["retained_chunks"] > 0
    before = engine.stats["prefill_tokens_reused"]
    out = engine.generate([later], config)[0]
    stats = engine.stats
    # the 70 shared tokens: 4 full chunks revived, 6 slots copied from the first request's
    # retained last chunk (a hit too)
    assert stats["prefill_tokens_reused"] - before == 70
    assert stats["prefix_cache_hit_chunks"] == 5
    assert out.token_ids == stock_greedy(stock, later, config)
    no_cache = ChunkLlamaEngine(copy.deepcopy(stock), chunk_size=16, kv_cache_bytes=1 << 22, retain_prefixes=False)
    no_cache.generate([first], config)
    assert no_cache.stats["chunks_in_use"] == 0 and no_cache.stats["retained_chunks"] == 0


def test_eviction_is_least_recently_used_and_leaves_first():
    pool = ChunkPool(num_layers=1, num_kv_heads=1, head_dim=2, chunk_size=4, capacity=5, dtype=torch.float32)
    tree = PrefixTree(pool, retain_prefixes=True)
    tree.insert(0, [1, 2, 3, 4, 5, 6, 7, 8])  # chunks a=[1..4], b=[5..8]
    a, b = tree.chunk_ids(0)
    tree.insert(1, [9, 9, 9, 9])  # chunk c
    (c,) = tree.chunk_ids(1)
    tree.remove(0)
    tree.remove(1)
    assert tree.retained_ids() == [b, a, c]  # oldest first; a child before its parent
    tree.insert(2, [1, 2, 3, 4, 0])  # revives a (a hit), takes one free chunk, d = [0]
    assert tree.num_revived == 1 and tree.retained_ids() == [b, c]
    d = tree.chunk_ids(2)[1]
    tree.remove(2)
    assert tree.retained_ids() == [b, c, d, a]  # its partly filled last chunk d stays too
    assert tree.match_len([1, 2, 3, 4, 0, 5]) == 5  # a and d's one slot shared
    tree.insert(3, [7] * 12)  # 3 chunks: 1 free, then it evicts the oldest leaves, b and c
    assert tree.num_evicted == 2 and tree.retained_ids() == [d, a]
    tree.insert(4, [8] * 4)  # evicts d; a stays
    assert tree.retained_ids() == [a] and tree.match_len([1, 2, 3, 4, 5]) == 4


def test_admission_waits_for_memory_instead_of_failing():
    stock = tiny_llama()
    # 10 chunks of 16: each request needs 4 to 5; at most two run at once
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=8, chunk_size=16, kv_cache_bytes=10 * PER_CHUNK_16)
    rng = random.Random(3)
    prompts = [[rng.randrange(6, 96) for _ in range(rng.randint(30, 45))] for _ in range(6)]
    config = GenerationConfig(max_new_tokens=20, **GREEDY)
    ids = [engine.add_request(p, config) for p in prompts]
    outputs = run_until_done(engine)
    for request_id, prompt in zip(ids, prompts):
        assert outputs[(request_id, 0)].token_ids == stock_greedy(stock, prompt, config)
    assert engine.stats["peak_batch_size"] <= 2 and engine.stats["peak_chunks_used"] <= 10
    # first come, first served: requests start in arrival order
    starts = [outputs[(r, 0)].first_token_time for r in ids]
    assert starts == sorted(starts)


def test_seeded_sampling_is_reproducible_whatever_else_runs():
    model = tiny_llama()
    config = GenerationConfig(max_new_tokens=15, do_sample=True, temperature=0.7, top_k=30, top_p=0.95, min_p=0.01,
                              repetition_penalty=1.3, seed=7, eos_token_id=None)
    prompts = random_prompts(4, 6)
    alone = ChunkLlamaEngine(model, max_batch_size=1, chunk_size=16, kv_cache_bytes=1 << 22).generate(prompts[:1], config)
    engine = ChunkLlamaEngine(model, max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 22)
    other = GenerationConfig(max_new_tokens=9, do_sample=True, temperature=1.3, eos_token_id=None)
    for p in prompts[1:3]:
        engine.add_request(p, other)  # unseeded neighbours, started earlier
    engine.step()
    request_id = engine.add_request(prompts[0], config)
    outputs = run_until_done(engine)
    assert outputs[(request_id, 0)].token_ids == alone[0].token_ids
    unseeded = GenerationConfig(max_new_tokens=15, do_sample=True, eos_token_id=None)
    assert len({tuple(o.token_ids) for o in engine.generate(prompts[:1] * 4, unseeded)}) > 1


def test_num_return_sequences_share_the_prompt():
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 22)
    prompt = random_prompts(5, 1, shared_len=60)[0]
    # top_k=1 sampling is greedy: every child equals stock's greedy output
    top1 = GenerationConfig(max_new_tokens=10, num_return_sequences=3, do_sample=True, top_k=1, eos_token_id=None)
    outs = engine.generate([prompt, prompt[:20]], top1)
    assert [(o.request_id, o.index) for o in outs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    greedy = GenerationConfig(max_new_tokens=10, **GREEDY)
    assert all(o.token_ids == stock_greedy(stock, prompt, greedy) for o in outs[:3])
    prompt_chunks = -(-len(prompt) // 16)
    sampled = GenerationConfig(max_new_tokens=10, num_return_sequences=4, do_sample=True, seed=3, eos_token_id=None)
    fresh = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 22)
    outs = fresh.generate([prompt], sampled)
    assert len({tuple(o.token_ids) for o in outs}) > 1
    # the prompt's full chunks are held once; each child has its own tail chunk (or two)
    assert fresh.stats["peak_chunks_used"] <= (prompt_chunks - 1) + 4 * 2
    # the children compute only the prompt's last token (for their logits)
    assert fresh.stats["prefill_tokens_computed"] == len(prompt) + 3


def test_stop_strings_end_generation_where_the_text_first_contains_them():
    model = tiny_llama(eos=None)
    tokenizer = tiny_tokenizer()
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22)
    prompts = random_prompts(6, 3)
    free = engine.generate(prompts, GenerationConfig(max_new_tokens=25, do_sample=False))
    # a stop string that the first output contains part-way through, spanning two tokens
    words = free[0].text.split()
    stop = f"{words[5]} {words[6][:2]}"
    config = GenerationConfig(max_new_tokens=25, do_sample=False, stop_strings=[stop, "never-there"])
    stopped = engine.generate(prompts, config)
    for full, out in zip(free, stopped):
        ids = full.token_ids
        first = next((n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n])), None)
        if first is None:
            assert out.token_ids == ids and out.finish_reason == "length"
        else:
            assert out.token_ids == ids[:first] and out.finish_reason == "stop"
    assert stopped[0].finish_reason == "stop" and len(stopped[0].token_ids) == 7
    with pytest.raises(TypeError, match="stop_strings"):
        engine.add_request(prompts[0], GenerationConfig(max_new_tokens=2, stop_strings=[""]))


def test_stream_yields_text_that_adds_up_to_the_output():
    engine = ChunkLlamaEngine(tiny_llama(), tiny_tokenizer(), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22)
    prompt = " ".join(f"w{t}" for t in random_prompts(7, 1)[0])
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None)
    other = engine.add_request(prompt, config)  # someone else's request, met by the stream
    pieces = list(engine.stream(prompt, config))
    expected = engine.generate([prompt], config)[0].text
    assert len(pieces) > 1 and "".join(pieces) == expected
    outputs = run_until_done(engine)  # the other request's deltas were kept for step()
    assert outputs[(other, 0)].text == expected


def test_requests_added_from_threads_while_the_loop_runs():
    stock = tiny_llama()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=1 << 22)
    config = GenerationConfig(max_new_tokens=6, **GREEDY)
    prompts = random_prompts(8, 24)
    submitted = {}
    lock = threading.Lock()

    def producer(part):
        for i in part:
            request_id = engine.add_request(prompts[i], config)
            with lock:
                submitted[request_id] = i

    threads = [threading.Thread(target=producer, args=(range(k, 24, 3),)) for k in range(3)]
    for t in threads:
        t.start()
    outputs = {}
    while any(t.is_alive() for t in threads) or engine.has_unfinished_requests():
        for delta in engine.step():
            assert (delta.request_id, delta.index) not in outputs, "a request finished twice"
            if delta.finished:
                outputs[(delta.request_id, delta.index)] = delta.output
    for t in threads:
        t.join()
    assert sorted(r for r, _ in outputs) == sorted(submitted) and len(submitted) == 24
    for request_id, i in submitted.items():
        assert outputs[(request_id, 0)].token_ids == stock_greedy(stock, prompts[i], config)
