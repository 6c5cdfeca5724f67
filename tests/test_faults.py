"""Fault injection: a step that fails (an exception, `KeyboardInterrupt`, `KVCacheFull`) at
any layer, in prefill or decode, leaves the tree as it was and no later request reads
K/V it left half written; requeued and new requests still equal stock `generate`."""

import copy
import random

import pytest
import torch
from helpers import assert_tree_consistent, stock_greedy, tiny_llama, tree_snapshot
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from chunk_llama import ChunkCache, ChunkLlamaEngine, KVCacheFull, patch_model

GREEDY = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
PER_CHUNK_16 = 2 * 3 * 2 * 16 * 16 * 4  # K+V, 3 layers, 2 KV heads, 16 tokens, d=16, fp32


def shared_prompts(seed: int, num: int, shared_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(6, 96) for _ in range(shared_len)]
    return [shared + [rng.randrange(6, 96) for _ in range(rng.randint(1, 9))] for _ in range(num)]


class FailOnce:
    """A forward hook on one decoder layer that raises `error` once, in the chosen phase,
    after letting `skip` such forwards through."""

    def __init__(self, engine, layer: int, phase: str, error: BaseException, skip: int = 0):
        self.engine, self.phase, self.error, self.skip = engine, phase, error, skip
        self.fired = False
        self.handle = engine.model.model.layers[layer].register_forward_hook(self)

    def __call__(self, module, args, output):
        step = self.engine.cache._step
        if self.fired or step is None or step.is_decode != (self.phase == "decode"):
            return
        if self.skip:
            self.skip -= 1
            return
        self.fired = True
        self.handle.remove()
        raise self.error


def observe_step_starts(engine) -> list[dict]:
    """Snapshots of the tree taken just before each forward's changes to it (admission
    for a prefill, the appends of a decode)."""
    snapshots = []
    admit, begin_decode = engine.scheduler.admit, engine.cache.begin_decode

    def observed_admit():
        snapshots.append(tree_snapshot(engine.cache.tree))
        return admit()

    def observed_begin_decode(tokens_by_seq, positions=None):
        snapshots.append(tree_snapshot(engine.cache.tree))
        return begin_decode(tokens_by_seq, positions)

    engine.scheduler.admit, engine.cache.begin_decode = observed_admit, observed_begin_decode
    return snapshots


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt(), KVCacheFull("injected")],
                         ids=["exception", "keyboard-interrupt", "kv-cache-full"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("layer", [0, 1, 2])
def test_a_failed_step_is_rolled_back_and_its_requests_finish_as_stock(layer, phase, error):
    stock = tiny_llama(num_layers=3, eos=None, seed=layer)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16,
                              kv_cache_bytes=400 * PER_CHUNK_16)
    prompts = shared_prompts(layer, 6)
    expected = [stock_greedy(stock, p, GREEDY) for p in prompts]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    snapshots = observe_step_starts(engine)
    FailOnce(engine, layer, phase, error, skip=1 if phase == "decode" else 0)
    outputs, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            deltas = engine.step()
        except type(error):
            failures += 1
            # exactly as before the failed forward's changes: no chunk of it is findable
            assert tree_snapshot(engine.cache.tree) == snapshots[-1]
            assert_tree_consistent(engine.cache.tree)
            continue
        outputs.update({d.request_id: d.output for d in deltas if d.finished})
    assert failures == 1
    assert [outputs[i].token_ids for i in ids] == expected  # the failed step's requests were requeued
    # later requests over the same prefix (now cached) and the same prompts again
    again = shared_prompts(layer, 9)[3:] + prompts
    assert [o.token_ids for o in engine.generate(again, GREEDY)] == [stock_greedy(stock, p, GREEDY) for p in again]
    assert engine.stats["prefix_cache_hit_chunks"] > 0
    assert engine.cache.tree.num_seqs == 0
    assert_tree_consistent(engine.cache.tree)


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "keyboard-interrupt"])
def test_a_failed_mixed_step_leaves_running_and_admitted_requests_as_they_were(error, monkeypatch):
    """A step that admits prompts while others decode is one forward; if it fails, the
    decoding requests keep their tokens and the admitted go back to the queue."""
    stock = tiny_llama(num_layers=3, eos=None)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=400 * PER_CHUNK_16)
    prompts = shared_prompts(5, 3)
    first = engine.add_request(prompts[0], GREEDY)
    engine.step()
    engine.step()
    later = [engine.add_request(p, GREEDY) for p in prompts[1:]]
    snapshot = tree_snapshot(engine.cache.tree)
    running = [(s.seq_id, list(s.output_ids)) for s in engine.scheduler.running]
    appended = []
    append_tokens = engine.cache.append_tokens
    monkeypatch.setattr(engine.cache, "append_tokens", lambda tokens: appended.append(tokens) or append_tokens(tokens))
    FailOnce(engine, 1, "prefill", error)
    with pytest.raises(type(error)):
        engine.step()
    assert appended and list(appended[0]) == [running[0][0]]  # the failed forward was a mixed one
    assert tree_snapshot(engine.cache.tree) == snapshot and not engine.cache.tree.in_step
    assert [(s.seq_id, list(s.output_ids)) for s in engine.scheduler.running] == running
    assert len(engine.scheduler.waiting) == 2
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    assert [outputs[i].token_ids for i in [first, *later]] == [stock_greedy(stock, p, GREEDY) for p in prompts]
    assert_tree_consistent(engine.cache.tree)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_generate_that_raises_aborts_its_requests_and_the_next_call_equals_stock(phase):
    stock = tiny_llama(num_layers=3, eos=None)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=3, chunk_size=16, kv_cache_bytes=400 * PER_CHUNK_16)
    online = engine.add_request(shared_prompts(9, 1)[0], GREEDY)  # someone else's request, running beside
    prompts = shared_prompts(1, 5)
    FailOnce(engine, 1, phase, RuntimeError("hook bug"), skip=1 if phase == "prefill" else 2)
    with pytest.raises(RuntimeError, match="hook bug"):
        engine.generate(prompts, GREEDY)
    assert_tree_consistent(engine.cache.tree)
    outputs = {}
    while engine.has_unfinished_requests():  # the generate call's requests are gone; the other one finishes
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    assert list(outputs) == [online] and outputs[online].token_ids == stock_greedy(stock, shared_prompts(9, 1)[0], GREEDY)
    assert engine.cache.tree.num_seqs == 0
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [stock_greedy(stock, p, GREEDY) for p in prompts]


