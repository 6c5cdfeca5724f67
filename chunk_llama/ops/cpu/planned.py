"""A step's plan made once in the CPU library, and the calls each layer makes on it.

`PlanHandle` owns a C plan handle (`chunk_llama_cpu_plan`): a backend makes one and plans
it again each step, in place (`make`: the library checks every array of the plan tensor
and every segment against the pool geometry, copies them, builds the decode schedule and
says how much scratch a call needs). `make` returns a `CpuPlanned`, the step's calls: the
attention (`run`), a fused decoder layer and a model's stack of them, each passing the
made plan, the layer's pool struct (`structs.LayerKv`, made once per pool) and the call's
own tensors: about five arguments, O(1) checks. A `CpuPlanned` of an earlier step names
an older generation of its handle, and the library refuses it (ValueError): a stale plan
is never read.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence

import torch

from chunk_llama.ops.build.c_types import int64_array
from chunk_llama.ops.cpu import structs
from chunk_llama.ops.cpu.structs import (
    DTYPE_CODES,
    DecoderLayer,
    DecoderStackArgs,
    KvTable,
    Planned,
    PlanParams,
)


class DecoderStack:
    """Layers for `CpuPlanned.decoder_stack`: their structs and each one's `Kv` (its pool,
    scale and window), checked to share one pool geometry; the arrays keep them alive."""

    def __init__(self, layers: Sequence[DecoderLayer], kvs: Sequence[structs.LayerKv]):
        if not len(layers) == len(kvs) >= 1:
            raise ValueError(f"a decoder stack needs one pool per layer, got {len(layers)} layers and {len(kvs)} pools")
        geometries = {(*kv.k_cache.shape, kv.k_cache.dtype) for kv in kvs}
        if len(geometries) != 1:
            raise ValueError(f"a decoder stack's pools must share one shape and dtype, got {geometries}")
        self.kvs = tuple(kvs)
        self._layers = tuple(layers)
        self._layer_array = (ctypes.POINTER(DecoderLayer) * len(layers))(*(ctypes.pointer(layer) for layer in layers))
        self._kv_array = (structs.Kv * len(kvs))(*(kv.struct for kv in kvs))  # (copies: the pools' values)
        self.args = DecoderStackArgs(ctypes.addressof(self._layer_array), ctypes.addressof(self._kv_array), len(kvs))
        self.address = ctypes.addressof(self.args)

    @property
    def num_layers(self) -> int:
        return len(self.kvs)


class PlanHandle:
    """A C plan handle of `library`, freed with this object."""

    def __init__(self, library):
        self._library = library
        self.pointer = library.plan_new()
        if not self.pointer:
            raise MemoryError("the CPU library could not allocate a plan handle")
        self._free = weakref.finalize(self, library.plan_free, self.pointer)

    def make(self, kind: int, index: torch.Tensor, layout: Sequence[int], geometry: tuple[int, int, int, int, int],
             capacity: int, scratch_of, variant: str, writes: tuple | None = None,
             row_order: torch.Tensor | None = None, max_blocks_per_item: int = 0,
             kvs: KvTable | None = None) -> "CpuPlanned":
        """Plan `index` (int64, contiguous, on the CPU; its `layout`) into this handle for query
        rows and heads `geometry` = (q_rows, num_heads, num_kv_heads, head_dim, chunk_size) over
        pools of `capacity` chunks; `scratch_of(floats)` gives the step's scratch (the caller's
        buffers); writes: the step's (token, chunk, offset) int64 tensors the fused layers
        store, and row_order (decode) for them, or None; kvs: the pools' structs the calls reuse
        (a backend keeps one across steps; default: a new table). Returns the step's calls."""
        for name, tensor in (("plan", index), *zip(("write token", "write chunk", "write offset"), writes or ()),
                             ("row order", row_order)):
            if tensor is not None and not (tensor.is_cpu and tensor.dtype == torch.int64 and tensor.is_contiguous()):
                raise TypeError(f"the {name} tensor must be a contiguous int64 CPU tensor, got {tensor.dtype} on "
                                f"{tensor.device}")
        q_rows, num_heads, num_kv_heads, head_dim, chunk_size = geometry
        layout_array = int64_array(layout)
        token, chunk, offset = writes if writes is not None else (None, None, None)
        params = PlanParams(kind, torch.get_num_threads(), index.data_ptr(), index.numel(),
                            ctypes.addressof(layout_array), len(layout), q_rows, num_heads, num_kv_heads, head_dim,
                            capacity, chunk_size, *(None if t is None else t.data_ptr() for t in (token, chunk, offset)),
                            0 if token is None else token.numel(), None if row_order is None else row_order.data_ptr(),
                            max_blocks_per_item, variant.encode())
        generation, floats = self._library.plan_make(self.pointer, params)
        return CpuPlanned(self, generation, scratch_of(floats), (q_rows, num_heads, head_dim), writes is not None,
                          row_order is not None, kvs)


