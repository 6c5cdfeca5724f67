"""`patch_model`: one call that makes a transformers causal LM use `ChunkCache`.

The model's `forward` is wrapped (on the instance, like accelerate's hooks), and so
are its `generate` (`hf/generate.py`) and each plain `nn.Linear`'s `forward` (its layers
run the step's linear path, `ops/cpu/linear.py`, in forwards on a `ChunkCache`, and their
own forward otherwise). Wrapped rather than hooked: forward hooks do not run when a
forward raises a `BaseException` such as `KeyboardInterrupt`, and a step left open
would leave the cache half written. Under stock `generate` the wrapper opens each
step (`begin_rows`) and ends it: committed when the forward completed, rolled back
when it raised. The engine opens and ends its own steps (after choosing tokens).

Linear layers that are not plain: subclasses of `nn.Linear` (bitsandbytes, ...) are
not touched; a layer with accelerate's hook (offloaded weights, brought in by the
hook's pre-forward) or whose weight is a tensor subclass (torchao) runs its own
forward in every call.
"""

from __future__ import annotations

import functools

import torch

from chunk_llama.hf import attention, compat
from chunk_llama.hf.cache import ChunkCache
from chunk_llama.hf.fused import decode_forward
from chunk_llama.hf.fused import layers as fused_layers
from chunk_llama.hf.generate import wrap_generate
from chunk_llama.hf.support import check_dtype, check_supported
from chunk_llama.step import current_step, running

_PLAIN = (torch.nn.Parameter, torch.Tensor)


def _plain_weight(module: torch.nn.Linear) -> bool:
    """A weight the step's linear path can read as it is: a parameter or tensor of torch's
    own class (not a quantized tensor subclass), not offloaded behind accelerate's hook
    (looked up in the instance dict: `hasattr` on a module costs a raised AttributeError)."""
    return type(module._parameters["weight"]) in _PLAIN and "_hf_hook" not in module.__dict__


def _linear_forward(module: torch.nn.Linear, original, x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # (traced: the layer's own forward, for the compiler to see)
        return original(x)
    step = current_step()
    if step is not None and step.linear is not None and _plain_weight(module):
        parameters = module._parameters
        return step.linear(x, parameters["weight"], parameters["bias"])
    return original(x)


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
        step = cache.step
        with running(step):  # what this forward's layers read
            if not owns_step and step.decode is not None and decode_forward.applies(original_forward, kwargs):
                output = decode_forward.run(original_forward.__self__, step, kwargs)
            else:
                output = original_forward(**kwargs)
    except BaseException:
        if owns_step:
            cache.end_step(completed=False)
        raise
    if owns_step:
        cache.end_step(completed=True)
    return output


def decode_logits(model: torch.nn.Module, cache: ChunkCache, kwargs: dict) -> torch.Tensor | None:
    """The logits [rows, 1, vocab] of the engine's decode step that `cache` holds open, as
    `model(**kwargs)` computes them, where its forward is this patch's and
    `decode_forward.applies` (no hook on the model, nor a global one, so the module call
    adds nothing): `decode_forward.logits` without the module call and the output object
    (about 0.1 ms a step at batch 1); None otherwise (call the model)."""
    forward = model.__dict__.get("forward")
    if not (isinstance(forward, functools.partial) and forward.func is _chunk_forward and cache.in_step):
        return None
    step = cache.step
    if step is None or step.decode is None or not decode_forward.applies(forward.args[0], kwargs):
        return None
    with running(step):
        return decode_forward.logits(model, step, kwargs)


def patch_model(model: torch.nn.Module, *, chunk_size: int = 64) -> torch.nn.Module:
    """Route a causal LM's attention through chunk-llama (idempotent); raises ValueError
    naming the feature for a model it cannot run (see `hf.support.check_supported`).

    After patching, `model.generate(...)` keeps the common prefixes of its batch, and of
    its earlier calls, in the model's own `ChunkCache` (`model.chunk_llama_cache`, made on
    first use) where it decodes greedily or samples; other generation modes run stock.
    `model(..., cache=ChunkCache(model))` and `generate(..., cache=...)` take a cache of
    your own. Without a `ChunkCache` the model computes exactly what stock SDPA does. In
    forwards on a `ChunkCache`, float32 linear layers on x86 CPUs run through
    chunk-llama's kernel or oneDNN (see `ops/cpu/linear.py`; `CHUNK_LLAMA_LINEAR=torch` keeps
    `F.linear`). `chunk_size` is the default for caches and engines made for this model.
    """
    check_supported(model.config)
    check_dtype(model.dtype)
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        raise ValueError(f"{model.config.model_type}: attention sinks are not supported by chunk-llama's kernels")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    attention.register()
    if model.config._attn_implementation != attention.ATTN_IMPLEMENTATION:
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    model.chunk_llama_chunk_size = chunk_size
    if not is_patched(model):
        original = model.forward
        # update_wrapper keeps the signature visible (generate inspects forward's parameters)
        model.forward = functools.update_wrapper(functools.partial(_chunk_forward, original), original)
        wrap_generate(model)
        for module in model.modules():
            if type(module) is torch.nn.Linear:  # subclasses (quantized layers) keep their own forward
                module.forward = functools.partial(_linear_forward, module, module.forward)
        fused_layers.fuse_decoder_layers(model)
        model._chunk_llama_patched = True
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_chunk_llama_patched", False))
