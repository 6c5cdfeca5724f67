"""Which attention backend a step runs, chosen once per step.

Every backend answers one convention (FlashInfer's plan/run): an object made for the
cache's geometry, `plan(step_plan, capacity, writes, row_order)` once per step (checks and
uploads what its kernel reads, sizes the cache's workspace) returning the step's calls,
whose `run(q, k_cache, v_cache, scale, window, new_kv)` runs per layer (a step's calls are
refused once the backend planned another step). The native kernel of the tensors' device
runs when it is built and supports them (`cpu/attention.py`: C++/OpenMP in the variant
`CHUNK_LLAMA_CPU_ISA` selects; `cuda/decode.py`, `cuda/prefill.py`), else the PyTorch
reference (`reference.py`), which is also the oracle the native kernels are tested against.
Every fallback to the reference is logged once per reason (logger `chunk_llama.ops`,
WARNING): none is silent.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from chunk_llama.logs import log_once
from chunk_llama.ops.build.jit import force_reference
from chunk_llama.ops.cpu import isa, linear
from chunk_llama.ops.reference import ReferenceDecode, ReferencePrefill
from chunk_llama.step.buffers import StaticBuffers
from chunk_llama.step.decode_plan import DecodePlan

logger = logging.getLogger("chunk_llama.ops")


@dataclass(frozen=True)
class Geometry:
    """What a backend is made for: the cache's device, the model's dtype (q's and the
    output's) and heads, and the K/V pool's dtype (bfloat16 under a float32 model on the
    CPU, else the model's)."""

    device: torch.device
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int
    kv_dtype: torch.dtype

    @property
    def heads(self) -> tuple[int, int, int, int]:
        return self.num_heads, self.num_kv_heads, self.head_dim, self.chunk_size


def _info(backend: str, isa_name: str | None = None, reason: str | None = None) -> dict:
    return {"backend": backend, "isa": isa_name, "reason": reason}


@functools.cache
def _static_info(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int,
                 chunk_size: int, variant: str | None) -> dict:
    """What would run, from the shapes alone (no build); `variant`: the CPU variant selected."""
    if device.type == "cpu":
        from chunk_llama.ops.cpu import attention as cpu

        reason = cpu.unsupported_reason(dtype, cache_dtype, head_dim, chunk_size)
        return _info("reference", reason=reason) if reason else _info("cpu", isa_name=variant)
    if device.type == "cuda":
        from chunk_llama.ops.cuda import decode as cuda

        reason = cuda.unsupported_reason(device.index, dtype, cache_dtype, head_dim, chunk_size)
        return _info("reference", reason=reason) if reason else _info("cuda")
    return _info("reference", reason=f"there is no native decode kernel for {device.type} tensors")


def resolve(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, chunk_size: int,
            build: bool) -> dict:
    """{"backend": "cpu" | "cuda" | "reference", "isa": CPU variant or None, "reason": why
    the reference runs, or None} for decode attention on these tensors; `build`: build the
    native kernel it names (else a build that failed earlier shows as the reason)."""
    if force_reference():
        return _info("reference", reason="CHUNK_LLAMA_FORCE_REFERENCE is set")
    variant = isa.selected_variant() if device.type == "cpu" else None  # a ValueError for a variant the CPU lacks
    info = _static_info(device, dtype, cache_dtype, head_dim, chunk_size, variant)
    if info["backend"] == "reference":
        return info
    if info["backend"] == "cpu":
        from chunk_llama.ops.cpu import attention as cpu

        module = cpu.build() if build else True
        failed = cpu.build_failed()
    else:
        from chunk_llama.ops.cuda import decode as cuda

        module = cuda.build(device.index) if build else True
        failed = cuda.build_failed(device.index)
    if module is None or failed:
        return _info("reference", reason=failed or f"the {info['backend']} kernel did not load")
    return info


def _made(made: dict | None, key: tuple, make):
    """One backend object per key in `made` (the cache's: reused from step to step)."""
    if made is None:
        return make()
    if key not in made:
        made[key] = make()
    return made[key]


def decode_attention(geometry: Geometry, workspace: StaticBuffers, aligned: bool = True, made: dict | None = None):
    """The decode backend for this geometry (a plan-once, run-per-layer object); `aligned`:
    whether the step's plan is whole chunks (the CUDA kernels take nothing else); `made`:
    where the objects of earlier steps are kept, to reuse."""
    info = resolve(geometry.device, geometry.dtype, geometry.kv_dtype, geometry.head_dim, geometry.chunk_size, True)
    if info["backend"] == "cuda" and not aligned:
        info = _info("reference", reason="the CUDA decode kernel takes whole-chunk segments only, and this plan has "
                                         "a segment that ends inside a chunk (token-granular sharing)")
    if info["backend"] == "cpu":
        from chunk_llama.ops.cpu.attention import CpuDecode

        return _made(made, ("decode", "cpu", info["isa"]),
                     lambda: CpuDecode(workspace, *geometry.heads, variant=info["isa"]))
    if info["backend"] == "cuda":
        from chunk_llama.ops.cuda.decode import CudaDecode

        return _made(made, ("decode", "cuda"), lambda: CudaDecode(workspace, *geometry.heads, geometry.kv_dtype))
    log_once(logger, "chunk-llama: decode attention runs the PyTorch reference: %s", info["reason"])
    return _made(made, ("decode", "reference"), ReferenceDecode)


def prefill_attention(geometry: Geometry, workspace: StaticBuffers, made: dict | None = None):
    """The prefill backend for this geometry: the CPU kernel has the decode kernel's support
    set; on CUDA it is PyTorch's FlashAttention-2 varlen (`cuda/prefill.py`)."""
    device = geometry.device
    if device.type == "cuda" and not force_reference():
        from chunk_llama.ops.cuda import prefill as cuda_prefill

        reason = cuda_prefill.unsupported_reason(device.index, geometry.dtype, geometry.kv_dtype, geometry.head_dim)
        if reason is None:
            return _made(made, ("prefill", "cuda"), cuda_prefill.CudaPrefill)
    else:
        info = resolve(device, geometry.dtype, geometry.kv_dtype, geometry.head_dim, geometry.chunk_size, True)
        if info["backend"] == "cpu":
            from chunk_llama.ops.cpu.attention import CpuPrefill

            return _made(made, ("prefill", "cpu", info["isa"]),
                         lambda: CpuPrefill(workspace, *geometry.heads, variant=info["isa"]))
        reason = info["reason"] or f"there is no native prefill kernel for {device.type} tensors"
    log_once(logger, "chunk-llama: prefill attention runs the PyTorch reference: %s", reason)
    return _made(made, ("prefill", "reference"), ReferencePrefill)


class CacheBackends:
    """What a cache's steps run (`step.StepBackends`), chosen per step: the attention backend
    for the step's plan on each device (made once per device and kind, with that device's
    workspace, then planned per step) and the linear path (the settings read once per step).

    geometry: the cache's (its device, the model's dtype, heads, the pool's dtype);
    buffers: the workspace on the cache's device (the step builder's buffers)."""

    def __init__(self, geometry: Geometry, buffers: StaticBuffers):
        self.geometry = geometry
        self.q_dtype = geometry.dtype
        self._buffers = {geometry.device: buffers}
        self._made: dict[torch.device, dict] = {}

    def attention(self, plan, device: torch.device, capacity: int, writes, row_order):
        """The backend for `plan` on `device`, planned with the step's writes (the fused
        layers' slots) and row order: the step's calls."""
        geometry = self.geometry if device == self.geometry.device else dataclasses.replace(self.geometry,
                                                                                            device=device)
        buffers = self._buffers.setdefault(device, StaticBuffers(device))
        made = self._made.setdefault(device, {})
        if isinstance(plan, DecodePlan):
            backend = decode_attention(geometry, buffers, plan.aligned, made)
        else:
            backend = prefill_attention(geometry, buffers, made)
        return backend.plan(plan, capacity, writes.slots, row_order)

    def linear(self):
        return linear.resolve(self.geometry.dtype, self.geometry.device)
