"""CPU attention (csrc/cpu, C++ with OpenMP): two-phase-partition decode and packed prefill,
each as a plan-once, run-per-layer object.

The library comes prebuilt in the platform wheel or is built on first use (`native.py`).
One build holds every kernel variant of this architecture (see `isa.py`, `build.py`):
the C interface is compiled once with baseline flags and each variant in its own small
translation unit for its own instruction set, and the interface dispatches at run time.
So the build does not depend on the CPU's features and is made once per
architecture; `CHUNK_LLAMA_CPU_ISA` picks the variant without rebuilding.

Both ops take the same arguments: q, the layer's K/V pool, the step's plan (one int64
tensor and its layout), the caller's scratch (kept across calls: fresh pages every step
cost a page fault per 4 KiB, which was half the kernel's time), then scalars.
"""

from __future__ import annotations

import torch

from chunk_llama.ops.build import native
from chunk_llama.ops.build.c_types import int64_array
from chunk_llama.ops.build.spec import cpu_build
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.binding import CpuLibrary
from chunk_llama.step.buffers import StaticBuffers
from chunk_llama.step.decode_plan import DecodePlan
from chunk_llama.step.prefill_plan import PrefillPlan

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # csrc/cpu/params.h; chunk sizes: any multiple of 16


def build() -> CpuLibrary | None:
    """The CPU kernels' library (`cpu_lib.CpuLibrary`): the wheel's, else built on first use; or None."""
    return native.load(cpu_build(), CpuLibrary)


def build_failed() -> str | None:
    """Why the library is not available in this process, or None."""
    return native.failure(cpu_build().name)


def unsupported_reason(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, chunk_size: int) -> str | None:
    """Why the C++ kernels cannot take these tensors (the reference runs), or None."""
    for what, t in (("q", dtype), ("the KV cache", cache_dtype)):  # in any pair (float32 q over bfloat16 K/V)
        if t not in SUPPORTED_DTYPES:
            return f"the CPU kernel supports float32 and bfloat16, not {str(t).replace('torch.', '')} {what}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"the CPU kernel supports head dims {', '.join(map(str, SUPPORTED_HEAD_DIMS))}, not {head_dim}"
    if chunk_size % 16:
        return f"the CPU kernel needs a chunk size that is a multiple of 16, not {chunk_size}"
    return None


def _ops():
    module = build()
    if module is None:
        raise RuntimeError(f"the CPU kernel is not available: {build_failed() or 'native kernels are disabled'}")
    return module


class CpuDecode:
    """Decode attention through the tree on the CPU: `plan` once per step, `run` per layer
    (same contract as `reference.tpp_decode_attention`).

    workspace: where the scratch lives (the cache's buffers); variant: the kernel variant
    (default: `isa.selected_variant()`); max_blocks_per_item: shared blocks of keys one
    first-phase work item takes (default: chosen by the kernel for the threads, about 8 items
    each; fewer blocks make more, smaller items).
    """

    def __init__(self, workspace: StaticBuffers, num_heads: int, num_kv_heads: int, head_dim: int,
                 chunk_size: int, variant: str | None = None, max_blocks_per_item: int | None = None):
        self.workspace = workspace
        self.geometry = (num_heads, num_kv_heads, head_dim, chunk_size)
        self.variant = variant or isa.selected_variant()
        self.backend = f"cpu:{self.variant}"
        self.max_blocks_per_item = max_blocks_per_item or 0
        self._ops = _ops()

    def plan(self, plan: DecodePlan) -> None:
        num_heads, num_kv_heads, head_dim, chunk_size = self.geometry
        self._plan = plan
        self._layout = int64_array(plan.layout)  # converted once per step, read by every layer
        self._scratch = self.workspace.scratch(self._ops.decode_scratch_floats(
            plan.index, self._layout, plan.num_seqs, num_heads, head_dim, num_kv_heads, chunk_size,
            torch.get_num_threads()))
        self._calls: dict[tuple, object] = {}  # (scale, window): the plan's call, arguments converted once

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int = 0,
            new_kv=None) -> torch.Tensor:
        """q: [num_seqs, num_heads, head_dim] in plan order; k_cache, v_cache: [capacity,
        num_kv_heads, chunk_size, head_dim] -> [num_seqs, num_heads, head_dim]"""
        return self.call(scale, window)(q.contiguous(), k_cache, v_cache)

    def call(self, scale: float, window: int = 0):
        """The plan's `cpu_lib.AttentionCall` for these scalars, made once per step."""
        call = self._calls.get((scale, window))
        if call is None:
            call = self._calls[scale, window] = self._ops.decode_call(self._plan.index, self._layout, self._scratch,
                                                                      scale, window, self.max_blocks_per_item,
                                                                      self.variant)
        return call


class CpuPrefill:
    """Packed prefill attention on the CPU, K/V read in place from the pool: `plan` once per
    step, `run` per layer (same contract as `reference.packed_prefill_attention`)."""

    def __init__(self, workspace: StaticBuffers, num_heads: int, num_kv_heads: int, head_dim: int,
                 chunk_size: int, variant: str | None = None):
        self.workspace = workspace
        self.geometry = (num_heads, num_kv_heads, head_dim, chunk_size)
        self.variant = variant or isa.selected_variant()
        self.backend = f"cpu:{self.variant}"
        self._ops = _ops()

    def plan(self, plan: PrefillPlan) -> None:
        num_heads, num_kv_heads, head_dim, chunk_size = self.geometry
        if num_heads // num_kv_heads != plan.group:
            raise ValueError(f"the plan's tiles are for GQA group {plan.group}, the model has "
                             f"{num_heads} / {num_kv_heads} heads")
        threads = torch.get_num_threads()
        self._arrays = plan.cpu()
        self._layout = int64_array(self._arrays.layout)
        self._scratch = self.workspace.scratch(self._ops.prefill_scratch_floats(
            self._arrays.num_partial_rows, num_heads, head_dim, threads))
        self._calls: dict[tuple, object] = {}  # (scale, window): the plan's call, arguments converted once

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int = 0,
            new_kv=None) -> torch.Tensor:
        """q: [num_q_tokens, num_heads, head_dim] -> the same shape (rows of no sequence unset)"""
        return self.call(scale, window)(q.contiguous(), k_cache, v_cache)

    def call(self, scale: float, window: int = 0):
        """The plan's `cpu_lib.AttentionCall` for these scalars, made once per step."""
        call = self._calls.get((scale, window))
        if call is None:
            call = self._calls[scale, window] = self._ops.prefill_call(self._arrays.index, self._layout, self._scratch,
                                                                       scale, window, self.variant)
        return call


def tpp_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                             scale: float, max_blocks_per_item: int | None = None, variant: str | None = None,
                             window: int = 0) -> torch.Tensor:
    """`CpuDecode` planned and run once (for tests and benchmarks that pick the variant).

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    """
    attention = CpuDecode(StaticBuffers(q.device), q.shape[1], k_cache.shape[1], q.shape[-1], k_cache.shape[2],
                          variant, max_blocks_per_item)
    attention.plan(plan)
    return attention.run(q, k_cache, v_cache, scale, window)


def prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan,
                          scale: float, variant: str | None = None, window: int = 0) -> torch.Tensor:
    """`CpuPrefill` planned and run once. q: [num_q_tokens, num_heads, head_dim]"""
    attention = CpuPrefill(StaticBuffers(q.device), q.shape[1], k_cache.shape[1], q.shape[-1], k_cache.shape[2],
                           variant)
    attention.plan(plan)
    return attention.run(q, k_cache, v_cache, scale, window)
