"""An engine decode step's forward without transformers' wrappers (`hf/fused/decode_forward.py`) is
transformers' forward bit for bit, per plain-loop family; a hook on the model, a forward not
transformers' own, or the setting off runs transformers' forward. And the decoder stack's
cached descriptions (`fused_stack.Stack.described`) see what changes in any layer."""

import copy

import pytest
import torch
from test_fused_layers import GREEDY, STACKED, engine_outputs, gguf_model, prompts, tiny

from chunk_llama import ChunkLlamaEngine
from chunk_llama.hf.fused import decode_forward
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.attention import build
from chunk_llama.ops.cpu.planned import CpuPlanned

pytestmark = pytest.mark.skipif(build() is None or isa.host_arch() != "x86_64",
                                reason="the fused layers run with the CPU kernels' linear path (x86-64)")


@pytest.fixture
def bypassed(monkeypatch):
    """Counts the decode steps `decode_forward.logits` computed (for the engine, or for `run`)."""
    calls = []
    logits = decode_forward.logits

    def spy(*args):
        calls.append(1)
        return logits(*args)

    monkeypatch.setattr(decode_forward, "logits", spy)
    return calls


@pytest.mark.parametrize("family", [*STACKED, "llama-gguf"])
def test_the_decode_forward_is_transformers_forward_bit_for_bit(family, monkeypatch, bypassed):
    model = gguf_model("llama")[0] if family == "llama-gguf" else tiny(family)
    batch = prompts(seed=11)[:3]
    outputs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(decode_forward.ENV, setting)
        bypassed.clear()
        outputs[setting] = engine_outputs(copy.deepcopy(model), batch, monkeypatch, fused=True)
        # every decode step (7 per request, 3 requests at a time)
        assert (len(bypassed) >= GREEDY.max_new_tokens - 1) is (setting == "1"), bypassed
    for i, (ours, theirs) in enumerate(zip(outputs["1"], outputs["0"])):
        assert ours.token_ids == theirs.token_ids, f"{family}: request {i}"
        assert torch.equal(ours.logits, theirs.logits), f"{family}: request {i}"


def test_a_hook_on_the_model_or_a_replaced_forward_runs_transformers_forward(monkeypatch, bypassed):
    model = tiny("llama")
    batch = prompts(seed=3)[:2]
    want = [o.token_ids for o in engine_outputs(copy.deepcopy(model), batch, monkeypatch, fused=True)]
    assert bypassed
    bypassed.clear()

    hooked = copy.deepcopy(model)
    seen = []
    hooked.model.register_forward_pre_hook(lambda module, args: seen.append(1))
    assert [o.token_ids for o in engine_outputs(hooked, batch, monkeypatch, fused=True)] == want
    assert not bypassed and len(seen) >= GREEDY.max_new_tokens  # the prefills and every decode step

    forward = type(model.model).forward
    wrapped = []

    def replaced(self, *args, **kwargs):  # what a library patching the class would install
        wrapped.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(model.model), "forward", replaced)
    assert [o.token_ids for o in engine_outputs(copy.deepcopy(model), batch, monkeypatch, fused=True)] == want
    assert not bypassed and len(wrapped) >= GREEDY.max_new_tokens


def test_the_stack_sees_a_change_in_any_layer_between_steps(monkeypatch):
    """The stack checks its layers (but the first) as one snapshot: a hook added to a later
    layer, or to a module inside it, between two decode steps is seen at the next step (the
    hook runs, the stack gives way to a call per layer), as is its removal; and a weight
    replaced there is read at the next step."""
    model = tiny("llama")
    reference = copy.deepcopy(model)  # stock, given the same weight at the same step
    batch = prompts(seed=4)[:1]
    engine = ChunkLlamaEngine(copy.deepcopy(model), max_batch_size=1, chunk_size=16, kv_cache_bytes=1 << 23)
    layer = engine.model.model.layers[1]
    stack_calls = []
    stack_call = CpuPlanned.decoder_stack
    monkeypatch.setattr(CpuPlanned, "decoder_stack",
                        lambda self, *args: stack_calls.append(1) or stack_call(self, *args))
    config = copy.deepcopy(GREEDY)
    config.max_new_tokens = 12

    seen, changes = [], []

    def change(step: int) -> None:  # between decode steps: what the next step must see
        if step == 3:
            changes.append(layer.register_forward_hook(lambda *args: seen.append("layer")))
        elif step == 5:
            changes.pop().remove()
            changes.append(layer.mlp.down_proj.register_forward_hook(lambda *args: seen.append("down_proj")))
        elif step == 7:
            changes.pop().remove()
        elif step == 9:
            with torch.no_grad():
                layer.mlp.down_proj.weight = torch.nn.Parameter(layer.mlp.down_proj.weight * -2.0)

    engine.add_request(batch[0], config)
    step, trace, tokens = 0, [], []
    while engine.has_unfinished_requests():
        change(step)
        before = (len(stack_calls), len(seen))
        for delta in engine.step():
            tokens += delta.token_ids
        trace.append((len(stack_calls) - before[0], tuple(seen[before[1]:])))
        step += 1
    engine.close()
    # step 0 is the prefill; steps 3-4 hooked on the layer, 5-6 inside it: no stack, the hook ran
    assert trace[1:3] == [(1, ())] * 2 and trace[3:5] == [(0, ("layer",))] * 2, trace
    assert trace[5:7] == [(0, ("down_proj",))] * 2 and trace[7:] == [(1, ())] * (len(trace) - 7), trace
    # every token is stock's, teacher-forced, with the new weight from step 9 on
    want = []
    with torch.no_grad():
        for step in range(len(tokens)):
            if step == 9:
                reference.model.layers[1].mlp.down_proj.weight = layer.mlp.down_proj.weight
            ids = torch.tensor([batch[0] + tokens[:step]])
            want.append(int(reference(input_ids=ids).logits[0, -1].argmax()))
    assert tokens == want
