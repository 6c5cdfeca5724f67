"""Attention dispatch for one layer of a prepared step: store the new K/V, then attend.

Decode (one query per sequence) runs the two-phase-partition kernel over the plan;
prefill runs the new tokens of every sequence of the step against their whole
contexts in one packed call per layer, K/V read in place from the pool.
"""

from __future__ import annotations

import torch

from chunk_llama.hf.step import ForwardStep
from chunk_llama.ops import packed_prefill_attention, tpp_decode_attention


def store_kv(
    step: ForwardStep,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's new K/V of one layer into their slots; returns them flattened,
    [batch * q_len, num_kv_heads, head_dim] each (the prefill may read them instead of the pool).

    k_layer, v_layer: [capacity, num_kv_heads, chunk_size, head_dim]
    key_states, value_states: [batch, num_kv_heads, q_len, head_dim]
    """
    batch, num_kv_heads, q_len, head_dim = key_states.shape
    flat_k = key_states.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
    flat_v = value_states.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
    if step.write_token_index.numel():
        k_layer[step.write_chunk, :, step.write_offset] = flat_k[step.write_token_index]
        v_layer[step.write_chunk, :, step.write_offset] = flat_v[step.write_token_index]
    return flat_k, flat_v


def attend(
    step: ForwardStep, k_layer: torch.Tensor, v_layer: torch.Tensor, query: torch.Tensor, scale: float,
    window: int | None = None, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of the step's queries over the cache of one layer (a query sees its
    `window` latest positions on a sliding-window layer; every earlier one if None).
    new_kv: what `store_kv` returned for this layer in this step, or None.

    query: [batch, num_heads, q_len, head_dim]; returns [batch, q_len, num_heads, head_dim]
    """
    batch, num_heads, q_len, head_dim = query.shape
    if step.is_decode:
        q = query[:, :, 0, :]  # [num_seqs, num_heads, head_dim]
        if step.row_order is not None:
            q = q[step.row_order]
        out = tpp_decode_attention(q.to(k_layer.dtype), k_layer, v_layer, step.plan, scale, window)
        if step.inverse_row_order is not None:
            out = out[step.inverse_row_order]
        return out.to(query.dtype).unsqueeze(1)
    # [batch * q_len, num_heads, head_dim]
    flat_q = query.transpose(1, 2).reshape(batch * q_len, num_heads, head_dim).to(k_layer.dtype)
    out = packed_prefill_attention(flat_q, k_layer, v_layer, step.prefill, scale, window, new_kv)
    return out.view(batch, q_len, num_heads, head_dim).to(query.dtype)
