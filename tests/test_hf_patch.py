"""A patched model against stock transformers on the same weights and tokens."""

import copy
import random

import pytest
import torch
from helpers import tiny_llama
from tolerances import assert_close, assert_no_worse_than_stock
from transformers import GenerationConfig, LlamaConfig

from chunk_llama import ChunkCache, patch_model

GQA_SHAPES = [(4, 4, 16), (6, 2, 64), (2, 1, 128)]  # (heads, kv heads, head dim): MHA, GQA, MQA


def stock_and_patched(**kwargs):
    stock = tiny_llama(**kwargs)
    return stock, patch_model(copy.deepcopy(stock))


@pytest.mark.parametrize("heads,kv_heads,head_dim", GQA_SHAPES)
def test_teacher_forced_logits_through_prefill_and_decode(heads, kv_heads, head_dim):
    """Sequences of different lengths sharing prefixes: every decode step's logits
    equal stock logits on the full sequence."""
    # init 0.1: logits up to ~8, and stock's own incremental decode differs from its
    # full forward by ~1.5e-5, so 1e-4 is a real bound (at init 0.2 stock itself is off by 1.4e-4)
    stock, patched = stock_and_patched(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, init=0.1)
    rng = random.Random(0)
    system = [rng.randrange(6, 96) for _ in range(37)]
    seqs = [system + [rng.randrange(6, 96) for _ in range(n)] for n in (3, 17, 1, 40)]
    seqs.append([rng.randrange(6, 96) for _ in range(23)])  # unrelated: its own tree
    num_decode = 20
    full = [s + [rng.randrange(6, 96) for _ in range(num_decode)] for s in seqs]
    with torch.no_grad():
        expected = [stock(input_ids=torch.tensor([f])).logits[0] for f in full]
    cache = ChunkCache(patched, chunk_size=16, kv_cache_bytes=1 << 22)
    starts = [cache.add_sequence(i, s) for i, s in enumerate(seqs)]
    assert starts[0] == 0 and starts[1] >= 32  # the system prompt is computed once
    input_ids, position_ids, last = cache.begin_prefill(list(range(len(seqs))), starts)
    with torch.no_grad():
        logits = patched(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, logits_to_keep=last).logits[0]
    for i, s in enumerate(seqs):
        assert (logits[i] - expected[i][len(s) - 1]).abs().max() <= 1e-4
    for step in range(num_decode):
        order = cache.begin_decode({i: full[i][len(seqs[i]) + step] for i in range(len(seqs))})
        ids = torch.tensor([[full[i][len(seqs[i]) + step]] for i in order])
        pos = torch.tensor([[len(seqs[i]) + step] for i in order])
        with torch.no_grad():
            out = patched(input_ids=ids, position_ids=pos, past_key_values=cache).logits[:, -1]
        for row, i in enumerate(order):
            assert (out[row] - expected[i][len(seqs[i]) + step]).abs().max() <= 1e-4
    assert cache.num_plan_rebuilds < num_decode  # lengths advance in place between rebuilds


def test_partial_match_shares_the_chunk_in_every_layer():
    """B matches 40 tokens of A (chunk 16): chunks 0-1 and the first 8 slots of A's chunk 2
    are shared, nothing is copied, and B's own tokens go to a fresh chunk; both computed in
    one forward, and B's logits equal stock's on B alone."""
    stock, patched = stock_and_patched()
    a = list(range(6, 56))
    b = a[:40] + [90, 91, 92]
    cache = ChunkCache(patched, chunk_size=16, kv_cache_bytes=1 << 22)
    assert cache.add_sequence(0, a) == 0 and cache.add_sequence(1, b) == 40
    ids, pos, last = cache.begin_prefill([0, 1], [0, 40])
    with torch.no_grad():
        logits = patched(input_ids=ids, position_ids=pos, past_key_values=cache, logits_to_keep=last).logits[0]
        expected = stock(torch.tensor([b])).logits[0, -1]
    a_runs, b_runs = cache.tree.segments(0), cache.tree.segments(1)
    assert a_runs[:2] == b_runs[:2] and a_runs[2] == (b_runs[2][0], 0, 16) and b_runs[2][1:] == (0, 8)
    assert b_runs[3][1:] == (0, 3) and b_runs[3][0] not in cache.tree.chunk_ids(0)
    assert cache.pool.num_used == 5  # a's 4 chunks (50 tokens) and b's own
    torch.testing.assert_close(logits[1], expected, atol=1e-4, rtol=1e-4)


