"""An engine's figures: its counters and memory peaks (`engine.stats`) and its start-up line."""

from __future__ import annotations

from typing import Any

import torch

from chunk_llama.gguf.modules import GGUFLinear
from chunk_llama.ops import backend_info
from chunk_llama.ops.cpu import isa, linear


def engine_stats(engine) -> dict[str, Any]:
    """Counters and memory peaks. `peak_kv_bytes` counts chunks held by live
    sequences; `peak_pool_bytes` also counts retained (cached) prefixes.
    `attention_backend` is the decode kernel in use ("cpu:avx2", "cuda", "reference",
    ...) and `attention_fallback_reason` why the reference runs, if it does;
    `linear_backend` what the model's linear layers run on ("small_linear:avx512 + onednn",
    "torch", ...; with ", GGUF blocks Q4_1 x210 on int8 activations" for layers kept in a GGUF
    file's blocks); `weight_bytes` what the model's weights hold (each storage once).
    `adapters` and `adapters_resident` count the LoRA adapters requests may name and those
    whose weights are in memory (`adapter_bytes_resident`); `retained_chunks_by_adapter` the
    cached prefixes of each (None: the base). `decode_graph_steps`: decode steps replayed from
    CUDA graphs (`graphs.py`; 0 on the CPU or with `enforce_eager`)."""
    pool, tree, dtype = engine.cache.pool, engine.cache.tree, engine.cache.geometry.dtype
    backend = backend_info(pool.device, dtype, pool.head_dim, pool.chunk_size, pool.dtype)
    return dict(
        engine.runner.counters,
        peak_kv_bytes=tree.peak_live_chunks * pool.bytes_per_chunk,
        peak_pool_bytes=pool.peak_used * pool.bytes_per_chunk,
        peak_chunks_used=tree.peak_live_chunks,
        peak_unshared_kv_bytes=engine.runner.peak_unshared_chunks * pool.bytes_per_chunk,
        peak_batch_size=engine.runner.peak_batch_size,
        plan_rebuilds=engine.cache.num_plan_rebuilds,
        plan_updates=engine.cache.num_plan_updates,
        preemptions=engine.scheduler.num_preemptions,
        prefix_cache_hit_chunks=tree.num_revived,
        evicted_chunks=tree.num_evicted,
        retained_chunks=tree.num_retained,
        chunks_in_use=pool.num_used,
        kv_capacity_chunks=pool.capacity,
        bytes_per_chunk=pool.bytes_per_chunk,
        chunk_size=pool.chunk_size,
        attention_backend=":".join(filter(None, (backend["backend"], backend["isa"]))),
        attention_fallback_reason=backend["reason"],
        linear_backend=linear.backend(dtype, pool.device) + (
            ", GGUF blocks " + ", ".join(f"{t} x{n}" for t, n in sorted(engine._gguf_blocks.items()))
            + f" on {gguf_activations(engine.model)} activations" if engine._gguf_blocks else ""),
        weight_bytes=weight_bytes(engine.model),
        adapters=len(engine.adapters.names()),
        adapters_resident=engine.adapters.num_resident,
        adapter_bytes_resident=engine.adapters.resident_bytes,
        retained_chunks_by_adapter=engine.adapters.names_of_keys(tree.retained_by_key()),
        decode_graph_steps=engine.runner.graphs.counters["graph_steps"] if engine.runner.graphs is not None else 0,
    )


def weight_bytes(model) -> int:
    """Bytes the model's parameters and buffers hold (GGUF blocks included), each storage once
    (tied weights share one)."""
    storages = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        storages[(storage.data_ptr(), tensor.device)] = storage.nbytes()
    return sum(storages.values())


def gguf_activations(model) -> str:
    """What the model's GGUF blocks multiply ("int16", "int8", "float32", or two where formats differ)."""
    kinds = sorted({m.activations for m in model.modules() if isinstance(m, GGUFLinear)})
    return " and ".join(kinds) or "float32"


def describe(engine) -> str:
    """One line for a start-up log: device, dtype, kernels and the KV pool."""
    stats, pool = engine.stats, engine.cache.pool
    device = pool.device
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else isa.describe_host()
    attention = stats["attention_backend"]
    if stats["attention_fallback_reason"]:
        attention += f" ({stats['attention_fallback_reason']})"
    name = lambda t: str(t).removeprefix("torch.")  # noqa: E731
    return (f"chunk-llama: {device} ({where}), {name(engine.cache.geometry.dtype)}, weights "
            f"{stats['weight_bytes'] / 2**30:.2f} GiB; attention: {attention}; "
            f"linear layers: {stats['linear_backend']}; KV pool {pool.capacity * pool.bytes_per_chunk / 2**30:.2f} "
            f"GiB, {name(pool.dtype)} ({pool.capacity} chunks of {pool.chunk_size} tokens)")
