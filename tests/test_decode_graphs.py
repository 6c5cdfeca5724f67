"""The decode step compiled whole and split at the attention op (`engine/graphs.py`): what the
CPU can check of the CUDA-graph path. `torch.compile(fullgraph=True)` traces the step with no
graph break (the attention is the custom op `chunk_llama::decode_attention`); the split graph's
logits equal the eager forward's; a step's inputs and plan stay at their addresses from step to
step of a bucket; buckets; the eager fallback, logged once. The capture itself runs on CUDA only."""

import logging

import pytest
import torch
from families import FUSED_MODELS, tiny_model
from helpers import stock_greedy, tiny_llama
from transformers import GenerationConfig

import chunk_llama
from chunk_llama import ChunkCache, ChunkLlamaEngine
from chunk_llama.engine.graphs import DecodeGraphs, GraphKey, Piece, bucket_sizes, choose_bucket
from chunk_llama.logs import forget_logged
from chunk_llama.ops.attention_op import decode_attention
from chunk_llama.step import running

PROMPTS = [[1, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] + [20 + i] * (i + 1) for i in range(3)]


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    # the op-by-op forward's linear layers (F.linear), as the traced graph runs them: equal arithmetic
    monkeypatch.setenv("CHUNK_LLAMA_LINEAR", "torch")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_bucket_sizes_and_choice():
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert bucket_sizes(5) == (1, 2, 4, 5)
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(8, [4, 2, 4]) == (2, 4)
    assert [choose_bucket((1, 2, 4, 8), n) for n in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]
    for bad in ([], [0], [2, -1], [1.5], [True]):
        with pytest.raises(ValueError, match="graph batch sizes must be positive integers"):
            bucket_sizes(8, bad)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
        DecodeGraphs(tiny_llama(), 4, capture=True)


def _decode_step(model, cache, positions, token=3):
    """A decode step of every sequence (opened, not ended): its context."""
    order = cache.begin_decode({s: token + s for s in positions}, positions)
    return cache.step, order


def _prefilled(model):
    cache = ChunkCache(model, chunk_size=4, kv_cache_bytes=1 << 22)
    starts = [cache.add_sequence(i, p) for i, p in enumerate(PROMPTS)]
    ids, pos, last = cache.begin_prefill(list(range(len(PROMPTS))), starts)
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, cache=cache, logits_to_keep=last)
    cache.end_step(True)
    return cache


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])  # gemma: a rotary per layer type, soft-capped logits
def test_compiled_step_has_no_graph_break_and_equals_eager(name):
    model = tiny_llama() if name == "llama" else tiny_model(FUSED_MODELS, name)
    chunk_llama.patch_model(model, chunk_size=4)
    cache = _prefilled(model)
    positions = {i: len(p) for i, p in enumerate(PROMPTS)}
    graphs = DecodeGraphs(model, 4, sizes=[4])
    for _ in range(3):  # eager, then the same step again through the graph (rolled back between)
        step, _ = _decode_step(model, cache, positions)
        with torch.no_grad():
            eager = model(input_ids=step.input_ids, position_ids=step.position_ids, cache=cache,
                          logits_to_keep=1).logits[:, -1]
        cache.end_step(False)
        step, _ = _decode_step(model, cache, positions)
        with torch.no_grad():
            logits = graphs.run(step)
        cache.end_step(True)  # (its K/V are the eager step's, so the next step reads the same context)
        positions = {s: n + 1 for s, n in positions.items()}
        assert logits.shape == eager.shape == (3, model.config.vocab_size)
        torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    # one graph, run for the 4-row bucket (3 rows padded), split at each layer's attention
    assert graphs.keys == {GraphKey(4, torch.float32, torch.device("cpu"))}
    (split, num_attention), = graphs.splits
    assert num_attention == model.config.num_hidden_layers
    assert sum(isinstance(m, Piece) for m in split.children()) == num_attention + 1
    assert graphs.counters == dict(graph_steps=3, eager_steps=0)


def test_step_buffers_keep_their_addresses_across_steps_of_a_bucket():
    model = chunk_llama.patch_model(tiny_llama(), chunk_size=4)
    cache = _prefilled(model)
    graphs = DecodeGraphs(model, 4, sizes=[4])
    positions = {i: len(p) for i, p in enumerate(PROMPTS)}
    seen, buffers = [], cache._builder.buffers
    for i in range(6):  # (chunks of 4: sequences start new chunks meanwhile, the plan is updated in place)
        step, _ = _decode_step(model, cache, positions)
        with torch.no_grad():
            graphs.run(step)
        cache.end_step(True)
        positions = {s: n + 1 for s, n in positions.items()}
        seen.append((step.input_ids.data_ptr(), step.position_ids.data_ptr(), step.writes.pool_rows.data_ptr(),
                     step.decode.index.data_ptr(), graphs.input_ids.data_ptr(), graphs.position_ids.data_ptr()))
        if i == 0:
            reallocations = buffers.num_reallocations
    assert len(set(seen)) == 1
    assert buffers.num_reallocations == reallocations
    assert cache.num_plan_rebuilds == 1 and cache.num_plan_updates >= 1