def shared_prefix_logits(dtype, seed=0):
    """Teacher-forced logits of a shared-prefix batch (rows 0 and 2 equal, row 1 parts at 20):
    (ours, stock, truth), ours and stock in `dtype`, truth the same (rounded) weights in float32."""
    stock = tiny_llama(num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype, init=0.1, seed=seed)
    patched = patch_model(copy.deepcopy(stock))
    truth_model = copy.deepcopy(stock).float()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 96, (1, 45), generator=generator).repeat(3, 1)
    ids[1, 20:] = torch.randint(6, 96, (25,), generator=generator)
    with torch.no_grad():
        expected = stock(input_ids=ids).logits.float()
        cache = ChunkCache(patched, chunk_size=16, kv_cache_bytes=1 << 22)
        got = patched(input_ids=ids, past_key_values=cache).logits.float()
        plain = patched(input_ids=ids).logits.float()  # no ChunkCache: stock SDPA path
        truth = truth_model(input_ids=ids).logits.double()
    assert torch.equal(plain, expected)
    assert cache.pool.num_used < 3 * 3  # rows 0 and 2 share all full chunks
    return got, expected, truth


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_logits_on_shared_prefix_batch(dtype):
    """fp32: equal to stock to float32 rounding; half precision: no further from the float32
    truth than stock's own half-precision result (tests/tolerances.py)."""
    got, expected, truth = shared_prefix_logits(dtype)
    if dtype == torch.float32:
        assert_close(got, expected, atol=1e-4, what="fp32 logits against stock")
    else:
        assert_no_worse_than_stock(got, expected, truth, dtype, what=f"{dtype} logits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_half_precision_check_fails_on_a_broken_kernel(dtype, monkeypatch):
    """The check above has teeth: attention whose softmax scale is 5% off (a plausible kernel
    bug that leaves every output finite and plausible) fails it."""
    from chunk_llama.step.context import StepContext

    attend = StepContext.attend
    monkeypatch.setattr(StepContext, "attend",
                        lambda self, layer, query, key, value, scale, window=0:
                        attend(self, layer, query, key, value, scale * 1.05, window))
    got, expected, truth = shared_prefix_logits(dtype)
    with pytest.raises(AssertionError, match="error to the float32 truth"):
        assert_no_worse_than_stock(got, expected, truth, dtype, what=f"{dtype} logits, broken kernel")


@pytest.mark.parametrize("heads,kv_heads,head_dim", GQA_SHAPES)
def test_stock_generate_with_chunk_cache_matches(heads, kv_heads, head_dim):
    stock, patched = stock_and_patched(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
    ids = torch.randint(6, 96, (1, 50)).repeat(3, 1)
    ids[2, 30:] = torch.randint(6, 96, (20,))
    config = GenerationConfig(max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        expected = stock.generate(ids, generation_config=config)
        got = patched.generate(ids, generation_config=config, past_key_values=ChunkCache(patched, chunk_size=16))
    assert torch.equal(got, expected)


def test_num_return_sequences_share_the_prompt():
    stock, patched = stock_and_patched()
    ids = torch.randint(6, 96, (1, 70))
    config = GenerationConfig(max_new_tokens=20, do_sample=True, top_k=0, num_return_sequences=4, pad_token_id=0)
    with torch.no_grad():
        torch.manual_seed(3)
        expected = stock.generate(ids, generation_config=config)
        cache = ChunkCache(patched, chunk_size=16, kv_cache_bytes=1 << 22)
        torch.manual_seed(3)
        got = patched.generate(ids, generation_config=config, past_key_values=cache)
    assert torch.equal(got, expected)
    assert len({tuple(r) for r in got[:, 70:].tolist()}) > 1  # the children really diverged
    # 4 full prompt chunks shared once; each child holds only its own tail (at most 2 chunks)
    assert cache.pool.peak_used <= 4 + 4 * 2


def test_beam_search_raises():
    _, patched = stock_and_patched()
    with pytest.raises(ValueError, match="cannot run on a ChunkCache"):
        patched.generate(torch.randint(6, 96, (1, 8)), num_beams=2, max_new_tokens=3, past_key_values=ChunkCache(patched))


def test_unsupported_architecture_and_settings():
    config = LlamaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    config.sliding_window = 8  # Llama's layers do not pass a window: stock would ignore it
    with pytest.raises(ValueError, match="sliding"):
        ChunkCache(config)
    with pytest.raises(ValueError, match="chunk_size"):
        patch_model(tiny_llama(), chunk_size=0)
    with pytest.raises(ValueError, match="too small"):
        ChunkCache(tiny_llama(), kv_cache_bytes=100)
    with pytest.raises(ValueError, match="dtype"):
        patch_model(tiny_llama(dtype=torch.float64))


def test_patch_is_idempotent_and_keeps_the_forward_signature():
    import inspect

    model = tiny_llama()
    stock_signature = inspect.signature(model.forward)
    assert patch_model(patch_model(model)) is model
    wrapped = model.forward
    assert wrapped.func.__name__ == "_chunk_forward" and wrapped.args[0].__func__ is type(model).forward
    assert inspect.signature(model.forward) == stock_signature  # generate inspects it for attention_mask
