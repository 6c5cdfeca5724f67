"""Attention and mask functions registered with transformers' interfaces.

When the forward pass carries a `ChunkCache` (the pre-hook installed by
`patch_model` adds it to the layer kwargs as `chunk_cache`), attention runs
through the tree; otherwise a patched model behaves exactly like stock SDPA.
"""

from __future__ import annotations

import threading

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "chunk_llama"

# Depth of forward passes that run on a ChunkCache in this thread: their masks are
# implied by the tree (causal within each sequence), so none is materialised.
_active = threading.local()


def enter_chunk_forward() -> None:
    _active.depth = getattr(_active, "depth", 0) + 1


def exit_chunk_forward() -> None:
    _active.depth = max(0, getattr(_active, "depth", 0) - 1)


def in_chunk_forward() -> bool:
    """Whether this thread is inside a forward pass on a ChunkCache."""
    return getattr(_active, "depth", 0) > 0


def chunk_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [batch, num_heads, q_len, head_dim] -> ([batch, q_len, num_heads, head_dim], None)."""
    cache = kwargs.get("chunk_cache")
    if cache is None or not cache.in_step:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # Sliding-window layers pass their window as stock SDPA gets it (Mistral, Qwen2, Gemma 3 ...)
    return cache.attend(module.layer_idx, query, scale, kwargs.get("sliding_window")), None


def chunk_mask(*args, **kwargs):
    if in_chunk_forward():
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, chunk_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, chunk_mask)
