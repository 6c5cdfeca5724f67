"""What differs between the transformers releases chunk-llama supports (see pyproject's bounds)."""

from __future__ import annotations

import functools
import inspect


@functools.cache
def _cache_argument_of(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_argument(model) -> str:
    """The name under which `model.forward` takes its KV cache: `cache` from transformers
    5.24 on (`past_key_values` still works there, with a FutureWarning), `past_key_values`
    before."""
    return _cache_argument_of(type(model))


def cache_from(kwargs: dict):
    """The KV cache a forward was called with, under either name."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache
