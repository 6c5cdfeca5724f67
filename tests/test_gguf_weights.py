"""GGUF models with their quantized tensors kept in blocks (`gguf/weights.py`): the
default model (Q4_1, a Q8_0 embedding tied to the LM head) and Gemma 3 270M (Q5_0, Q4_K,
Q6_K, Q8_0; in test_gemma3_270m.py, which loads it) against transformers' float32-dequantized
load of the same file: the weights
take about the file's size, teacher-forced logits no further from the float64 truth than
stock's float32 ones (about 1e-4 apart from them), greedy tokens equal through
the engine on a shared prefix; a tensor whose blocks do not decode to transformers' weight
stays float32, with a warning."""

import copy
import logging
import os

import pytest
import torch
from tolerances import assert_no_worse_than_stock
from torch import nn
from transformers import GenerationConfig

from chunk_llama import ChunkLlamaEngine, load_model
from chunk_llama.gguf.modules import GGUFEmbedding, GGUFLinear
from chunk_llama.gguf.weights import keep_gguf_quantized
from chunk_llama.loading import default_model_path

pytestmark = pytest.mark.slow
SYSTEM = os.path.join(os.path.dirname(__file__), "..", "chunk_llama", "examples", "toolqa_flights_system.txt")


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: parameters and buffers, each storage once (tied blocks)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def prompts_with_a_shared_prefix(tokenizer, num_shared: int, bos: bool):
    with open(SYSTEM, encoding="utf-8") as f:
        system = tokenizer(f.read(), add_special_tokens=False).input_ids[:num_shared]
    questions = ["Q: Which airline flies BOS to SFO?\nA:", "Q: What is the delay of DL 10?\nA:"]
    return [([tokenizer.bos_token_id] if bos else []) + system + tokenizer(q, add_special_tokens=False).input_ids
            for q in questions]


def check_against_dequantized(quantized, tokenizer, stock, gguf_file, expected_types, num_shared, bos):
    """`quantized` (blocks kept) computes what `stock` (transformers' float32 load) does."""
    kept = {type(m).__name__ for m in quantized.modules()}
    assert "Linear" not in kept and {"GGUFLinear", "GGUFEmbedding"} <= kept
    assert {m.ggml_type for m in quantized.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))} == expected_types
    file_bytes = os.path.getsize(gguf_file)
    assert weight_bytes(quantized) <= 1.1 * file_bytes, f"{weight_bytes(quantized) / 1e6:.1f} MB of weights " \
                                                        f"for a {file_bytes / 1e6:.1f} MB file"

    prompts = prompts_with_a_shared_prefix(tokenizer, num_shared, bos)
    with torch.no_grad():  # teacher forced, stock forward on all three
        ids = torch.tensor([prompts[0]])
        ours, stock_logits = quantized(ids).logits, stock(ids).logits
        truth = copy.deepcopy(stock).double()(ids).logits  # the same weights in float64
    # The same weights bit for bit (test_quant_linear), float32 in another summation order:
    # no further from the float64 truth than stock's own float32 error, which differs by CPU
    # and ISA (ours is 4.5e-5 from stock's logits with AVX-512, 1.5e-4 with every library
    # held to AVX2, on the default model). On average within 2x, not 1.5x: ours measured
    # 1.6x stock's on Gemma 3 270M (AMD Zen 5), where a prompt's rows go through oneDNN's
    # GEMM and stock's through MKL's, each summing in its own order.
    assert_no_worse_than_stock(ours, stock_logits, truth, torch.float32, mean_factor=2.0,
                               what="GGUF blocks' logits")

    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    engine = ChunkLlamaEngine(quantized, tokenizer, max_batch_size=2, chunk_size=64, kv_cache_bytes=1 << 27)
    outputs = engine.generate(prompts, config)
    assert engine.stats["prefill_tokens_reused"] >= 64
    assert all(f"{t} x" in engine.stats["linear_backend"] for t in expected_types)  # said at start-up
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = stock.generate(torch.tensor([prompt]), generation_config=config,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == ref[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def dequantized_default():
    """The default model as transformers loads it (float32), shared: loading takes ~18 s."""
    return load_model(None, gguf_weights="dequantized")[0]


@pytest.fixture(scope="module")
def quantized_default():
    """The default model as load_model loads it: tensor by tensor, blocks kept (gguf/load.py)."""
    return load_model(None, gguf_weights="quantized")


def test_default_model_keeps_its_blocks_and_computes_what_stock_does(quantized_default, dequantized_default):
    quantized, tokenizer = quantized_default
    stock = dequantized_default
    check_against_dequantized(quantized, tokenizer, stock, default_model_path(), {"Q4_1", "Q8_0"}, 300, bos=False)


def test_a_tensor_that_does_not_decode_to_the_loaded_weight_stays_float32(caplog, quantized_default,
                                                                           dequantized_default):
    model = copy.deepcopy(dequantized_default)
    changed = model.model.layers[3].mlp.up_proj
    with torch.no_grad():
        changed.weight[5, 7] += 1e-3
    with caplog.at_level(logging.WARNING, logger="chunk_llama.gguf.weights"):
        kept = keep_gguf_quantized(model, default_model_path())
    assert type(model.model.layers[3].mlp.up_proj) is nn.Linear  # not replaced
    assert isinstance(model.model.layers[3].mlp.down_proj, GGUFLinear)
    assert kept == {"Q4_1": 209, "Q8_0": 2} and "blk.3.ffn_up.weight" in caplog.text
    # everything else as load_model's tensor-by-tensor load has it (tests/test_gguf_load.py: other families)
    loaded = dict(quantized_default[0].state_dict())
    for key, value in model.state_dict().items():
        if not key.startswith("model.layers.3.mlp.up_proj"):
            assert torch.equal(value, loaded[key]), key


def test_quantized_weights_need_the_cpu_in_float32():
    with pytest.raises(ValueError, match="CPU in float32, not in bfloat16"):
        load_model(None, dtype="bfloat16", gguf_weights="quantized")
    with pytest.raises(ValueError, match="gguf_weights must be one of"):
        load_model(None, gguf_weights="int4")
    model, _ = load_model(None, dtype="bfloat16")  # auto: dequantized, as transformers loads it
    assert any(type(m) is nn.Linear for m in model.modules())
