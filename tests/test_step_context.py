"""A step built once (`step/builder.py`, `step/context.py`): the context a forward's layers
read is complete when built (its backend chosen and planned, its linear path and query dtype
decided) and frozen; what the fused layers remember within a step lives with them; a step's
made plan is refused once the next step is planned; and a batch's decode steps keep their
inputs, writes, plan and plan handle at the same addresses (what CUDA graphs replay)."""

import dataclasses

import pytest
import torch
from helpers import tiny_llama

from chunk_llama import ChunkCache, patch_model
from chunk_llama.hf.fused import per_step
from chunk_llama.ops.cpu.attention import build
from chunk_llama.ops.cpu.planned import CpuPlanned

pytestmark = pytest.mark.skipif(build() is None, reason="the CPU kernels are not available")


def model_and_cache():
    model = patch_model(tiny_llama(head_dim=32))  # (head dim 32: the CPU kernels run it)
    return model, ChunkCache(model, chunk_size=16, kv_cache_bytes=1 << 22)


@torch.no_grad()
def decode_steps(model, cache, num_steps: int):
    """Prefill three sequences sharing a prefix, then `num_steps` decode steps; yields each
    decode step's context after its forward."""
    prompts = [[7] * 20 + [9, 10], [7] * 20 + [11], [8] * 5]
    starts = [cache.add_sequence(i, p) for i, p in enumerate(prompts)]
    ids, positions, last = cache.begin_prefill([0, 1, 2], starts)
    model(input_ids=ids, position_ids=positions, past_key_values=cache, logits_to_keep=last)
    cache.end_step(completed=True)
    lengths = {i: len(p) for i, p in enumerate(prompts)}
    for _ in range(num_steps):
        order = cache.begin_decode({i: 12 for i in lengths}, dict(lengths))
        step = cache.step
        model(input_ids=step.input_ids, position_ids=step.position_ids, past_key_values=cache, logits_to_keep=1)
        cache.end_step(completed=True)
        for i in order:
            lengths[i] += 1
        yield step


def test_a_step_is_built_complete_and_frozen():
    model, cache = model_and_cache()
    step = next(decode_steps(model, cache, 1))
    assert isinstance(step.attention, CpuPlanned) and step.attention.has_writes  # chosen and planned
    assert step.q_dtype is torch.float32 and step.linear is not None and step.is_decode
    assert step.writes.pool_rows.numel() == 3 * cache.pool.num_kv_heads
    for field in dataclasses.fields(step):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(step, field.name, getattr(step, field.name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.fused_writes = ()  # nothing is added to a step after it is built
    state = per_step.of(step)  # (the fused layers' own record of the step)
    assert state.reason is None and state.stack_output is not None


def test_a_steps_calls_are_refused_once_the_next_step_is_planned():
    model, cache = model_and_cache()
    steps = decode_steps(model, cache, 2)
    first = next(steps)
    second = next(steps)
    layer = cache.pool.k[0], cache.pool.v[0]
    q = torch.randn(3, 4, 32)
    assert second.attention.generation == first.attention.generation + 1
    second.attention.run(q, *layer, 0.125)
    with pytest.raises(ValueError, match="plan is stale"):
        first.attention.run(q, *layer, 0.125)


def test_a_batchs_decode_steps_keep_their_addresses():
    """Steps of one batch (no sequence joining or leaving) fill the same buffers in place and
    re-plan the same handle: the addresses a captured graph would bake in do not move."""
    model, cache = model_and_cache()
    steps = list(decode_steps(model, cache, 4))[1:]  # (the first decode step builds the plan)

    def addresses(step):
        return (step.input_ids.data_ptr(), step.position_ids.data_ptr(), step.writes.chunk.data_ptr(),
                step.writes.pool_rows.data_ptr(), step.decode.index.data_ptr(), step.attention._kept[0].pointer,
                step.attention._kept[1].data_ptr())

    assert len({addresses(step) for step in steps}) == 1
    assert [s.attention.generation for s in steps] == list(range(steps[0].attention.generation,
                                                                 steps[0].attention.generation + 3))
    assert cache.num_plan_rebuilds == 1
