"""CPU two-phase-partition decode attention (csrc/cpu, C++ with OpenMP), built on first use."""

from __future__ import annotations

import functools
import hashlib
import platform

import torch

from chunk_llama.kv.plan import DecodePlan
from chunk_llama.ops.jit import CSRC, load_extension

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)  # chunk sizes: any multiple of 16


def _cpu_signature() -> str:
    """Built with -march=native: a build is only reused on a CPU with the same features."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return hashlib.sha256((platform.machine() + flags).encode()).hexdigest()[:8]


@functools.lru_cache(maxsize=None)
def build(extra_cflags: tuple[str, ...] = ()):
    """The extension built for this CPU (with `extra_cflags`, e.g. to test other targets), or None."""
    sources = [CSRC / "cpu" / f for f in ("tpp_cpu_torch.cpp", "bindings.cpp")]
    suffix = hashlib.sha256(" ".join(extra_cflags).encode()).hexdigest()[:6] if extra_cflags else ""
    return load_extension(
        f"chunk_llama_cpu_{_cpu_signature()}{suffix}",
        sources,
        cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17",
                *extra_cflags],
        ldflags=["-fopenmp"],
    )


def _module():
    return build()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel handles these tensors (else use the reference)."""
    return (
        q.device.type == "cpu"
        and q.dtype in SUPPORTED_DTYPES
        and k_cache.dtype == q.dtype
        and k_cache.shape[2] % 16 == 0
        and q.shape[-1] in SUPPORTED_HEAD_DIMS
        and _module() is not None
    )


_scratch = torch.empty(0)


def _scratch_for(num_floats: int) -> torch.Tensor:
    """A float32 buffer kept across calls (grown geometrically): its pages stay mapped."""
    global _scratch
    if _scratch.numel() < num_floats:
        _scratch = torch.empty(max(num_floats, 2 * _scratch.numel()))
    return _scratch


def default_chunks_per_item(plan: DecodePlan, num_kv_heads: int) -> int:
    """Shared chunks one phase-1 work item merges: as many as keeps ~8 items per thread.

    Longer segments write fewer partials (each as large as the chunk's K for its rows);
    shorter ones balance the threads.
    """
    return max(1, plan.num_shared * num_kv_heads // (8 * torch.get_num_threads()))


def tpp_decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float,
    max_chunks_per_item: int | None = None,
) -> torch.Tensor:
    """Same contract as `reference.tpp_decode_attention`.

    q: [num_seqs, num_heads, head_dim]; k_cache, v_cache: [capacity, num_kv_heads, chunk_size, head_dim]
    max_chunks_per_item: see `default_chunks_per_item` (the default)
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    module = _module()
    scratch = _scratch_for(module.scratch_floats(int(plan.pair_seq.numel()), num_seqs, num_heads, num_kv_heads,
                                                 head_dim))
    if max_chunks_per_item is None:
        max_chunks_per_item = default_chunks_per_item(plan, num_kv_heads)
    return module.tpp_decode(
        q.contiguous(), k_cache, v_cache, plan.shared_chunk_ids, plan.shared_begin, plan.shared_end,
        plan.shared_depth, plan.private_chunk_ids.contiguous(), plan.num_shared_tokens, plan.seq_lens,
        plan.seq_pair_ptr, scratch, float(scale), max_chunks_per_item,
    )
