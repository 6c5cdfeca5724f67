"""`patch_model`: one call that makes a transformers Llama model use `ChunkCache`."""

from __future__ import annotations

import torch

from chunk_llama.hf import attention
from chunk_llama.hf.cache import ChunkCache
from chunk_llama.models import check_dtype, check_supported


def _pre_forward(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, ChunkCache):
        return None
    if args:
        raise TypeError("call a patched model with keyword arguments (input_ids=...) when using ChunkCache")
    if not cache.in_step:  # stock generate: rows are sequences
        cache.begin_rows(kwargs.get("input_ids"), kwargs.get("attention_mask"))
    kwargs["attention_mask"] = None  # the tree implies the mask
    kwargs["chunk_cache"] = cache
    attention.enter_chunk_forward()
    return args, kwargs


def _post_forward(module, args, kwargs, output):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, ChunkCache):
        attention.exit_chunk_forward()
        cache.end_step()
    return None


def patch_model(model: torch.nn.Module, *, chunk_size: int = 64) -> torch.nn.Module:
    """Route a Llama-family model's attention through chunk-llama (idempotent).

    After patching, `model(..., past_key_values=ChunkCache(model))` and
    `model.generate(..., past_key_values=ChunkCache(model))` use the prefix tree;
    without a `ChunkCache` the model computes exactly what stock SDPA does.
    `chunk_size` is the default for caches and engines made for this model.
    """
    check_supported(model.config)
    check_dtype(model.dtype)
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    attention.register()
    model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    model.chunk_llama_chunk_size = chunk_size
    if not getattr(model, "_chunk_llama_hooks", None):
        model._chunk_llama_hooks = (
            model.register_forward_pre_hook(_pre_forward, with_kwargs=True),
            model.register_forward_hook(_post_forward, with_kwargs=True, always_call=True),
        )
    return model


def is_patched(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_chunk_llama_hooks", None))
