"""CPU attention (csrc/cpu, C++ with OpenMP): two-phase-partition decode and packed prefill,
each a backend whose `plan` makes the step's plan once in the library and returns the step's
calls (`planned.CpuPlanned`), run per layer.

The library comes prebuilt in the platform wheel or is built on first use (`native.py`).
One build holds every kernel variant of this architecture (see `isa.py`, `ops/build/spec.py`):
the C interface is compiled once with baseline flags and each variant in its own small
translation unit for its own instruction set, and the interface dispatches at run time.
So the build does not depend on the CPU's features and is made once per
architecture; `CHUNK_LLAMA_CPU_ISA` picks the variant without rebuilding.

Both plan the same way: the step's plan (one int64 tensor and its layout) with the pool's
geometry and, for the fused layers, the step's K/V slots; the caller's scratch (the cache's
buffers, kept across steps: fresh pages every step cost a page fault per 4 KiB, which was
half the kernel's time). A layer's call passes q, its pool, scale and window.
"""

from __future__ import annotations

import torch

from chunk_llama.ops.build import native
from chunk_llama.ops.build.spec import cpu_build
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.binding import CpuLibrary
from chunk_llama.ops.cpu.planned import CpuPlanned
from chunk_llama.ops.cpu.structs import DECODE_PLAN, PREFILL_PLAN, KvTable
from chunk_llama.step.buffers import StaticBuffers
from chunk_llama.step.decode_plan import DecodePlan
from chunk_llama.step.prefill_plan import PrefillPlan

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)  # q's (and the output's)
SUPPORTED_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # fp16: K/V under float32 or bfloat16 q
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # csrc/cpu/params.h; chunk sizes: any multiple of 16


def build() -> CpuLibrary | None:
    """The CPU kernels' library (`binding.CpuLibrary`): the wheel's, else built on first use; or None."""
    return native.load(cpu_build(), CpuLibrary)


def build_failed() -> str | None:
    """Why the library is not available in this process, or None."""
    return native.failure(cpu_build().name)


def unsupported_reason(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, chunk_size: int) -> str | None:
    """Why the C++ kernels cannot take these tensors (the reference runs), or None."""
    name = lambda t: str(t).replace("torch.", "")  # noqa: E731
    if dtype not in SUPPORTED_DTYPES:  # in any pair with the pool (float32 q over bfloat16 or float16 K/V)
        return f"the CPU kernel supports float32 and bfloat16 q, not {name(dtype)}"
    if cache_dtype not in SUPPORTED_POOL_DTYPES:
        return f"the CPU kernel supports float32, bfloat16 and float16 K/V, not {name(cache_dtype)}"
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


class _CpuAttention:
    """What both CPU backends share: the library, a plan handle (planned again each step,
    in place) and each layer's pool struct, kept across steps."""

    kind: int

    def __init__(self, workspace: StaticBuffers, num_heads: int, num_kv_heads: int, head_dim: int,
                 chunk_size: int, variant: str | None = None):
        self.workspace = workspace
        self.geometry = (num_heads, num_kv_heads, head_dim, chunk_size)
        self.variant = variant or isa.selected_variant()
        self.backend = f"cpu:{self.variant}"
        self._library = _ops()
        self._handle = self._library.new_plan()
        self._kvs = KvTable()

    def _make(self, index: torch.Tensor, layout, q_rows: int, capacity: int, writes, row_order,
              max_blocks_per_item: int = 0) -> CpuPlanned:
        num_heads, num_kv_heads, head_dim, chunk_size = self.geometry
        return self._handle.make(self.kind, index, layout, (q_rows, num_heads, num_kv_heads, head_dim, chunk_size),
                                 capacity, self.workspace.scratch, self.variant, writes, row_order, max_blocks_per_item,
                                 self._kvs)


class CpuDecode(_CpuAttention):
    """Decode attention through the tree on the CPU: `plan` once per step returns the step's
    calls (`planned.CpuPlanned`: `run` per layer, same contract as
    `reference.tpp_decode_attention`; the fused layers' calls).

    workspace: where the scratch lives (the cache's buffers); variant: the kernel variant
    (default: `isa.selected_variant()`); max_blocks_per_item: shared blocks of keys one
    first-phase work item takes (default: chosen by the kernel for the threads, about 8 items
    each; fewer blocks make more, smaller items).
    """

    kind = DECODE_PLAN

    def __init__(self, workspace: StaticBuffers, num_heads: int, num_kv_heads: int, head_dim: int,
                 chunk_size: int, variant: str | None = None, max_blocks_per_item: int | None = None):
        super().__init__(workspace, num_heads, num_kv_heads, head_dim, chunk_size, variant)
        self.max_blocks_per_item = max_blocks_per_item or 0

    def plan(self, plan: DecodePlan, capacity: int, writes: tuple | None = None,
             row_order: torch.Tensor | None = None) -> CpuPlanned:
        """The step's calls on `plan` over pools of `capacity` chunks; writes: the step's
        (token, chunk, offset) slots and row order, for the fused layers (None: attention only)."""
        return self._make(plan.index, plan.layout, plan.num_seqs, capacity, writes, row_order,
                          self.max_blocks_per_item)


class CpuPrefill(_CpuAttention):
    """Packed prefill attention on the CPU, K/V read in place from the pool: `plan` once per
    step returns the step's calls (`run` per layer, same contract as
    `reference.packed_prefill_attention`; the fused layers' calls)."""

    kind = PREFILL_PLAN

    def plan(self, plan: PrefillPlan, capacity: int, writes: tuple | None = None,
             row_order: torch.Tensor | None = None) -> CpuPlanned:
        num_heads, num_kv_heads, _, _ = self.geometry
        if num_heads // num_kv_heads != plan.group:
            raise ValueError(f"the plan's tiles are for GQA group {plan.group}, the model has "
                             f"{num_heads} / {num_kv_heads} heads")
        if row_order is not None:
            raise ValueError("a prefill's rows have no row order")
        arrays = plan.cpu()
        return self._make(arrays.index, arrays.layout, plan.num_q_tokens, capacity, writes, None)


def tpp_decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan,
                             scale: float, max_blocks_per_item: int | None = None, variant: str | None = None,
                             window: int = 0) -> torch.Tensor:
    """`CpuDecode` planned and run once (for tests and benchmarks that pick the variant).

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    """
    attention = CpuDecode(StaticBuffers(q.device), q.shape[1], k_cache.shape[1], q.shape[-1], k_cache.shape[2],
                          variant, max_blocks_per_item)
    return attention.plan(plan, k_cache.shape[0]).run(q, k_cache, v_cache, scale, window)


def prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan,
                          scale: float, variant: str | None = None, window: int = 0) -> torch.Tensor:
    """`CpuPrefill` planned and run once. q: [num_q_tokens, num_heads, head_dim]"""
    attention = CpuPrefill(StaticBuffers(q.device), q.shape[1], k_cache.shape[1], q.shape[-1], k_cache.shape[2],
                           variant)
    return attention.plan(plan, k_cache.shape[0]).run(q, k_cache, v_cache, scale, window)
