"""The linear layers adapters target, made to add the step's LoRA deltas per row.

`lora_linears(model)` lists the layers an adapter may target: the linear layers of the
decoder layers (`nn.Linear`, GGUF blocks in `GGUFLinear`, or either inside a PEFT LoRA
layer), by their names in the transformers model, with their sizes. `attach` wraps such a
layer's forward (on the instance, as `patch_model` wraps the others; idempotent): in a step
whose rows the engine assigned to adapters (`step.lora`, `ops/lora.py`), the layer computes
its base product for all rows, as it would without adapters, then adds each group's delta;
in any other forward it runs as it is. A PEFT LoRA layer in such a step computes its base
layer only (the step's rows say which adapters apply, not PEFT's active one), and PEFT's
own forward everywhere else (stock `generate`, training). Where the CPU's fused decoder
layers run a step (`hf/fused/`), they add the same deltas in their C call, which replaces
the layer's module calls entirely: these wrappers do not run there, and no delta is added
twice.
"""

from __future__ import annotations

import functools
import re
import sys

import torch
from torch import nn

from chunk_llama.gguf.modules import GGUFLinear
from chunk_llama.hf.lora.peft_model import peft_inner
from chunk_llama.ops.lora import add_lora_deltas
from chunk_llama.step import current_step

_IN_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")  # (LM head and embeddings are not targets)
_KEY = "_chunk_llama_lora"  # the attached layer's name, which adapters' factors are keyed by


def peft_linear():
    """PEFT's LoRA linear layer class, or None where PEFT was not imported (no model has one)."""
    if "peft" not in sys.modules:
        return None
    from peft.tuners.lora.layer import Linear

    return Linear


def _base_sizes(module: nn.Module) -> tuple[int, int, torch.device] | None:
    """(in_features, out_features, device) of a layer whose product the wrapper can add to, or None."""
    lora_linear = peft_linear()
    if lora_linear is not None and type(module) is lora_linear:
        module = module.get_base_layer()
    if isinstance(module, nn.Linear):
        return int(module.in_features), int(module.out_features), module.weight.device
    if type(module) is GGUFLinear:
        return int(module.in_features), int(module.out_features), module.blocks.device
    return None


def lora_linears(model: nn.Module) -> dict[str, tuple[int, int, torch.device]]:
    """The linear layers of the model's decoder layers, by name (in the transformers model,
    inside a PeftModel's wrapper), with their (in_features, out_features, device)."""
    out = {}
    for name, module in peft_inner(model).named_modules():
        # (PEFT's own modules inside its LoRA layer: the base layer and the factors)
        if not _IN_DECODER_LAYER.search(name) or ".base_layer" in name or ".lora_" in name:
            continue
        sizes = _base_sizes(module)
        if sizes is not None:
            out[name] = sizes
    return out


def attach(model: nn.Module, names) -> int:
    """Wrap the forward of each named linear layer (module doc); returns how many were newly
    wrapped."""
    inner = peft_inner(model)
    lora_linear = peft_linear()
    wrapped = 0
    for name in names:
        module = inner.get_submodule(name)
        if _KEY in module.__dict__:
            continue
        is_peft = lora_linear is not None and type(module) is lora_linear
        setattr(module, _KEY, name)
        module.forward = functools.partial(_peft_forward if is_peft else _forward, module, module.forward)
        wrapped += 1
    return wrapped


def lora_key(module: nn.Module) -> str | None:
    """The name adapters' factors for `module` are keyed by, where `attach` wrapped it (else
    no adapter applies to it)."""
    return module.__dict__.get(_KEY)


def _forward(module: nn.Module, original, x, *args, **kwargs):
    out = original(x, *args, **kwargs)
    step = current_step()
    rows = None if step is None else step.lora
    if rows is None or not rows.segments:
        return out
    return add_lora_deltas(out, x, rows, module.__dict__[_KEY], step.linear)


def _peft_forward(module: nn.Module, original, x, *args, **kwargs):
    step = current_step()
    rows = None if step is None else step.lora
    if rows is None:
        return original(x, *args, **kwargs)
    out = module.base_layer(x, *args, **kwargs)
    if not rows.segments:
        return out
    return add_lora_deltas(out, x, rows, module.__dict__[_KEY], step.linear)
