"""The CUDA kernel library's C interface (`csrc/cuda/c_api.h`) bound with ctypes, as
`cpu_lib.py` binds the CPU one: the op checks devices, dtypes and contiguity, passes
pointers, sizes and torch's current stream, and the library checks the rest and launches.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from chunk_llama.ops.build.c_types import F64, I32, I64, STR, P, int64_array

ABI_VERSION = 1  # CHUNK_LLAMA_CUDA_ABI_VERSION in c_api.h
_SIGNATURES = {  # name: (argument types, result type), as c_api.h declares them
    "abi_version": ([], I32),
    "last_error": ([], STR),
    "runtime_version": ([], I32),
    "check_device": ([I32], I32),
    "decode_layout": ([], STR),
    "workspace_floats": ([I64] * 5, I64),
    "tpp_decode": ([I32, P, I64, I64, I64, P, P, I64, I64, I64, I32, P, P, I64, P, I64, P, I64, F64, I64, P], I32),
}
_DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}  # CHUNK_LLAMA_FLOAT16, CHUNK_LLAMA_CUDA_BFLOAT16
_ERRORS = {1: ValueError, 2: TypeError}  # 3 (a CUDA error): RuntimeError


class CudaLibrary:
    """The CUDA kernels of one loaded library (`path`; `origin`: "prebuilt" or "built").
    ValueError if its C interface is another version, or if its kernels cannot run on GPU
    `device` (the driver is too old for its CUDA runtime, or it has no code for the GPU)."""

    def __init__(self, path: Path, origin: str, device: int):
        self.path, self.origin = Path(path), origin
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            function = getattr(lib, f"chunk_llama_cuda_{name}")
            function.argtypes, function.restype = argtypes, restype
        if lib.chunk_llama_cuda_abi_version() != ABI_VERSION:
            raise ValueError(f"{path.name} has C interface version {lib.chunk_llama_cuda_abi_version()}, this "
                             f"chunk-llama needs {ABI_VERSION}")
        self._lib = lib
        if lib.chunk_llama_cuda_check_device(device) != 0:
            raise ValueError(lib.chunk_llama_cuda_last_error().decode())

    def tpp_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: torch.Tensor,
                   layout, workspace: torch.Tensor, scale: float, window: int) -> torch.Tensor:
        """Decode attention on q's GPU, on its current stream: q [num_seqs, num_heads, head_dim]
        in plan order; k_cache, v_cache [capacity, num_kv_heads, chunk_size, head_dim]; plan
        and layout: `DecodePlan.cuda_index`, `.cuda_layout` -> [num_seqs, num_heads, head_dim]"""
        if not q.is_cuda:
            raise TypeError("q must be a CUDA tensor")
        device = q.device
        if q.dim() != 3:
            raise ValueError(f"q must be [num_seqs, num_heads, head_dim], got {list(q.shape)}")
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise ValueError("k_cache and v_cache must both be [capacity, num_kv_heads, chunk_size, head_dim]")
        if not q.dtype == k_cache.dtype == v_cache.dtype:
            raise TypeError("q, k_cache and v_cache must share a dtype")
        if q.dtype not in _DTYPE_CODES:
            raise TypeError(f"CUDA TPP supports float16 and bfloat16, got {q.dtype}")
        if not (k_cache.device == device and v_cache.device == device and plan.device == device
                and workspace.device == device):
            raise ValueError(f"k_cache, v_cache, plan and workspace must be on {device}")
        if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("q, k_cache and v_cache must be contiguous")
        if not (plan.dtype == torch.int32 and plan.is_contiguous()):
            raise TypeError("the plan must be a contiguous int32 tensor")
        if not (workspace.dtype == torch.float32 and workspace.is_contiguous()):
            raise ValueError("workspace must be a contiguous float32 tensor")
        layout = layout if isinstance(layout, ctypes.Array) else int64_array(layout)
        out = torch.empty_like(q)
        code = self._lib.chunk_llama_cuda_tpp_decode(
            device.index, q.data_ptr(), *q.shape, k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.shape[1:],
            _DTYPE_CODES[q.dtype], out.data_ptr(), plan.data_ptr(), plan.numel(), layout, len(layout),
            workspace.data_ptr(), workspace.numel(), scale, window, torch.cuda.current_stream(device).cuda_stream)
        if code != 0:
            raise _ERRORS.get(code, RuntimeError)(self._lib.chunk_llama_cuda_last_error().decode())
        return out

    def workspace_floats(self, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         num_partial_rows: int) -> int:
        """Floats of workspace a decode call needs."""
        return self._lib.chunk_llama_cuda_workspace_floats(num_seqs, num_heads, num_kv_heads, head_dim,
                                                           num_partial_rows)

    def decode_layout(self) -> list[str]:
        """The plan's array names in layout order (the Python side checks its own against them)."""
        return self._lib.chunk_llama_cuda_decode_layout().decode().split(",")
