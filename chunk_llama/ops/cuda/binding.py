"""The CUDA kernel library's C interface (`csrc/cuda/c_api.h`) bound with ctypes, as
`cpu/binding.py` binds the CPU one: a step's plan is made once in a handle (checked, the
launch decided), and each layer's call passes that, its pools' struct (made once per pool)
and its own tensors on torch's current stream.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from chunk_llama.ops.build.c_types import F64, I32, I64, STR, P, int64_array

ABI_VERSION = 2  # CHUNK_LLAMA_CUDA_ABI_VERSION in c_api.h
U64 = ctypes.c_uint64
_SIGNATURES = {  # name: (argument types, result type), as c_api.h declares them
    "abi_version": ([], I32),
    "last_error": ([], STR),
    "runtime_version": ([], I32),
    "check_device": ([I32], I32),
    "decode_layout": ([], STR),
    "plan_new": ([], P),
    "plan_free": ([P], None),
    "plan_make": ([P, P, ctypes.POINTER(U64), ctypes.POINTER(I64)], I32),  # handle, PlanParams*
    "attend": ([P, P, P, P, P], I32),  # Planned*, Kv*, q, out, stream
}
DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1}  # CHUNK_LLAMA_FLOAT16, CHUNK_LLAMA_CUDA_BFLOAT16
_ERRORS = {1: ValueError, 2: TypeError}  # 3 (a CUDA error): RuntimeError


class PlanParams(ctypes.Structure):
    """chunk_llama_cuda_plan_params."""
    _fields_ = [("device", I32), ("dtype", I32), ("index", P), ("index_numel", I64), ("layout", P),
                ("layout_size", I64), ("num_seqs", I64), ("num_heads", I64), ("num_kv_heads", I64), ("head_dim", I64),
                ("chunk_size", I64)]


class Planned(ctypes.Structure):
    """chunk_llama_cuda_planned: a made plan as each call of its step names it."""
    _fields_ = [("plan", P), ("generation", U64), ("workspace", P), ("workspace_numel", I64)]


class Kv(ctypes.Structure):
    """chunk_llama_cuda_kv: one layer's K and V pools, scale and sliding window."""
    _fields_ = [("k", P), ("v", P), ("num_kv_heads", I64), ("chunk_size", I64), ("head_dim", I64), ("window", I64),
                ("scale", F64), ("dtype", I32)]


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
        self.attend = lib.chunk_llama_cuda_attend
        if lib.chunk_llama_cuda_check_device(device) != 0:
            raise ValueError(lib.chunk_llama_cuda_last_error().decode())

    def raise_error(self, code: int):
        raise _ERRORS.get(code, RuntimeError)(self._lib.chunk_llama_cuda_last_error().decode())

    def new_plan(self) -> "CudaPlanHandle":
        """A plan handle (made once per backend, planned again each step)."""
        return CudaPlanHandle(self)

    def decode_layout(self) -> list[str]:
        """The plan's array names in layout order (the Python side checks its own against them)."""
        return self._lib.chunk_llama_cuda_decode_layout().decode().split(",")


