"""Attention kernels over the chunk pool, with backend dispatch.

`tpp_decode_attention` and `packed_prefill_attention` pick the native kernel for the tensors' device (CUDA, or
C++/OpenMP on the CPU, in the variant `CHUNK_LLAMA_CPU_ISA` selects) when one is built
and supports them, else the PyTorch reference (`reference.py`), which is also the
oracle the native kernels are tested against. Every fallback to the reference is
logged once per reason (logger `chunk_llama.ops`, level WARNING): none is silent.
"""

from __future__ import annotations

import functools
import logging

import torch

from chunk_llama.kv.plan import DecodePlan
from chunk_llama.ops import reference
from chunk_llama.ops.jit import force_reference
from chunk_llama.ops.prefill_plan import PrefillPlan, build_prefill_plan
from chunk_llama.ops.reference import gather_dense, prefill_attention

logger = logging.getLogger(__name__)
_logged: set[str] = set()


def _info(backend: str, isa: str | None = None, reason: str | None = None) -> dict:
    return {"backend": backend, "isa": isa, "reason": reason}


@functools.cache
def _static_info(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                 chunk_size: int, variant: str | None) -> dict:
    """What would run, from the shapes alone (no build); `variant`: the CPU variant selected."""
    if device.type == "cpu":
        from chunk_llama.ops import cpu

        reason = cpu.unsupported_reason(dtype, cache_dtype, head_dim, chunk_size)
        return _info("reference", reason=reason) if reason else _info("cpu", isa=variant)
    if device.type == "cuda":
        from chunk_llama.ops import cuda

        reason = cuda.unsupported_reason(device.index, dtype, cache_dtype, head_dim, chunk_size)
        return _info("reference", reason=reason) if reason else _info("cuda")
    return _info("reference", reason=f"there is no native decode kernel for {device.type} tensors")


def _resolve(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, chunk_size: int,
             build: bool) -> dict:
    if force_reference():
        return _info("reference", reason="CHUNK_LLAMA_FORCE_REFERENCE is set")
    variant = None
    if device.type == "cpu":
        from chunk_llama.ops import isa

        variant = isa.selected_variant()  # a ValueError for a variant this CPU cannot run
    info = _static_info(device, dtype, cache_dtype, head_dim, chunk_size, variant)
    if info["backend"] == "reference":
        return info
    if info["backend"] == "cpu":
        from chunk_llama.ops import cpu

        module = cpu.build() if build else True
        failed = cpu.build_failed()
    else:
        from chunk_llama.ops import cuda

        module = cuda.build(device.index) if build else True
        failed = cuda.build_failed(device.index)
    if module is None or failed:
        return _info("reference", reason=failed or f"the {info['backend']} kernel did not load")
    return info


