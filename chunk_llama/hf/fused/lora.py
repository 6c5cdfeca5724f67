"""A step's rows under LoRA adapters as the fused decoder layers take them.

Where the engine assigns adapters per request (`step.lora`, `ops/lora.py`'s `LoraRows`), a
fused layer adds each segment's deltas in its C call (`csrc/cpu/lora.cpp`) instead of
stepping aside for the whole step: the same products the op-by-op path (`hf/lora/layers.py`)
adds after each wrapped projection, and the fused call replaces those module calls
entirely, so a delta is added once. Base rows then compute the same numbers whether or not
adapter rows share their step (batch invariance), and adapter rows get the fused layer's
speed.

An adapter's C table covers a run of layers (`ops/cpu/lora.py`): a plain-loop stack's
(`stack.py`: layer i of the stack is index i, the same table for the stack's one call and
for its layers' own calls, as a prefill makes them), or a lone layer's (index 0). The keys
its factors are looked up by are the projections' names as `hf/lora/layers.py` attached
them (a projection no adapter targets has none), with the rows of a fused qkv or gate_up
projection each part takes. What is made per step (the segments over those tables) is kept
with the step (`per_step.py`).
"""

from __future__ import annotations

from chunk_llama.hf.fused import per_step
from chunk_llama.hf.lora.layers import lora_key
from chunk_llama.ops.cpu import lora as lora_ops

_NO_TARGETS = ((None, 0, 0, 0),) * lora_ops.NUM_TARGETS  # (a layer that does not fuse: nothing to add)


def _targets(described) -> tuple:
    """One layer's `ops/cpu/lora.py` Targets from its description."""
    if described.reason is not None:
        return _NO_TARGETS
    return tuple((lora_key(module), start, stop, int(module.out_features))
                 for module, start, stop in described.spans)


def rows_for(step, scope, described_of) -> "lora_ops.LoraStepRows | str":
    """The step's rows by adapter for a run of layers (`scope`: a Stack, or a lone layer;
    `described_of()` gives its layers' descriptions in its index order), made once per step
    and scope; or why an adapter's factors cannot be read in place (the layers then step
    aside)."""
    state = per_step.of(step)
    made = state.lora.get(id(scope))
    if made is None or made[0] is not scope:
        targets = tuple(_targets(d) for d in described_of())
        made = state.lora[id(scope)] = (scope, lora_ops.step_rows(step.lora.segments, targets))
    return made[1]


def layer_rows(step, layer, described, describe) -> "tuple[lora_ops.LoraStepRows, int] | str":
    """(the step's rows, the layer's index in their tables) for a fused call of `layer` alone
    (described as `described`; `describe(layer)` describes another), or why it steps aside."""
    stack = layer.__dict__.get("_chunk_llama_stack")
    layers = None if stack is None else stack[0].layers()
    if layers is not None and stack[1] < len(layers) and layers[stack[1]] is layer:
        def described_of() -> list:
            # (from layer 0, the stack's own descriptions where none is stale: one check for all)
            known = stack[0].described(layers, described) if stack[1] == 0 else None
            return known or [described if each is layer else describe(each) for each in layers]

        rows, index = rows_for(step, stack[0], described_of), stack[1]
    else:
        rows, index = rows_for(step, layer, lambda: [described]), 0
    return rows if isinstance(rows, str) else (rows, index)
