"""Attention and mask functions registered with transformers' interfaces.

Inside a forward on a `ChunkCache` (the patched forward makes its step this thread's
current step, `step/context.py`), attention runs through the tree on that step;
otherwise a patched model behaves exactly like stock SDPA.
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from chunk_llama.ops.attention_op import decode_attention
from chunk_llama.step import current_step

ATTN_IMPLEMENTATION = "chunk_llama"
# the keyword a traced decode forward (`hf/graph_forward.py`) passes its layers: attention is the custom op
DECODE_OP = "chunk_llama_decode_op"


def chunk_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [batch, num_heads, q_len, head_dim]; key, value: the layer's new K/V (what
    `ChunkCache.update` stored) -> ([batch, q_len, num_heads, head_dim], None).

    Called with `chunk_llama_decode_op=True` (the traced decode forward, `hf/graph_forward.py`),
    the attention is the custom op `chunk_llama::decode_attention` (`ops/attention_op.py`),
    which stores the new K/V and attends on the current step when it runs, opaque to a tracer."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or 0
    if kwargs.get(DECODE_OP):
        return decode_attention(query, key, value, module.layer_idx, float(scale), int(window)), None
    step = current_step()
    if step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    # (sliding-window layers pass their window as stock SDPA gets it: Mistral, Qwen2, Gemma 3 ...)
    return step.attend(module.layer_idx, query, key, value, scale, window), None


def chunk_mask(*args, **kwargs):
    """No mask in a forward on a ChunkCache (the tree implies it); stock's SDPA mask otherwise."""
    if current_step() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, chunk_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, chunk_mask)
