"""`copy.deepcopy` of a patched model that has run in an engine (its fused layers described,
its stack found): the copy computes what the original does, from its own tensors, runs stock
`generate` with a lock of its own, and neither sees a change to the other's weights. (A model
whose own cache stock `generate` made, `model.chunk_llama_cache`, does not copy yet.)"""

import copy

import pytest
import torch
from test_fused_layers import GREEDY, fresh_logs, fused_calls, prompts, tiny  # noqa: F401

from chunk_llama import ChunkLlamaEngine
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.attention import build
from chunk_llama.ops.cpu.planned import CpuPlanned

pytestmark = pytest.mark.skipif(build() is None or isa.host_arch() != "x86_64",
                                reason="the fused layers run with the CPU kernels' linear path (x86-64)")


def generate(model, batch):
    engine = ChunkLlamaEngine(model, max_batch_size=3, chunk_size=16, kv_cache_bytes=1 << 23)
    try:
        return engine.generate(batch, GREEDY)
    finally:
        engine.close()


def same(a, b) -> bool:
    return all(x.token_ids == y.token_ids and torch.equal(x.logits, y.logits) for x, y in zip(a, b))


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_copy_of_a_model_that_ran_is_a_model_of_its_own(family, fused_calls):
    model = tiny(family)
    batch = prompts(seed=11)
    first = generate(model, batch)
    twin = copy.deepcopy(model)
    fused_calls.clear()
    CpuPlanned.stack_calls.clear()
    assert same(generate(twin, batch), first)
    assert fused_calls  # the copy's layers fused, described from its own tensors,
    assert CpuPlanned.stack_calls  # and its decode steps ran its own stack in one call
    ids = torch.tensor([batch[0]])
    config = dict(attention_mask=torch.ones_like(ids), generation_config=GREEDY, return_dict_in_generate=True)
    assert torch.equal(twin.generate(ids, **config).sequences, model.generate(ids, **config).sequences)
    with torch.no_grad():
        twin.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    assert not same(generate(twin, batch), first)
    assert same(generate(model, batch), first)  # the original still reads its own weights
