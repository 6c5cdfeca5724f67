"""The engine in half precision on the CPU against stock transformers, both judged by the
float32 truth (the same weights in float32), as tests/tolerances.py rules: bf16 runs the
CPU kernels, fp16 the PyTorch reference (the CPU kernels take fp32 and bf16)."""

import copy
import random

import pytest
import torch
from helpers import tiny_llama
from tolerances import STOCK_FACTOR, STOCK_ULPS, assert_no_worse_than_stock, ulp
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_engine_is_no_further_from_the_truth_than_stock(dtype):
    stock = tiny_llama(num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype, init=0.1, eos=None)
    truth_model = copy.deepcopy(stock).float()
    engine = ChunkLlamaEngine(copy.deepcopy(stock), max_batch_size=8, chunk_size=16, kv_cache_bytes=1 << 24)
    rng = random.Random(0)
    system = [rng.randrange(6, 96) for _ in range(40)]
    prompts = [system + [rng.randrange(6, 96) for _ in range(n)] for n in (3, 11, 20, 1, 17, 6)]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, output_logits=True)
    outputs = engine.generate(prompts, config)
    backend = engine.stats["attention_backend"]
    assert backend == "reference" if dtype == torch.float16 else backend.startswith("cpu:"), backend
    assert engine.stats["prefill_tokens_reused"] > 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        sequence = torch.tensor([prompt + out.token_ids])
        steps = slice(len(prompt) - 1, sequence.shape[1] - 1)  # the positions whose logits chose a token
        with torch.no_grad():
            stock_logits = stock(input_ids=sequence).logits[0, steps].double()
            truth = truth_model(input_ids=sequence).logits[0, steps].double()
        ours = out.logits.double()
        assert_no_worse_than_stock(ours, stock_logits, truth, dtype, what=f"request {i}'s logits")
        # each greedy pick is one the truth ranks best, but for a gap smaller than the errors allowed
        band = STOCK_FACTOR * (stock_logits - truth).abs().max() + STOCK_ULPS * ulp(dtype, truth.abs().max())
        chosen = truth.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (chosen >= truth.max(dim=1).values - 2 * band).all(), f"request {i}: a token the truth ranks lower"


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_under_float32_weights_is_nearer_the_truth_than_stock_bfloat16(kv_dtype):
    """`kv_dtype="bfloat16"` or `"float16"` under a float32 model: K/V rounded to it in half the
    bytes, everything else in float32 (the fused layers included). Judged like the
    half-precision engine, by the float32 truth beside stock's bfloat16 on the same weights; a
    float32 pool gives other logits (the rounding took effect)."""
    stock = tiny_llama(num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, init=0.1, eos=None)
    truth_model = copy.deepcopy(stock).float()  # the weights bfloat16 holds, in float32
    rng = random.Random(1)
    system = [rng.randrange(6, 96) for _ in range(40)]
    prompts = [system + [rng.randrange(6, 96) for _ in range(n)] for n in (3, 11, 20, 1, 17, 6)]
    config = GenerationConfig(max_new_tokens=12, do_sample=False, output_logits=True)
    runs = {}
    for name in (kv_dtype, "auto"):
        engine = ChunkLlamaEngine(copy.deepcopy(truth_model), max_batch_size=8, chunk_size=16,
                                  kv_cache_bytes=1 << 24, kv_dtype=name)
        runs[name] = (engine.generate(prompts, config), engine.stats, engine.cache.pool.dtype)
        engine.close()
    outputs, stats, pool_dtype = runs[kv_dtype]
    assert pool_dtype == getattr(torch, kv_dtype) and stats["attention_backend"].startswith("cpu:"), stats
    assert stats["bytes_per_chunk"] * 2 == runs["auto"][1]["bytes_per_chunk"]
    assert stats["kv_capacity_chunks"] >= 2 * runs["auto"][1]["kv_capacity_chunks"] - 1  # the same budget
    assert stats["prefill_tokens_reused"] > 0
    differ = 0
    for i, (prompt, out, wide) in enumerate(zip(prompts, outputs, runs["auto"][0])):
        sequence = torch.tensor([prompt + out.token_ids])
        steps = slice(len(prompt) - 1, sequence.shape[1] - 1)
        with torch.no_grad():
            stock_logits = stock(input_ids=sequence).logits[0, steps].double()
            truth = truth_model(input_ids=sequence).logits[0, steps].double()
        assert_no_worse_than_stock(out.logits.double(), stock_logits, truth, torch.bfloat16,
                                   what=f"request {i}'s logits")
        differ += not torch.equal(out.logits, wide.logits) if out.token_ids == wide.token_ids else 1
    assert differ, f"a {kv_dtype} pool gave the float32 pool's logits exactly"