class CudaPlanHandle:
    """A C plan handle of the CUDA library, freed with this object."""

    def __init__(self, library: CudaLibrary):
        self._library = library
        self.pointer = library._lib.chunk_llama_cuda_plan_new()
        if not self.pointer:
            raise MemoryError("the CUDA library could not allocate a plan handle")
        self._free = weakref.finalize(self, library._lib.chunk_llama_cuda_plan_free, self.pointer)

    def make(self, index: torch.Tensor, layout: Sequence[int], geometry: tuple[int, int, int, int, int],
             dtype: torch.dtype, workspace_of) -> "CudaPlanned":
        """Plan `index` (the decode plan's int32 device arrays, `DecodePlan.cuda_index`; its
        `layout`) for geometry (num_seqs, num_heads, num_kv_heads, head_dim, chunk_size) in
        `dtype`; `workspace_of(floats)` gives the step's workspace on the plan's GPU."""
        if not (index.is_cuda and index.dtype == torch.int32 and index.is_contiguous()):
            raise TypeError(f"the plan must be a contiguous int32 CUDA tensor, got {index.dtype} on {index.device}")
        if dtype not in DTYPE_CODES:
            raise TypeError(f"CUDA TPP supports float16 and bfloat16, got {dtype}")
        layout_array = int64_array(layout)
        params = PlanParams(index.device.index, DTYPE_CODES[dtype], index.data_ptr(), index.numel(),
                            ctypes.addressof(layout_array), len(layout), *geometry)
        generation, floats = U64(), I64()
        code = self._library._lib.chunk_llama_cuda_plan_make(self.pointer, ctypes.byref(params),
                                                             ctypes.byref(generation), ctypes.byref(floats))
        if code != 0:
            self._library.raise_error(code)
        workspace = workspace_of(floats.value)
        if not (workspace.device == index.device and workspace.dtype == torch.float32 and workspace.is_contiguous()):
            raise ValueError(f"workspace must be a contiguous float32 tensor on {index.device}")
        return CudaPlanned(self, generation.value, workspace, geometry, dtype, index.device)


class CudaPlanned:
    """One step's made plan on a GPU: `run` per layer (refused once the handle planned another)."""

    backend = "cuda"
    has_writes = False  # (no fused layer on the GPU)

    def __init__(self, handle: CudaPlanHandle, generation: int, workspace: torch.Tensor, geometry: tuple,
                 dtype: torch.dtype, device: torch.device):
        self._kept = (handle, workspace)  # (the struct holds their addresses)
        self._planned = Planned(handle.pointer, generation, workspace.data_ptr(), workspace.numel())
        self._address = ctypes.addressof(self._planned)
        self._library = handle._library
        num_seqs, num_heads, _, head_dim, _ = geometry
        self.q_shape, self.dtype, self.device = (num_seqs, num_heads, head_dim), dtype, device
        self.kvs: dict[tuple, tuple] = {}  # (pools, scale, window) -> (k, v, Kv): the backend's, across steps

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int = 0,
            new_kv=None) -> torch.Tensor:
        """Decode attention on the plan's GPU, on its current stream: q [num_seqs, num_heads,
        head_dim] in plan order; k_cache, v_cache [capacity, num_kv_heads, chunk_size, head_dim]
        -> [num_seqs, num_heads, head_dim]"""
        q = q.contiguous()
        if not (q.is_cuda and q.device == self.device and q.dtype == self.dtype and q.shape == self.q_shape):
            raise ValueError(f"q must be {list(self.q_shape)} {self.dtype} on {self.device} (the plan's rows, the "
                             f"model's heads), got {list(q.shape)} {q.dtype} on {q.device}")
        kv = self._kv(k_cache, v_cache, scale, window)
        out = torch.empty_like(q)
        code = self._library.attend(self._address, ctypes.addressof(kv), q.data_ptr(), out.data_ptr(),
                                    torch.cuda.current_stream(self.device).cuda_stream)
        return out if code == 0 else self._library.raise_error(code)

    def _kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int) -> Kv:
        """The layer's pools as the library takes them, checked once per pool (the backend keeps
        them, by address: `pool.k[layer]` is a new view each time; the entry holds the memory)."""
        key = (k_cache.data_ptr(), v_cache.data_ptr(), scale, window)
        entry = self.kvs.get(key)
        if entry is None or entry[0].shape != k_cache.shape or entry[1].shape != v_cache.shape or \
                k_cache.dtype is not self.dtype or v_cache.dtype is not self.dtype or \
                not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            if not (k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.device == self.device
                    and v_cache.device == self.device and k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise ValueError(f"k_cache and v_cache must be contiguous [capacity, num_kv_heads, chunk_size, "
                                 f"head_dim] tensors on {self.device}")
            if not (k_cache.dtype == v_cache.dtype == self.dtype):
                raise TypeError("q, k_cache and v_cache must share a dtype")
            entry = self.kvs[key] = (k_cache, v_cache, Kv(k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.shape[1:],
                                                           int(window), float(scale), DTYPE_CODES[self.dtype]))
        return entry[2]
