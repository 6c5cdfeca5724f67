"""Stock `generate` on a patched model: the prefix cache without asking for it.

`patch_model` wraps the instance's `generate`. A call that decodes greedily or samples
(what a `ChunkCache` runs) and brings no cache of its own runs on the model's own
`ChunkCache` (`model.chunk_llama_cache`, made on first use, prefix retention on), so the
rows of a batch share their common prefixes and later calls (`pipeline` batches, the
next turn of a chat) find the earlier calls' chunks. Each call starts new sequences
(`ChunkCache.start_rows`): a cache is never read as the continuation of the last call.
Modes a `ChunkCache` cannot run (beam search, assisted decoding, ...) run stock, on
transformers' own cache, logged once; with a `ChunkCache` passed explicitly they are a
ValueError before the first forward. Calls on the model's own cache take a lock (one at
a time: a cache serves one generate call).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref

import torch

from chunk_llama.hf import compat
from chunk_llama.hf.cache import ChunkCache
from chunk_llama.logs import log_once

logger = logging.getLogger(__name__)


def wrap_generate(model) -> None:
    """Wrap `model.generate` on the instance (signature kept)."""
    original = model.generate
    model.generate = functools.update_wrapper(functools.partial(_chunk_generate, model, original), original)


# one generate at a time per model (kept here, not on the model: a lock cannot be copied, and
# `copy.deepcopy` of a patched model gives a model of its own, with a lock of its own)
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def _lock_of(model) -> threading.Lock:
    with _LOCKS_LOCK:
        return _LOCKS.setdefault(model, threading.Lock())


def model_cache(model) -> ChunkCache:
    """The model's own `ChunkCache`, made on first use (prefix retention on)."""
    cache = getattr(model, "chunk_llama_cache", None)
    if cache is None:
        cache = model.chunk_llama_cache = ChunkCache(model, chunk_size=model.chunk_llama_chunk_size,
                                                     retain_prefixes=True)
    return cache




def _chunk_generate(model, original, *args, **kwargs):
    from chunk_llama.hf.generation import unsupported_on_chunk_cache

    cache = compat.cache_from(kwargs)
    config = kwargs.get("generation_config", args[1] if len(args) > 1 else None)
    inputs = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    problem = unsupported_on_chunk_cache(model, config, kwargs,
                                         inputs.shape[-1] if isinstance(inputs, torch.Tensor) else None)
    if isinstance(cache, ChunkCache):
        if problem:
            raise ValueError(f"{problem} cannot run on a ChunkCache (beams and drafts would need the cache's "
                             "rows reordered or cropped); pass no cache to run it stock")
        cache.start_rows()
        return original(*args, **kwargs)
    if cache is not None or problem:
        if problem:
            log_once(logger, "chunk-llama: %s runs stock transformers generate, without the prefix cache", problem)
        return original(*args, **kwargs)
    with _lock_of(model):
        cache = model_cache(model)
        cache.start_rows()
        kwargs[compat.cache_argument(model)] = cache
        return original(*args, **kwargs)


def stock_generate(model, *args, **kwargs):
    """Stock transformers `generate` on `model`, patched or not (its class's own method, on
    transformers' own cache): the baseline parity checks compare against."""
    return type(model).generate(model, *args, **kwargs)
