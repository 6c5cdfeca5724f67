"""`patch_model`: one call that makes a transformers causal LM use `ChunkCache`.

The model's `forward` is wrapped (on the instance, like accelerate's hooks), and so
is each `nn.Linear`'s (its layers run through `ops/linear.py` in forwards on a
`ChunkCache`, `F.linear` otherwise). Wrapped rather than hooked: forward hooks do not run when a forward raises a `BaseException` such
as `KeyboardInterrupt`, and a step left open would leave the cache half written and
this thread's masks switched off. Under stock `generate` the wrapper opens each
step (`begin_rows`) and ends it: committed when the forward completed, rolled back
when it raised. The engine opens and ends its own steps (after choosing tokens).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from chunk_llama.hf import attention, compat
from chunk_llama.hf.cache import ChunkCache
from chunk_llama.models import check_dtype, check_supported
from chunk_llama.step import current_step, running


def _linear_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    step = current_step()
    if step is not None and step.linear is not None:
        return step.linear(x, module.weight, module.bias)
    return F.linear(x, module.weight, module.bias)


def _chunk_forward(original_forward, *args, **kwargs):
    cache = compat.cache_from(kwargs)
    if not isinstance(cache, ChunkCache):
        return original_forward(*args, **kwargs)
    if args:
        raise TypeError("call a patched model with keyword arguments (input_ids=...) when using ChunkCache")
    # Stock generate: this forward's rows are the sequences and the step is ours to end.
    # The engine prepares its steps itself and ends them after choosing the tokens.
    owns_step = not cache.in_step
    try:
        if owns_step:
            cache.begin_rows(kwargs.get("input_ids"), kwargs.get("attention_mask"))
        kwargs["attention_mask"] = None  # the tree implies the mask
        with running(cache.step):  # what this forward's layers read
            output = original_forward(**kwargs)
    except BaseException:
        if owns_step:
            cache.end_step(completed=False)
        raise
    if owns_step:
        cache.end_step(completed=True)
    return output


def patch_model(model: torch.nn.Module, *, chunk_size: int = 64) -> torch.nn.Module:
    """Route a causal LM's attention through chunk-llama (idempotent); raises ValueError
    naming the feature for a model it cannot run (see `models.check_supported`).

    After patching, `model(..., past_key_values=ChunkCache(model))` and
    `model.generate(..., past_key_values=ChunkCache(model))` use the prefix tree;
    without a `ChunkCache` the model computes exactly what stock SDPA does. In forwards
    on a `ChunkCache`, float32 linear layers on x86 CPUs run through chunk-llama's
    kernel or oneDNN (see `ops/linear.py`; `CHUNK_LLAMA_LINEAR=torch` keeps `F.linear`).
    `chunk_size` is the default for caches and engines made for this model.
    """
    check_supported(model.config)
    check_dtype(model.dtype)
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        raise ValueError(f"{model.config.model_type}: attention sinks are not supported by chunk-llama's kernels")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    attention.register()
    model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    model.chunk_llama_chunk_size = chunk_size
    if not is_patched(model):
        original = model.forward
        # update_wrapper keeps the signature visible (generate inspects forward's parameters)
        model.forward = functools.update_wrapper(functools.partial(_chunk_forward, original), original)
        for module in model.modules():
            if type(module) is torch.nn.Linear:  # subclasses (quantized layers) keep their own forward
                module.forward = functools.partial(_linear_forward, module)
        model._chunk_llama_patched = True
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_chunk_llama_patched", False))
