"""CPU attention kernels (csrc/cpu, C++ with OpenMP), built on first use: two-phase-partition
decode and packed prefill.

One build holds every kernel variant of this architecture (see `isa.py`): the torch
glue is compiled once with baseline flags and each variant in its own small
translation unit for its own instruction set, and the glue dispatches at run time.
So the build does not depend on the CPU's features and is cached once per
architecture; `CHUNK_LLAMA_CPU_ISA` picks the variant without rebuilding.
"""

from __future__ import annotations

import functools

import torch

from chunk_llama.kv.plan import DecodePlan
from chunk_llama.ops import isa
from chunk_llama.ops.jit import CSRC, build_failure, load_extension
from chunk_llama.ops.prefill_plan import PrefillPlan

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128, 256)  # csrc/cpu/params.h; chunk sizes: any multiple of 16
# Measured on the project's 2-core machine (glue and variants compiled in parallel);
# replaced by the last build's own duration once there is one.
BUILD_SECONDS_ESTIMATE = 15.0


def module_name() -> str:
    """The cache key names the architecture and the variants the build holds."""
    return f"chunk_llama_cpu_{isa.host_arch()}_{'_'.join(isa.compiled_variants())}"


def build_failed() -> str | None:
    """Why the build failed in this process, or None."""
    return build_failure(module_name())


@functools.cache
def build():
    """The torch ops namespace of the built extension (torch.ops.chunk_llama_cpu), or None."""
    sources = [CSRC / "cpu" / "tpp_cpu_torch.cpp"] + [CSRC / "cpu" / f"kernel_{v}.cpp" for v in isa.compiled_variants()]
    library = load_extension(
        module_name(),
        sources,
        # Baseline flags for every file: each variant raises its own target with a
        # pragma, so the glue (and the shared library) runs on any CPU of the architecture.
        cflags=["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17"],
        ldflags=["-fopenmp"],
        is_python_module=False,
        description=f"the CPU attention kernel for {isa.selected_variant()} "
                    f"({', '.join(isa.compiled_variants())} in one build)",
        estimate_seconds=BUILD_SECONDS_ESTIMATE,
    )
    return None if library is None else torch.ops.chunk_llama_cpu


def _module():
    return build()


def unsupported_reason(dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, chunk_size: int) -> str | None:
    """Why the C++ kernel cannot take these tensors (the reference runs), or None."""
    if dtype not in SUPPORTED_DTYPES:
        return f"the CPU kernel supports float32 and bfloat16, not {str(dtype).replace('torch.', '')}"
    if cache_dtype != dtype:
        return f"q is {dtype} but the KV cache is {cache_dtype}"
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return f"the CPU kernel supports head dims {', '.join(map(str, SUPPORTED_HEAD_DIMS))}, not {head_dim}"
    if chunk_size % 16:
        return f"the CPU kernel needs a chunk size that is a multiple of 16, not {chunk_size}"
    return None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel handles these tensors (else use the reference); builds on first use."""
    return (
        q.device.type == "cpu"
        and unsupported_reason(q.dtype, k_cache.dtype, q.shape[-1], k_cache.shape[2]) is None
        and _module() is not None
    )


_scratch = torch.empty(0)


def _scratch_for(num_floats: int) -> torch.Tensor:
    """A float32 buffer kept across calls (grown geometrically): its pages stay mapped."""
    global _scratch
    if _scratch.numel() < num_floats:
        _scratch = torch.empty(max(num_floats, 2 * _scratch.numel()))
    return _scratch


def default_chunks_per_item(plan: DecodePlan, num_kv_heads: int, window: int = 0) -> int:
    """Shared segments one phase-1 work item merges: as many as keeps ~8 items per thread.

    Longer segments write fewer partials (each as large as the chunk's K for its rows);
    shorter ones balance the threads. Under a sliding window only the chunks in the
    window count (the others' items return at once): about window / chunk_size + 1 per
    run of shared chunks.
    """
    num_shared = plan.num_shared
    if window:
        num_shared = min(num_shared, -(-window // plan.chunk_size) + 1)
    return max(1, num_shared * num_kv_heads // (8 * torch.get_num_threads()))


def tpp_decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float,
    max_chunks_per_item: int | None = None, variant: str | None = None, window: int = 0,
) -> torch.Tensor:
    """Same contract as `reference.tpp_decode_attention` (window: 0 for none).

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    max_chunks_per_item: see `default_chunks_per_item` (the default)
    variant: the kernel variant (default: `isa.selected_variant()`)
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, chunk_size = k_cache.shape[1], k_cache.shape[2]
    module = _module()
    if module is None:
        raise RuntimeError(f"the CPU kernel is not available: {build_failed() or 'native kernels are disabled'}")
    scratch = _scratch_for(module.scratch_floats(int(plan.pair_seq.numel()), num_seqs, num_heads, num_kv_heads,
                                                 head_dim, chunk_size, torch.get_num_threads()))
    if max_chunks_per_item is None:
        max_chunks_per_item = default_chunks_per_item(plan, num_kv_heads, window)
    return module.tpp_decode(
        q.contiguous(), k_cache, v_cache, *decode_plan_tensors(plan), scratch, float(scale), max_chunks_per_item,
        window, variant or isa.selected_variant(),
    )


def decode_plan_tensors(plan: DecodePlan) -> list[torch.Tensor]:
    """The plan's tensors in the order the `tpp_decode` op takes them."""
    return [plan.shared_chunk_ids, plan.shared_start, plan.shared_len, plan.shared_pos, plan.shared_begin,
            plan.shared_end, plan.shared_depth, plan.private_chunk_ids.contiguous(), plan.private_start.contiguous(),
            plan.private_pos.contiguous(), plan.num_shared_tokens, plan.seq_lens, plan.seq_pair_ptr]


def prefill_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan, scale: float,
    variant: str | None = None, window: int = 0,
) -> torch.Tensor:
    """Same contract as `reference.packed_prefill_attention`: K/V read in place from the pool.

    q: [num_q_tokens, num_heads, head_dim]; k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    variant: the kernel variant (default: `isa.selected_variant()`)
    """
    module = _module()
    if module is None:
        raise RuntimeError(f"the CPU kernel is not available: {build_failed() or 'native kernels are disabled'}")
    if q.shape[1] // k_cache.shape[1] != plan.group:
        raise ValueError(f"the plan's tiles are for GQA group {plan.group}, q and the cache have "
                         f"{q.shape[1]} / {k_cache.shape[1]} heads")
    scratch = _scratch_for(module.prefill_scratch_floats(plan.num_partial_rows, q.shape[1], k_cache.shape[2],
                                                         q.shape[-1], torch.get_num_threads()))
    return module.tpp_prefill(
        q.contiguous(), k_cache, v_cache, prefill_plan_tensors(plan), plan.num_partial_rows, scratch, float(scale),
        window, variant or isa.selected_variant(),
    )


def prefill_plan_tensors(plan: PrefillPlan) -> list[torch.Tensor]:
    """The plan's tensors in the order the `tpp_prefill` op takes them."""
    return [plan.seg_chunk, plan.seg_start, plan.seg_pos, plan.q_start, plan.num_tokens, plan.token_start,
            plan.tiles, plan.token_pos, plan.ctx_end, plan.ctx_chunk, plan.ctx_start, plan.ctx_len, plan.ctx_pos,
            plan.ctx_items, plan.seq_ctx_ptr, plan.seq_ctx_offset]
