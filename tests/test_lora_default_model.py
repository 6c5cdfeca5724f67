"""Per-request LoRA on the real default model (SmolLM2-135M-Instruct) with its GGUF blocks kept:
each adapter's delta is added to the blocks kernel's output. Two PEFT adapters (rank 16 on
every linear target, and rank 8 on q/v) and the base in one batch, two system prompts each,
give stock PEFT `generate`'s greedy tokens on the float32 model transformers dequantizes
the same file to."""

from __future__ import annotations

import copy

import pytest
import torch
from lora_adapters import make_adapter, stock_answer, stock_peft
from torch import nn
from transformers import GenerationConfig

import chunk_llama
from chunk_llama import ChunkLlamaEngine
from chunk_llama.gguf.modules import GGUFLinear

pytest.importorskip("peft")
pytestmark = pytest.mark.slow
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def dequantized(model: nn.Module) -> nn.Module:
    """A copy of `model` whose GGUF linear layers are float32 `nn.Linear`s of the weights their
    blocks decode to (what transformers loads the file as), for PEFT to wrap."""
    copied = copy.deepcopy(model)
    for name, module in list(copied.named_modules()):
        if type(module) is GGUFLinear:
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(module.weight)
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            parent, _, child = name.rpartition(".")
            setattr(copied.get_submodule(parent) if parent else copied, child, linear)
    return copied


def test_two_adapters_and_the_base_on_gguf_blocks_equal_stock_peft(tmp_path):
    model, tokenizer = chunk_llama.load_default_model(torch.float32)
    assert isinstance(model.model.layers[0].self_attn.q_proj, GGUFLinear)
    stock_base = dequantized(model).eval()
    folders = {"all": make_adapter(stock_base, str(tmp_path / "all"), seed=1, r=16, lora_alpha=32,
                                   target_modules=ALL),
               "qv": make_adapter(stock_base, str(tmp_path / "qv"), seed=2, r=8, lora_alpha=8,
                                  target_modules=["q_proj", "v_proj"])}
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=8, chunk_size=64, lora_modules=folders)
    systems = ["You answer questions about flights. Be brief. " * 12, "You are a travel agent; list options. " * 12]
    prompts, names = [], []
    for name in (None, "all", "qv"):
        for system in systems:
            prompts.append(tokenizer(system + " Which airport is busiest?")["input_ids"])
            names.append(name)
    config = GenerationConfig(max_new_tokens=8, do_sample=False)
    outputs = engine.generate(prompts, config, adapter=names)
    stock = {name: stock_peft(stock_base, folders.get(name)) for name in (None, "all", "qv")}
    got = [o.token_ids for o in outputs]
    want = [stock_answer(stock[name], prompt, 8)[0] for prompt, name in zip(prompts, names)]
    assert got == want
    assert got[2:4] != got[0:2] and got[4:6] != got[0:2]  # each adapter changes the answers
    # each adapter computed the system prompts' common prefix once, under its own key
    assert set(engine.stats["retained_chunks_by_adapter"]) == {None, "all", "qv"}
