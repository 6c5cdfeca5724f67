"""A bfloat16 or float16 checkpoint loaded on the CPU in float32 (`load_model`,
`gguf_weights.keep_half_precision`): its linear weights and token embedding stay in its
dtype (BF16 / F16 blocks), widened to float32 in registers by the kernel, so the model holds and reads half the bytes and computes with exactly the weights
stock's float32 load has: every other tensor and every decoded weight bit for bit stock's,
logits no further from the float64 truth than stock's float32 ones, greedy tokens equal
through the engine; the state dict (what save_pretrained writes) is stock's; a weight that
is not exactly of the dtype, or not finite, stays float32; `gguf_weights="dequantized"` keeps stock's float32 load."""

import copy

import pytest
import torch
from helpers import tiny_llama, tiny_tokenizer
from test_gguf_weights import weight_bytes
from tolerances import assert_no_worse_than_stock
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig

from chunk_llama import ChunkLlamaEngine, load_model
from chunk_llama.gguf.modules import GGUFEmbedding, GGUFLinear
from chunk_llama.gguf.weights import keep_half_precision
from chunk_llama.ops.cpu.attention import build

pytestmark = pytest.mark.skipif(build() is None, reason="the CPU kernels did not build here")


@pytest.fixture(scope="module", params=[(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)],
                ids=["bfloat16", "float16", "bfloat16-tied"])
def checkpoint(request, tmp_path_factory):
    """A tiny Llama saved in bfloat16 or float16 (head dim 32, MLP 128: widths in whole
    groups of 32) with its tokenizer, its LM head tied or not. (dtype, folder)"""
    dtype, tied = request.param
    folder = tmp_path_factory.mktemp("half")
    model = tiny_llama(head_dim=32, num_heads=4, num_kv_heads=2, tie_word_embeddings=tied)
    model.to(dtype).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return dtype, str(folder)


def test_a_half_precision_checkpoint_keeps_its_weights_in_it(checkpoint, tmp_path):
    dtype, checkpoint = checkpoint
    ours, tokenizer = load_model(checkpoint, dtype="float32")
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    kept = [m for m in ours.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))]
    assert len(kept) == 2 * 7 + 2  # 7 a layer, the embedding, the head
    assert (ours.lm_head.blocks is ours.model.embed_tokens.blocks) == stock.config.tie_word_embeddings
    assert {m.ggml_type for m in kept} == {"BF16" if dtype is torch.bfloat16 else "F16"}
    assert not any(type(m) is nn.Linear for m in ours.modules())
    assert weight_bytes(ours) < 0.55 * weight_bytes(stock)

    stock_modules = dict(stock.named_modules())
    for name, module in ours.named_modules():  # the decoded weights: stock's, bit for bit
        if isinstance(module, (GGUFLinear, GGUFEmbedding)):
            assert torch.equal(module.weight, stock_modules[name].weight), name
    stock_tensors = dict(stock.named_parameters()) | dict(stock.named_buffers())
    for name, tensor in [*ours.named_parameters(), *ours.named_buffers()]:
        if not name.endswith("blocks"):
            assert tensor.dtype == stock_tensors[name].dtype and torch.equal(tensor, stock_tensors[name]), name
    # the state dict (what save_pretrained writes) is the float32 model's: stock's, key for key
    ours_state, stock_state = ours.state_dict(), stock.state_dict()
    assert ours_state.keys() == stock_state.keys()
    assert all(torch.equal(ours_state[key], stock_state[key]) for key in stock_state)
    ours.save_pretrained(tmp_path)  # a checkpoint transformers loads back as stock's float32 model
    saved = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    assert saved.keys() == stock_state.keys() and all(torch.equal(saved[k], stock_state[k]) for k in stock_state)

    ids = torch.tensor([[1, 7, 33, 60, 12, 90, 4, 41]])
    with torch.no_grad():
        truth = copy.deepcopy(stock).double()(ids).logits
        assert_no_worse_than_stock(ours(ids).logits, stock(ids).logits, truth, torch.float32,
                                   what=f"{dtype}-kept logits")
    prompts = [[1, 7, 33, 60, 12], [1, 7, 33, 9]]
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    engine = ChunkLlamaEngine(ours, tokenizer, max_batch_size=2, chunk_size=16, kv_cache_bytes=1 << 22)
    for prompt, out in zip(prompts, engine.generate(prompts, config)):
        with torch.no_grad():
            want = stock.generate(torch.tensor([prompt]), generation_config=config,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert out.token_ids == want[0, len(prompt):].tolist()
    engine.close()


def test_weights_that_are_not_exactly_of_the_dtype_stay_float32(checkpoint):
    dtype, checkpoint = checkpoint
    stock = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        stock.model.layers[0].mlp.up_proj.weight[3, 5] += 1e-6  # no longer a 16-bit value
        stock.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")  # exactly 16-bit, but not a weight to keep
    assert keep_half_precision(stock, dtype) == 2 * 7 + 2 - 2
    assert type(stock.model.layers[0].mlp.up_proj) is nn.Linear and type(stock.model.layers[1].mlp.up_proj) is nn.Linear
    dequantized, _ = load_model(checkpoint, dtype="float32", gguf_weights="dequantized")
    assert not any(isinstance(m, (GGUFLinear, GGUFEmbedding)) for m in dequantized.modules())


@pytest.mark.parametrize("native", [True, False])
def test_auto_loads_a_bfloat16_checkpoint_in_bfloat16_where_the_cpu_computes_it(checkpoint, native, monkeypatch):
    """`dtype="auto"` on the CPU: a bfloat16 checkpoint in bfloat16 (as stock's auto loads it)
    where the CPU multiplies bfloat16 natively, else in float32 with its weights kept 16-bit;
    a float16 checkpoint always the latter. The command line's settings say the same dtype
    before loading."""
    from chunk_llama.ops.cpu import isa
    from chunk_llama.settings import EngineArgs

    dtype, checkpoint = checkpoint
    monkeypatch.setattr(isa, "native_bfloat16", lambda: native)
    model, _ = load_model(checkpoint)
    expected = torch.bfloat16 if native and dtype is torch.bfloat16 else torch.float32
    assert model.dtype == expected
    kept = {m.ggml_type for m in model.modules() if isinstance(m, (GGUFLinear, GGUFEmbedding))}
    assert kept == (set() if expected is torch.bfloat16 else {"BF16" if dtype is torch.bfloat16 else "F16"})
    assert EngineArgs(model=checkpoint, device="cpu").load(announce=False)[0].dtype == expected
