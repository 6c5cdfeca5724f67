"""Attention kernels over the chunk pool, with backend dispatch.

`tpp_decode_attention` picks the native kernel for the tensors' device (CUDA, or
C++/OpenMP on the CPU) when one is built and supports them, else the PyTorch reference (`reference.py`), which is
also the oracle the native kernels are tested against.
"""

from __future__ import annotations

import torch

from chunk_llama.kv.plan import DecodePlan
from chunk_llama.ops import reference
from chunk_llama.ops.jit import force_reference
from chunk_llama.ops.reference import gather_dense, prefill_attention


def decode_backend(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """'cuda', 'cpu' or 'reference': what `tpp_decode_attention` runs for these tensors."""
    if force_reference():
        return "reference"
    if q.is_cuda:
        from chunk_llama.ops import cuda

        if cuda.supports(q, k_cache):
            return "cuda"
    elif q.device.type == "cpu":
        from chunk_llama.ops import cpu

        if cpu.supports(q, k_cache):
            return "cpu"
    return "reference"


def tpp_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """Decode attention through the tree, one query per sequence.

    q: [num_seqs, num_heads, head_dim] in `plan.seq_ids` order
    k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    returns [num_seqs, num_heads, head_dim]
    """
    backend = decode_backend(q, k_cache)
    if backend == "cuda":
        from chunk_llama.ops.cuda import tpp_decode_attention_cuda

        return tpp_decode_attention_cuda(q, k_cache, v_cache, plan, scale)
    if backend == "cpu":
        from chunk_llama.ops.cpu import tpp_decode_attention_cpu

        return tpp_decode_attention_cpu(q, k_cache, v_cache, plan, scale)
    return reference.tpp_decode_attention(q, k_cache, v_cache, plan, scale)


__all__ = ["decode_backend", "gather_dense", "prefill_attention", "tpp_decode_attention"]