class RaiseOnceProcessor(LogitsProcessor):
    """A user's processor with a bug that shows once."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("processor bug")
        return scores


def test_a_failing_processor_rolls_the_step_back_and_seeded_sampling_stays_exact():
    stock = tiny_llama(num_layers=3, eos=None)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=400 * PER_CHUNK_16)
    prompt = shared_prompts(2, 1)[0]
    config = GenerationConfig(max_new_tokens=8, do_sample=True, top_k=20, seed=11, eos_token_id=None, pad_token_id=0)
    request_id = engine.add_request(prompt, config, logits_processor=LogitsProcessorList([RaiseOnceProcessor()]))
    outputs, failures = {}, 0
    while engine.has_unfinished_requests():
        before = tree_snapshot(engine.cache.tree)
        try:
            deltas = engine.step()
        except ValueError:
            failures += 1
            assert tree_snapshot(engine.cache.tree) == before  # the decode step's appends are undone
            continue
        outputs.update({d.request_id: d.output for d in deltas if d.finished})
    assert failures == 1
    torch.manual_seed(11)
    with torch.no_grad():
        out = stock.generate(torch.tensor([prompt]), generation_config=config, attention_mask=torch.ones(1, len(prompt),
                                                                                                          dtype=torch.long))
    assert outputs[request_id].token_ids == out[0, len(prompt):].tolist()


def test_stock_generate_rollback_on_a_full_cache_undoes_the_split():
    model = patch_model(tiny_llama(num_layers=3))
    # rows 0 and 1 fit; row 1 matches 20 tokens of row 0 (row 0's second chunk is split); row 2 does not fit
    base = list(range(6, 46))
    rows = torch.tensor([base, base[:20] + list(range(50, 70)), list(range(10, 50))])
    cache = ChunkCache(model, chunk_size=16, kv_cache_bytes=6 * PER_CHUNK_16)
    with pytest.raises(KVCacheFull):
        model.generate(rows, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert cache.tree.num_seqs == 0 and cache.tree.nodes() == []
    assert cache.pool.num_free == cache.pool.capacity and not cache.tree.in_step
    # the same cache serves a batch that fits, exactly as stock
    stock = tiny_llama(num_layers=3)
    out = model.generate(rows[:2], past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, stock.generate(rows[:2], max_new_tokens=4, do_sample=False))


def test_keyboard_interrupt_in_stock_generate_leaves_the_model_stock_outside_the_cache():
    model = patch_model(tiny_llama(num_layers=3))
    stock = tiny_llama(num_layers=3)
    cache = ChunkCache(model, chunk_size=16, kv_cache_bytes=40 * PER_CHUNK_16)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    handle = model.model.layers[1].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model.generate(torch.tensor([list(range(6, 40))]), past_key_values=cache, max_new_tokens=3, do_sample=False)
    handle.remove()
    assert cache.tree.num_seqs == 0 and cache.pool.num_free == cache.pool.capacity and not cache.in_step
    # a padded batch without a ChunkCache: the mask must be built again, as stock does
    ids = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits,
                              stock(input_ids=ids, attention_mask=mask).logits, atol=1e-5)


def test_decode_tokens_without_room_beside_the_pieces_decode_in_their_own_forward(monkeypatch):
    """When the pool has no room for the decoding requests' next tokens in a mixed step, the
    step prefills alone and they decode right after it (where preemption may make room)."""
    stock = tiny_llama(num_layers=3, eos=None)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=4, chunk_size=16, kv_cache_bytes=400 * PER_CHUNK_16)
    prompts = shared_prompts(6, 2)
    first = engine.add_request(prompts[0], GREEDY)
    engine.step()
    second = engine.add_request(prompts[1], GREEDY)
    append_tokens = engine.cache.append_tokens
    calls = []

    def full_once(tokens):
        calls.append(tokens)
        if len(calls) == 1:
            raise KVCacheFull("injected")
        return append_tokens(tokens)

    monkeypatch.setattr(engine.cache, "append_tokens", full_once)
    forwards = []
    forward = engine.runner._forward
    monkeypatch.setattr(engine.runner, "_forward", lambda *a, **k: forwards.append(a[0].shape) or forward(*a, **k))
    decode_forward = engine.runner._decode_forward  # (a plain decode step's forward)
    monkeypatch.setattr(engine.runner, "_decode_forward",
                        lambda step: forwards.append(step.input_ids.shape) or decode_forward(step))
    deltas = {d.request_id: d for d in engine.step()}
    assert len(forwards) == 2 and forwards[1] == (1, 1)  # the prefill alone, then the decode of the first
    assert len(deltas[first].token_ids) == 1 and len(deltas[second].token_ids) == 1
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({d.request_id: d.output for d in engine.step() if d.finished})
    assert [outputs[first].token_ids, outputs[second].token_ids] == [stock_greedy(stock, p, GREEDY) for p in prompts]