def test_engine_with_graphs_gives_stock_tokens_as_sequences_join_and_leave():
    model = tiny_llama(head_dim=64)  # (the CPU kernel runs the attention between the pieces)
    config = GenerationConfig(max_new_tokens=7, do_sample=False)
    expected = [stock_greedy(model, p, config) for p in PROMPTS + PROMPTS[:2]]
    engine = ChunkLlamaEngine(model, max_batch_size=4, chunk_size=4, kv_cache_bytes=1 << 22)
    engine.runner.graphs = DecodeGraphs(model, 4, sizes=[1, 2, 4])
    configs = [GenerationConfig(max_new_tokens=n, do_sample=False) for n in (7, 3, 5, 7, 2)]
    results = engine.generate(PROMPTS + PROMPTS[:2], configs)
    assert [r.token_ids for r in results] == [e[:c.max_new_tokens] for e, c in zip(expected, configs)]
    assert engine.runner.graphs.counters["graph_steps"] > 0
    assert {key.rows for key in engine.runner.graphs.keys} <= {1, 2, 4}


def test_steps_outside_the_graphs_run_eager_and_say_why_once(caplog):
    forget_logged()
    model = chunk_llama.patch_model(tiny_llama(), chunk_size=4)
    cache = _prefilled(model)
    graphs = DecodeGraphs(model, 2, sizes=[1, 2])
    positions = {i: len(p) for i, p in enumerate(PROMPTS)}
    with caplog.at_level(logging.INFO, logger="chunk_llama.engine.graphs"):
        for _ in range(2):
            step, _ = _decode_step(model, cache, positions)
            assert graphs.run(step) is None  # 3 sequences, the largest graph holds 2
            cache.end_step(False)
    said = [r.getMessage() for r in caplog.records if "runs eager" in r.getMessage()]
    assert said == ["chunk-llama: a decode step runs eager, without graphs: a batch of more than 2 sequences "
                    "(the largest graph's)"]
    assert graphs.counters == dict(graph_steps=0, eager_steps=2) and not graphs.splits
    handle = model.model.layers[0].register_forward_hook(lambda *args: None)
    assert "forward hooks" in DecodeGraphs(model, 4).unsupported
    handle.remove()
    model.train()
    assert DecodeGraphs(model, 4).unsupported == "the model is in training mode"


def test_warm_up_compiles_every_bucket_and_the_op_refuses_a_forward_without_a_step():
    model = chunk_llama.patch_model(tiny_llama(), chunk_size=4)
    graphs = DecodeGraphs(model, 2)
    figures = graphs.warm_up()
    assert figures["buckets"] == [1, 2] and figures["captured"] is False and figures["seconds"] > 0
    assert sorted(key.rows for key in graphs.keys) == [1, 2]
    assert len(graphs.splits) == 2  # rows dynamic, then 1 row (which Dynamo specialises)
    q, kv = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="only inside a decode step"):
        decode_attention(q, kv, kv, 0, 0.25, 0)
    cache = _prefilled(model)
    step, _ = _decode_step(model, cache, {i: len(p) for i, p in enumerate(PROMPTS)})
    with running(step), pytest.raises(ValueError, match="got 1 rows for a step of 3 sequences"):
        decode_attention(q, kv, kv, 0, 0.25, 0)
    cache.end_step(False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a CUDA GPU only")
def test_cuda_graphs_replay_the_eager_engine_tokens():
    model = tiny_llama(head_dim=64, dtype=torch.bfloat16).to("cuda")
    prompts = PROMPTS + PROMPTS[:2]
    config = GenerationConfig(max_new_tokens=9, do_sample=False)
    eager = ChunkLlamaEngine(model, max_batch_size=4, chunk_size=64, kv_cache_bytes=1 << 24, enforce_eager=True)
    expected = [r.token_ids for r in eager.generate(prompts, config)]
    assert eager.runner.graphs is None
    eager.close()
    engine = ChunkLlamaEngine(model, max_batch_size=4, chunk_size=64, kv_cache_bytes=1 << 24, enforce_eager=False)
    graphs = engine.runner.graphs
    assert graphs.capture and sorted(k.rows for k in graphs.keys) == [1, 2, 4]
    pieces = [m for split, _ in graphs.splits for m in split.children() if isinstance(m, Piece)]
    assert pieces and all(None not in p.graphs.values() for p in pieces)  # captured at start-up
    assert sum(len(p.graphs) for p in pieces) == 3 * (model.config.num_hidden_layers + 1)  # one per bucket
    assert [r.token_ids for r in engine.generate(prompts, config)] == expected
    assert graphs.counters["graph_steps"] > 0 and graphs.counters["eager_steps"] == 0
