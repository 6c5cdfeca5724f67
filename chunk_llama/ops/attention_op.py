"""The decode step's attention as one torch custom op, `torch.ops.chunk_llama.decode_attention`.

Why an op: a captured or compiled decode step must treat attention as one opaque call.
`torch.compile(fullgraph=True)` traces the step's modules into one FX graph; with the
attention a custom op with a fake (meta) implementation, Dynamo records it as one node
(its output's shape from the fake) and never traces the plan, the tree or the ctypes
call behind it, so there is no graph break. The CUDA-graph runner (`engine/graphs.py`)
then splits the graph at these nodes: the pieces between them are captured, the op runs
eagerly between the pieces on the step's host-side plan.

The op stores the layer's new K/V and attends in one call (the store has no output of its
own, so as a separate op a compiler could drop it); it reads the step from this thread's
current step (`step/context.py`), set by whoever runs the forward, exactly as the eager
attention function does. The pool it writes is not an argument: the op is declared with
no mutated arguments because nothing in the traced graph reads the pool; each layer's call
depends on the previous layer's output, so the calls keep their order.

A batch padded to a graph's bucket (`engine/graphs.py`) has more rows than the step: the
step's rows come first, the padding rows store nothing and get zeros.
"""

from __future__ import annotations

import torch

from chunk_llama.step.context import current_step

WARM_UP = object()  # a current step that is not one: the op stores nothing and returns zeros


@torch.library.custom_op("chunk_llama::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                     window: int) -> torch.Tensor:
    """One layer's decode attention on this thread's current step.

    query: [rows, num_heads, 1, head_dim]; key, value: [rows, num_kv_heads, 1, head_dim], the
    layer's new K/V (stored into the step's slots first); rows >= the step's sequences
    (padding rows after them). Returns [rows, 1, num_heads, head_dim], zeros in padding rows.
    """
    step = current_step()
    rows, num_heads, q_len, head_dim = query.shape
    if step is WARM_UP:  # (capturing the pieces around the attention: its values do not matter)
        return query.new_zeros(rows, q_len, num_heads, head_dim)
    if step is None or step.decode is None:
        raise RuntimeError("chunk_llama::decode_attention runs only inside a decode step of a ChunkCache (a "
                           "compiled or captured decode forward run by the engine)")
    num_seqs = step.decode.num_seqs
    if rows < num_seqs:
        raise ValueError(f"decode_attention got {rows} rows for a step of {num_seqs} sequences")
    if rows == num_seqs:
        step.store(layer, key, value)
        return step.attend(layer, query, key, value, scale, window).contiguous()
    real = slice(0, num_seqs)
    step.store(layer, key[real], value[real])
    out = query.new_zeros(rows, q_len, num_heads, head_dim)
    out[real] = step.attend(layer, query[real], key[real], value[real], scale, window)
    return out


@decode_attention.register_fake
def _(query, key, value, layer, scale, window):
    rows, num_heads, q_len, head_dim = query.shape
    return query.new_empty(rows, q_len, num_heads, head_dim)
