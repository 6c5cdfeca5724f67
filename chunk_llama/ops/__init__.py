"""Attention kernels over the chunk pool.

The engine's forwards choose a backend once per step (`dispatch.py`), plan it (which
returns the step's calls) and run those per layer. The functions here are the same thing
for one call, on tensors: what tests, benchmarks and other callers use, and what
`backend_info` reports.
"""

from __future__ import annotations

import torch

from chunk_llama.ops.dispatch import Geometry, decode_attention, prefill_attention, resolve
from chunk_llama.ops.reference import gather_dense
from chunk_llama.step.buffers import StaticBuffers
from chunk_llama.step.decode_plan import DecodePlan
from chunk_llama.step.prefill_plan import PrefillPlan


def backend_info(device: torch.device, dtype: torch.dtype, head_dim: int, chunk_size: int,
                 kv_dtype: torch.dtype | None = None) -> dict:
    """What decode attention runs for queries of `dtype` over a KV cache of this device,
    `kv_dtype` (default: `dtype`) and geometry: {"backend": "cpu" | "cuda" | "reference",
    "isa": CPU variant or None, "reason": why the reference runs, or None}. Builds nothing;
    a build that failed earlier in this process shows as the reason.
    """
    return resolve(torch.device(device), dtype, kv_dtype or dtype, head_dim, chunk_size, build=False)


def prepare_backend(device: torch.device, dtype: torch.dtype, head_dim: int, chunk_size: int,
                    kv_dtype: torch.dtype | None = None) -> dict:
    """`backend_info`, after building the native kernel it names (so that a timer started
    afterwards does not count the first-use build)."""
    return resolve(torch.device(device), dtype, kv_dtype or dtype, head_dim, chunk_size, build=True)


def check_window(window: int | None) -> int:
    """A layer's sliding window as the kernels take it: 0 for none, else a positive int."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding window must be a positive integer or None, got {window!r}")
    return window


def _geometry(q: torch.Tensor, k_cache: torch.Tensor) -> Geometry:
    return Geometry(q.device, q.dtype, q.shape[1], k_cache.shape[1], q.shape[-1], k_cache.shape[2], k_cache.dtype)


def decode_backend(q: torch.Tensor, k_cache: torch.Tensor, plan: DecodePlan | None = None) -> str:
    """'cuda', 'cpu' or 'reference': what `tpp_decode_attention` runs for these tensors
    (builds the native kernel on first use; a fallback is logged once per reason)."""
    attention = decode_attention(_geometry(q, k_cache), StaticBuffers(q.device), plan is None or plan.aligned)
    return attention.backend.split(":")[0]


def prefill_backend(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """'cpu', 'cuda' or 'reference': what `packed_prefill_attention` runs for these tensors."""
    return prefill_attention(_geometry(q, k_cache), StaticBuffers(q.device)).backend.split(":")[0]


def tpp_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                         scale: float, window: int | None = None) -> torch.Tensor:
    """Decode attention through the tree, one query per sequence.

    q: [num_seqs, num_heads, head_dim] in `plan.seq_ids` order
    k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    window: the layer's sliding window (a query sees its `window` latest positions), or None
    returns [num_seqs, num_heads, head_dim]
    """
    attention = decode_attention(_geometry(q, k_cache), StaticBuffers(q.device), plan.aligned)
    return attention.plan(plan, k_cache.shape[0]).run(q, k_cache, v_cache, scale, check_window(window))


def packed_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan,
                             scale: float, window: int | None = None,
                             new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of every sequence prefilled in a step over its whole context.

    q: [num_q_tokens, num_heads, head_dim], sequence s at rows plan.segments[s][0] ..
    k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    new_kv: the step's K and V ([num_q_tokens, num_kv_heads, head_dim] each, already in the
        pool) as the layer computed them; the CUDA prefill reads them instead of gathering
        from the pool where no sequence has cached positions (the other kernels read the pool)
    returns [num_q_tokens, num_heads, head_dim] (rows of no sequence uninitialised)
    """
    attention = prefill_attention(_geometry(q, k_cache), StaticBuffers(q.device))
    return attention.plan(plan, k_cache.shape[0]).run(q, k_cache, v_cache, scale, check_window(window), new_kv)


__all__ = ["DecodePlan", "Geometry", "PrefillPlan", "backend_info", "check_window", "decode_backend",
           "gather_dense", "packed_prefill_attention", "prefill_backend", "prepare_backend", "tpp_decode_attention"]
