"""The CPU library's parameter structs (`csrc/cpu/c_api.h`) as ctypes structures, and the
pool checks every struct that points into a K/V pool is made after.

What is fixed for a step or a layer crosses the C boundary as one of these, made once: a
plan's parameters (`PlanParams`, once per step), a made plan as its calls name it
(`Planned`), a layer's pool with its scale and window (`Kv`, once per pool), a decoder
layer's weights (`DecoderLayer`, once per description), a model's layers in a row
(`DecoderStackArgs`), an adapter's LoRA factors for them (`LoraFactor`s, once per adapter
and layers) and a step's rows by adapter (`LoraSegment`s in `LoraRowsArgs`, once per step).
Keep the fields in c_api.h's order.
"""

from __future__ import annotations

import ctypes

import torch

from chunk_llama.ops.build.c_types import F64, I32, I64, STR, P

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # q's: CHUNK_LLAMA_FLOAT32, CHUNK_LLAMA_BFLOAT16
POOL_DTYPE_CODES = {**DTYPE_CODES, torch.float16: 2}  # a pool's also CHUNK_LLAMA_CPU_FLOAT16
DECODE_PLAN, PREFILL_PLAN = 0, 1  # CHUNK_LLAMA_DECODE_PLAN, CHUNK_LLAMA_PREFILL_PLAN
U64 = ctypes.c_uint64


class Weight(ctypes.Structure):
    """chunk_llama_cpu_weight: a linear layer's float32 weight (type 0) or GGML blocks."""
    _fields_ = [("data", P), ("bias", P), ("type", I64), ("out_features", I64), ("in_features", I64),
                ("bytes", I64)]


class DecoderLayer(ctypes.Structure):
    """chunk_llama_cpu_decoder_layer: a Llama-family layer's sizes, norms and weights."""
    _fields_ = [("hidden_size", I64), ("num_heads", I64), ("num_kv_heads", I64), ("head_dim", I64),
                ("intermediate_size", I64), ("activation", I64), ("norm_eps", F64), ("norm_offset", F64),
                *((name, P) for name in ("input_norm", "q_norm", "k_norm", "attn_out_norm", "mlp_norm",
                                         "mlp_out_norm")),
                *((name, Weight) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                ("activations", I64)]  # ACTIVATIONS' code


# chunk_llama_cpu_quant_matmul's activations (CHUNK_LLAMA_ACTIVATIONS_* in c_api.h)
ACTIVATIONS = {"float32": 0, "int8": 1, "int16": 2}


class QuantMatmulArgs(ctypes.Structure):
    """chunk_llama_cpu_quant_matmul_args: y = x W^T (+ bias) on GGML blocks, activations as named."""
    _fields_ = [("x", P), ("rows", I64), ("in_features", I64), ("weight", P), ("weight_bytes", I64), ("type", I64),
                ("out_features", I64), ("bias", P), ("y", P), ("activations", I64), ("isa", STR),
                ("num_threads", I64)]


class PlanParams(ctypes.Structure):
    """chunk_llama_cpu_plan_params: what a step's plan is checked against and holds."""
    _fields_ = [("kind", I32), ("num_threads", I32), ("index", P), ("index_numel", I64), ("layout", P),
                ("layout_size", I64), ("q_rows", I64), ("num_heads", I64), ("num_kv_heads", I64), ("head_dim", I64),
                ("capacity", I64), ("chunk_size", I64), ("write_token", P), ("write_chunk", P), ("write_offset", P),
                ("num_writes", I64), ("row_order", P), ("max_blocks_per_item", I64), ("isa", STR)]


class Planned(ctypes.Structure):
    """chunk_llama_cpu_planned: a made plan as each call of its step names it."""
    _fields_ = [("plan", P), ("generation", U64), ("scratch", P), ("scratch_numel", I64)]


class Kv(ctypes.Structure):
    """chunk_llama_cpu_kv: one layer's K/V pool, its scale and sliding window (0: none)."""
    _fields_ = [("k", P), ("v", P), ("capacity", I64), ("num_kv_heads", I64), ("chunk_size", I64),
                ("head_dim", I64), ("k_extent", I64), ("v_extent", I64), ("window", I64), ("scale", F64),
                ("dtype", I32)]


class DecoderStackArgs(ctypes.Structure):
    """chunk_llama_cpu_decoder_stack: layers and their Kv structs, in a row."""
    _fields_ = [("layers", P), ("kvs", P), ("num_layers", I64)]


class LoraFactor(ctypes.Structure):
    """chunk_llama_cpu_lora_factor: a [rank, in_features] and b [out_features, rank], float32."""
    _fields_ = [("a", P), ("b", P), ("rank", I64), ("in_features", I64), ("out_features", I64), ("scale", F64)]


class LoraSegment(ctypes.Structure):
    """chunk_llama_cpu_lora_segment: rows under one adapter and its factors' table."""
    _fields_ = [("row_start", I64), ("row_end", I64), ("factors", P), ("index", P), ("num_layers", I64)]


class LoraRowsArgs(ctypes.Structure):
    """chunk_llama_cpu_lora_rows: a step's segments."""
    _fields_ = [("segments", P), ("num_segments", I64)]


def extent(cache: torch.Tensor) -> int:
    """Elements of `cache`'s memory from its first element on (the pool's guard chunk included)."""
    return cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset()


def check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What only the tensors say about a layer's K/V pool (TypeError or ValueError naming it)."""
    if not (k_cache.is_cpu and v_cache.is_cpu):
        raise TypeError(f"the CPU kernel takes CPU tensors, got k_cache on {k_cache.device}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [capacity, num_kv_heads, chunk_size, head_dim], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in POOL_DTYPE_CODES:
        raise TypeError("k_cache and v_cache must share a dtype the CPU kernel supports (float32, bfloat16, "
                        f"float16), got {k_cache.dtype} and {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


class LayerKv:
    """A layer's `Kv` for its pool tensors, scale and window, made once: the pools live as long
    as their cache (and this holds them: no other memory can take their addresses)."""

    __slots__ = ("k_cache", "v_cache", "struct", "address")

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int):
        check_pool(k_cache, v_cache)
        self.k_cache, self.v_cache = k_cache, v_cache  # (kept alive: the struct holds their addresses)
        self.struct = Kv(k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.shape, extent(k_cache), extent(v_cache),
                         int(window), float(scale), POOL_DTYPE_CODES[k_cache.dtype])
        self.address = ctypes.addressof(self.struct)

    def fits(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Whether tensors at this struct's addresses are the pools it describes: the same shape,
        dtype and layout (at those addresses, while this holds the memory, they are views of it)."""
        k, v = self.k_cache, self.v_cache
        return (k_cache.shape == k.shape and v_cache.shape == v.shape and k_cache.dtype is k.dtype
                and v_cache.dtype is v.dtype and k_cache.is_contiguous() and v_cache.is_contiguous())


class KvTable:
    """Each layer's `LayerKv`, by the pools' addresses, scale and window (a pool's layer is a
    new view object at every `pool.k[layer]`, at the same address): kept by a backend across
    steps. A pool at a new address (replaced, reallocated) gets its own, checked anew."""

    def __init__(self):
        self._kvs: dict[tuple, LayerKv] = {}

    def get(self, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int) -> LayerKv:
        key = (k_cache.data_ptr(), v_cache.data_ptr(), scale, window)
        kv = self._kvs.get(key)
        if kv is None or not kv.fits(k_cache, v_cache):
            kv = self._kvs[key] = LayerKv(k_cache, v_cache, scale, window)
        return kv
