"""CUDA two-phase-partition decode attention (csrc/cuda): the wheel's library (a cubin per
architecture family and PTX, the CUDA runtime linked in), else one built on first use for
the GPU at hand with the local nvcc (`native.py`).

Same call convention as the CPU ops: the step's plan (the decode plan's int32 arrays in one
device tensor, `DecodePlan.cuda_index`, and its layout) made once with the caller's
workspace, then per layer q, the layer's K/V pool, scale and window; launched on the
current stream.
"""

from __future__ import annotations

import torch

from chunk_llama.ops.build import native
from chunk_llama.ops.build.spec import cuda_build
from chunk_llama.ops.cuda.binding import CudaLibrary, CudaPlanned
from chunk_llama.step.buffers import StaticBuffers
from chunk_llama.step.decode_plan import DecodePlan

SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_CHUNK_SIZES = (32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def _arch(device_index: int | None = None) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"{major}{minor}"


def _device(device_index: int | None) -> int:
    return torch.cuda.current_device() if device_index is None else device_index


def build(device_index: int | None = None) -> CudaLibrary | None:
    """The CUDA kernels' library for the GPU (`binding.CudaLibrary`): the wheel's if it runs
    there, else built on first use for its architecture; or None."""
    device = _device(device_index)
    archs = native.prebuilt_cuda_archs()
    return native.load(cuda_build((_arch(device),)), lambda path, origin: CudaLibrary(path, origin, device),
                       packaged=cuda_build(archs) if archs else None)


def build_failed(device_index: int | None = None) -> str | None:
    """Why the library is not available for this GPU in this process, or None."""
    return native.failure(cuda_build((_arch(_device(device_index)),)).name)


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


class CudaDecode:
    """Decode attention through the tree on a GPU: `plan` once per step (the plan must be
    chunk-aligned and built on the GPU, `group = num_heads // num_kv_heads`) returns the
    step's calls (`binding.CudaPlanned`), `run` per layer (same contract as
    `reference.tpp_decode_attention`)."""

    backend = "cuda"

    def __init__(self, workspace: StaticBuffers, num_heads: int, num_kv_heads: int, head_dim: int,
                 chunk_size: int, dtype: torch.dtype = torch.bfloat16):
        self.workspace = workspace
        self.geometry = (num_heads, num_kv_heads, head_dim, chunk_size)
        self.dtype = dtype  # q's and the pool's (the kernels take one dtype for both)
        self._ops = build(workspace.device.index)
        self._handle = self._ops.new_plan()
        self._kvs: dict = {}  # each layer's pools as the library takes them, kept across steps

    def plan(self, plan: DecodePlan, capacity: int = 0, writes=None, row_order=None) -> CudaPlanned:
        """The step's calls on `plan` (the pool's capacity is not read: the CUDA kernels trust
        the chunk ids of a plan built from the tree on the device)."""
        if plan.cuda_index is None:
            raise ValueError("the plan holds no CUDA arrays: build it on the GPU from a chunk-aligned tree")
        num_heads, num_kv_heads, head_dim, chunk_size = self.geometry
        planned = self._handle.make(plan.cuda_index, plan.cuda_layout,
                                    (plan.num_seqs, num_heads, num_kv_heads, head_dim, chunk_size), self.dtype,
                                    self.workspace.scratch)
        planned.kvs = self._kvs
        return planned