def _log_once(key: str, message: str, reason: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(message, reason)


def backend_info(device: torch.device, dtype: torch.dtype, head_dim: int, chunk_size: int) -> dict:
    """What decode attention runs for a KV cache of this device, dtype and geometry:
    {"backend": "cpu" | "cuda" | "reference", "isa": CPU variant or None,
     "reason": why the reference runs, or None}. Builds nothing; a build that failed
    earlier in this process shows as the reason.
    """
    return _resolve(torch.device(device), dtype, dtype, head_dim, chunk_size, build=False)


def prepare_backend(device: torch.device, dtype: torch.dtype, head_dim: int, chunk_size: int) -> dict:
    """`backend_info`, after building the native kernel it names (so that a timer started
    afterwards does not count the first-use build)."""
    return _resolve(torch.device(device), dtype, dtype, head_dim, chunk_size, build=True)


def decode_backend(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """'cuda', 'cpu' or 'reference': what `tpp_decode_attention` runs for these tensors
    (builds the native kernel on first use; a fallback is logged once per reason)."""
    info = _resolve(q.device, q.dtype, k_cache.dtype, q.shape[-1], k_cache.shape[2], build=True)
    if info["backend"] == "reference":
        _log_once(info["reason"], "chunk-llama: decode attention runs the PyTorch reference: %s", info["reason"])
    return info["backend"]


def check_window(window: int | None) -> int:
    """A layer's sliding window as the kernels take it: 0 for none, else a positive int."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ValueError(f"sliding window must be a positive integer or None, got {window!r}")
    return window


def tpp_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Decode attention through the tree, one query per sequence.

    q: [num_seqs, num_heads, head_dim] in `plan.seq_ids` order
    k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    window: the layer's sliding window (a query sees its `window` latest positions), or None
    returns [num_seqs, num_heads, head_dim]
    """
    window = check_window(window)
    backend = decode_backend(q, k_cache)
    if backend == "cuda" and not plan.aligned:
        reason = "the CUDA decode kernel takes whole-chunk segments only, and this plan has a segment that ends " \
                 "inside a chunk (token-granular sharing)"
        _log_once(reason, "chunk-llama: decode attention runs the PyTorch reference: %s", reason)
        backend = "reference"
    if backend == "cuda":
        from chunk_llama.ops.cuda import tpp_decode_attention_cuda

        return tpp_decode_attention_cuda(q, k_cache, v_cache, plan, scale, window)
    if backend == "cpu":
        from chunk_llama.ops.cpu import tpp_decode_attention_cpu

        return tpp_decode_attention_cpu(q, k_cache, v_cache, plan, scale, window=window)
    return reference.tpp_decode_attention(q, k_cache, v_cache, plan, scale, window)


def prefill_backend(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """'cpu', 'cuda' or 'reference': what `packed_prefill_attention` runs for these tensors.
    The CPU kernel has the decode kernel's support set (dtype, head dim, chunk size); the
    CUDA prefill is PyTorch's FlashAttention-2 varlen over the gathered contexts
    (`cuda_prefill.py`). A fallback is logged once per reason."""
    if q.device.type == "cuda" and not force_reference():
        from chunk_llama.ops import cuda_prefill

        reason = cuda_prefill.unsupported_reason(q.device.index, q.dtype, k_cache.dtype, q.shape[-1])
        if reason is None:
            return "cuda"
    else:
        info = _resolve(q.device, q.dtype, k_cache.dtype, q.shape[-1], k_cache.shape[2], build=True)
        if info["backend"] == "cpu":
            return "cpu"
        reason = info["reason"] or f"there is no native prefill kernel for {q.device.type} tensors"
    _log_once(f"prefill: {reason}", "chunk-llama: prefill attention runs the PyTorch reference: %s", reason)
    return "reference"


def packed_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan, scale: float,
    window: int | None = None, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence prefilled in a step over its whole context.

    q: [num_q_tokens, num_heads, head_dim], sequence s at rows plan.segments[s][0] ..
    k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    window: the layer's sliding window, or None
    new_kv: the step's K and V ([num_q_tokens, num_kv_heads, head_dim] each, already in the
        pool) as the layer computed them; the CUDA prefill reads them instead of gathering
        from the pool where no sequence has cached positions (the other kernels read the pool)
    returns [num_q_tokens, num_heads, head_dim] (rows of no sequence uninitialised)
    """
    window = check_window(window)
    backend = prefill_backend(q, k_cache)
    if backend == "cuda" and plan.varlen is None:
        raise ValueError("the prefill plan was built for the CPU; build it on the CUDA device of the cache")
    if backend == "cuda":
        from chunk_llama.ops.cuda_prefill import packed_prefill_attention_varlen

        return packed_prefill_attention_varlen(q, k_cache, v_cache, plan.varlen, scale, window, new_kv=new_kv)
    if backend == "cpu":
        from chunk_llama.ops.cpu import prefill_attention_cpu

        return prefill_attention_cpu(q, k_cache, v_cache, plan, scale, window=window)
    return reference.packed_prefill_attention(q, k_cache, v_cache, plan, scale, window)


__all__ = ["PrefillPlan", "backend_info", "build_prefill_plan", "check_window", "decode_backend", "gather_dense",
           "packed_prefill_attention", "prefill_attention", "prefill_backend", "prepare_backend",
           "tpp_decode_attention"]
