"""Entry points called from several threads at once: each caller gets exactly its own
results, equal to stock `generate` on each request alone, while others join, leave and
abort; one step runs at a time."""

import copy
import random
import threading

import pytest
import torch
from helpers import stock_greedy, tiny_llama, tiny_tokenizer
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from chunk_llama import ChunkLlamaEngine

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)


def prompt_set(seed: int, num: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(6, 96) for _ in range(rng.randint(20, 50))]
    return [shared + [rng.randrange(6, 96) for _ in range(rng.randint(1, 12))] for _ in range(num)]


def stock_seeded(model, prompt, config, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def run_threads(targets) -> list:
    """Start every target at once (a barrier), join them, re-raise the first error."""
    barrier = threading.Barrier(len(targets))
    results, errors = [None] * len(targets), []

    def run(i, target):
        barrier.wait()
        try:
            results[i] = target()
        except BaseException as error:  # noqa: BLE001 - reported to the test below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, t)) for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("num_threads", [2, 4])
def test_generate_and_stream_from_several_threads_each_get_their_own_results(num_threads):
    stock = tiny_llama()
    tokenizer = tiny_tokenizer()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), tokenizer, max_batch_size=5, chunk_size=16,
                              kv_cache_bytes=1 << 22)
    greedy = [GenerationConfig(max_new_tokens=4 + 3 * i, **GREEDY) for i in range(num_threads)]
    sampled = GenerationConfig(max_new_tokens=9, do_sample=True, top_k=30, seed=21, eos_token_id=None, pad_token_id=0)
    sets = [prompt_set(i, 3 + i) for i in range(num_threads)]
    stream_prompt = " ".join(f"w{t}" for t in prompt_set(99, 1)[0])
    targets = [lambda i=i: engine.generate(sets[i], greedy[i]) for i in range(num_threads)]
    targets.append(lambda: engine.generate(sets[0][:2], sampled))
    targets.append(lambda: list(engine.stream(stream_prompt, greedy[0])))

    online = {}

    def online_producer():  # add_request from another thread, aborting every other one
        for i, prompt in enumerate(prompt_set(50, 6)):
            request_id = engine.add_request(prompt, greedy[0])
            online[request_id] = prompt
            if i % 2:
                engine.abort(request_id)

    targets.append(online_producer)
    results = run_threads(targets)
    for i in range(num_threads):
        outputs = results[i]
        assert [o.token_ids for o in outputs] == [stock_greedy(stock, p, greedy[i]) for p in sets[i]]
        assert len({o.request_id for o in outputs}) == len(sets[i])
    assert [o.token_ids for o in results[num_threads]] == [stock_seeded(stock, p, sampled, 21) for p in sets[0][:2]]
    stream_ids = tokenizer(stream_prompt)["input_ids"]
    assert "".join(results[num_threads + 1]) == tokenizer.decode(stock_greedy(stock, stream_ids, greedy[0]))
    # the online requests went on in the iterations the other callers ran; step() hands over their deltas
    finished = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.request_id in online
            if delta.finished:
                assert delta.request_id not in finished, "a request finished twice"
                finished[delta.request_id] = delta.output
    assert sorted(finished) == sorted(online)
    for request_id, out in finished.items():
        expected = stock_greedy(stock, online[request_id], greedy[0])
        assert out.token_ids == (expected if out.finish_reason != "abort" else expected[: len(out.token_ids)])
    assert engine.cache.tree.num_seqs == 0


class BlockingTokenizer:
    """A tokenizer that waits for an event before tokenizing (a slow one, made deterministic)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.started, self.release = tokenizer, threading.Event(), threading.Event()

    def __call__(self, *args, **kwargs):
        self.started.set()
        assert self.release.wait(timeout=60)
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_request_being_tokenized_counts_as_unfinished():
    tokenizer = BlockingTokenizer(tiny_tokenizer())
    engine = ChunkLlamaEngine(tiny_llama(), tokenizer, max_batch_size=2, chunk_size=16, kv_cache_bytes=1 << 20)
    submitter = threading.Thread(target=engine.add_request, args=("w7 w8 w9", GenerationConfig(max_new_tokens=3)))
    submitter.start()
    assert tokenizer.started.wait(timeout=60)
    assert engine.has_unfinished_requests()  # the README's loop must not end here
    tokenizer.release.set()
    submitter.join()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [d for d in engine.step() if d.finished]
    assert len(outputs) == 1 and len(outputs[0].output.token_ids) == 3


class CallsTheEngine(LogitsProcessor):
    def __init__(self, engine):
        self.engine = engine

    def __call__(self, input_ids, scores):
        self.engine.step()
        return scores


def test_calling_the_engine_from_inside_its_step_raises_instead_of_deadlocking():
    engine = ChunkLlamaEngine(tiny_llama(), max_batch_size=2, chunk_size=16, kv_cache_bytes=1 << 20)
    processors = LogitsProcessorList([CallsTheEngine(engine)])
    with pytest.raises(RuntimeError, match="inside one of its own steps"):
        engine.generate([[7, 8, 9]], GenerationConfig(max_new_tokens=3, **GREEDY), logits_processor=processors)
    assert not engine.has_unfinished_requests() and engine.cache.tree.num_seqs == 0
