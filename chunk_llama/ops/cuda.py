"""CUDA two-phase-partition decode attention (csrc/cuda), built for the GPU at hand."""

from __future__ import annotations

import functools

import torch

from chunk_llama.kv.plan import DecodePlan
from chunk_llama.ops.jit import CSRC, build_failure, load_extension

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_CHUNK_SIZES = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def _arch(device_index: int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"{major}{minor}"


def _module(device_index: int | None = None):
    arch = _arch(device_index)
    sources = [CSRC / "cuda" / f for f in ("tpp_kernels.cu", "tpp_torch.cpp", "bindings.cpp")]
    return load_extension(
        f"chunk_llama_cuda_sm{arch}",
        sources,
        cflags=["-O3", "-std=c++17"],
        cuda_cflags=["-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "--use_fast_math"],
        description=f"the CUDA attention kernels for sm_{arch}",
        estimate_seconds=120.0,
    )


def build(device_index: int | None = None):
    """The extension built for the GPU (building it on first use), or None."""
    return _module(device_index)


def build_failed(device_index: int | None = None) -> str | None:
    """Why the build for this GPU failed in this process, or None."""
    return build_failure(f"chunk_llama_cuda_sm{_arch(device_index)}")


def unsupported_reason(device_index, dtype, cache_dtype, head_dim: int, chunk_size: int) -> str | None:
    """Why the CUDA kernels cannot take these tensors (the reference runs), or None; builds nothing."""
    if dtype not in SUPPORTED_DTYPES:
        return f"the CUDA kernels support float16 and bfloat16, not {str(dtype).replace('torch.', '')}"
    if cache_dtype != dtype:
        return f"q is {dtype} but the KV cache is {cache_dtype}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"the CUDA kernels support head dims {', '.join(map(str, SUPPORTED_HEAD_DIMS))}, not {head_dim}"
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        return f"the CUDA kernels support chunk sizes {', '.join(map(str, SUPPORTED_CHUNK_SIZES))}, not {chunk_size}"
    major, _ = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return f"the CUDA kernels need compute capability 8.0 or newer, this GPU has {major}.x"
    return None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the CUDA kernel handles these tensors (else use the reference)."""
    return q.is_cuda and _supports(q.device.index, q.dtype, k_cache.dtype, q.shape[-1], k_cache.shape[2])


@functools.cache
def _supports(device_index, dtype, cache_dtype, head_dim: int, chunk_size: int) -> bool:
    return (
        dtype in SUPPORTED_DTYPES
        and cache_dtype == dtype
        and head_dim in SUPPORTED_HEAD_DIMS
        and chunk_size in SUPPORTED_CHUNK_SIZES
        and torch.cuda.get_device_capability(device_index)[0] >= 8
        and _module() is not None
    )


def tpp_decode_attention_cuda(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float, window: int = 0
) -> torch.Tensor:
    """Same contract as `reference.tpp_decode_attention` (window: 0 for none); `plan` built on the GPU with
    `group = num_heads // num_kv_heads`.

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    """
    if plan.device_index is None:
        raise ValueError("the plan was built for the CPU; build it on the CUDA device of the cache")
    index = plan.device_index
    return _module().tpp_decode(
        q.contiguous(), k_cache, v_cache,
        index["shared_chunk_ids"], index["shared_begin"], index["shared_end"], index["shared_row_offset"],
        index["shared_depth"], index["private_chunk_ids"], index["num_shared_tokens"], index["seq_lens"], index["seq_partial_ptr"],
        index["seq_partial_rows"], plan.max_rows_per_shared, plan.max_pairs_per_seq, plan.max_private_tokens,
        plan.num_partial_rows,
        float(scale), window,
    )