class CpuPlanned:
    """One step's made plan: every layer's attention and fused layer runs through it. Valid
    for its step only (the handle's next plan makes it stale: refused, never read)."""

    def __init__(self, handle: PlanHandle, generation: int, scratch: torch.Tensor, q_shape: tuple[int, int, int],
                 has_writes: bool, reordered: bool = False, kvs: KvTable | None = None):
        if not (scratch.is_cpu and scratch.dtype == torch.float32 and scratch.is_contiguous()):
            raise ValueError(f"scratch must be a contiguous float32 CPU tensor, got {scratch.dtype} on "
                             f"{scratch.device}")
        self._kept = (handle, scratch)  # (the struct holds their addresses)
        self._planned = Planned(handle.pointer, generation, scratch.data_ptr(), scratch.numel())
        self._address = ctypes.addressof(self._planned)
        library = handle._library
        self._attend, self._layer_run, self._stack_run = library.attend, library.decoder_layer_run, \
            library.decoder_stack_run
        self._raise = library.raise_error
        self.prefetch_call = library.prefetch_call  # (`hf/fused/stack.py`'s `Stack.warm`)
        self.q_shape = q_shape  # [q_rows, num_heads, head_dim]
        self.has_writes = has_writes  # the step's K/V slots are planned: the fused layers may run
        self.reordered = reordered  # a row order is planned: plan row i is the fused layers' batch row row_order[i]
        self.kvs = kvs if kvs is not None else KvTable()  # the pools' structs (a backend's: kept across steps)

    @property
    def generation(self) -> int:
        return self._planned.generation

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int = 0,
            new_kv=None) -> torch.Tensor:
        """q: [q_rows, num_heads, head_dim] in plan order (float32 or bfloat16: float32 over a
        bfloat16 or float16 pool is kv_dtype's case); k_cache, v_cache: [capacity, num_kv_heads, chunk_size,
        head_dim] -> q's shape and dtype"""
        kv = self.kvs.get(k_cache, v_cache, scale, window)
        q = q.contiguous()
        code = DTYPE_CODES.get(q.dtype)
        if code is None or q.shape != self.q_shape or not q.is_cpu:
            self._reject(q)
        out = torch.empty_like(q)
        status = self._attend(self._address, kv.address, q.data_ptr(), code, out.data_ptr())
        return out if status == 0 else self._raise(status)

    def decoder_layer(self, layer: DecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, window: int, lora=None,
                      layer_index: int = 0) -> torch.Tensor:
        """The whole layer on this step (its K/V stored to the planned slots, then its attention):
        hidden [q_rows, hidden_size], cos and sin [q_rows, head_dim], float32 and contiguous on
        the CPU (`hf/fused/layers.py` checked dtypes, devices and contiguity) -> [q_rows, hidden_size].
        lora: the step's rows by adapter (`ops/cpu/lora.py`'s `LoraStepRows`, its tables' layer
        `layer_index`), or None"""
        self._check_layer_inputs(hidden, layer.hidden_size, cos, sin)
        kv = self.kvs.get(k_cache, v_cache, scale, window)
        out = torch.empty_like(hidden)
        status = self._layer_run(self._address, ctypes.addressof(layer), kv.address, hidden.data_ptr(),
                                 out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                 None if lora is None else lora.address, layer_index)
        return out if status == 0 else self._raise(status)

    def decoder_stack(self, stack: DecoderStack, hidden: torch.Tensor, cos: Sequence[torch.Tensor],
                      sin: Sequence[torch.Tensor], lora=None) -> torch.Tensor:
        """`decoder_layer` of every layer of `stack` in a row, in one call, layer i with its own
        cos[i] and sin[i] (and layer i of lora's tables) -> [q_rows, hidden_size]"""
        if not len(cos) == len(sin) == stack.num_layers:
            raise ValueError(f"a decoder stack of {stack.num_layers} layers takes a cos and a sin per layer, got "
                             f"{len(cos)} and {len(sin)}")
        address = {}  # each distinct table, checked once (most families give every layer the same two)
        for c, s in zip(cos, sin):
            if id(c) not in address or id(s) not in address:
                self._check_layer_inputs(hidden, stack._layers[0].hidden_size, c, s)
                address[id(c)], address[id(s)] = c.data_ptr(), s.data_ptr()
        out = torch.empty_like(hidden)
        pointers = ctypes.c_void_p * len(cos)
        status = self._stack_run(self._address, stack.address, hidden.data_ptr(), out.data_ptr(),
                                 pointers(*(address[id(c)] for c in cos)), pointers(*(address[id(s)] for s in sin)),
                                 None if lora is None else lora.address)
        return out if status == 0 else self._raise(status)

    def _check_layer_inputs(self, hidden: torch.Tensor, hidden_size: int, cos: torch.Tensor, sin: torch.Tensor):
        """The fused calls read hidden states and rotary tables as float32 of the plan's rows
        (a 16-bit model's are widened by the caller): anything else would be read as other
        numbers or out of bounds."""
        rows, _, head_dim = self.q_shape
        if any(t.dtype is not torch.float32 for t in (hidden, cos, sin)):
            raise TypeError(f"a fused call takes float32 hidden states, cos and sin, got "
                            f"{sorted({str(t.dtype) for t in (hidden, cos, sin)})}")
        if hidden.shape != (rows, hidden_size) or cos.shape != (rows, head_dim) or sin.shape != cos.shape:
            raise ValueError(f"a fused call on this plan takes hidden [{rows}, {hidden_size}], cos and sin [{rows}, "
                             f"{head_dim}], got {list(hidden.shape)}, {list(cos.shape)} and {list(sin.shape)}")

    def _reject(self, q: torch.Tensor):
        if not q.is_cpu:
            raise TypeError(f"the CPU kernel takes CPU tensors, got q on {q.device}")
        if q.dtype not in DTYPE_CODES:
            raise TypeError(f"q must be float32 or bfloat16 for the CPU kernel, got {q.dtype}")
        raise ValueError(f"q must be {list(self.q_shape)} (the plan's rows, the model's heads), got {list(q.shape)}")
