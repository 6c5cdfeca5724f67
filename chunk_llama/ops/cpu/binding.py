"""The CPU kernel library's C interface (`csrc/cpu/c_api.h`) bound with ctypes: one short
method per op, with the torch ops' old signatures (q, the layer's K/V pool, the plan as one
int64 tensor and its layout, the caller's scratch, then scalars).

Each method checks what only the tensors say (device, dtype, dimensions, contiguity), reads
their pointers and sizes, allocates the output and calls the library, which checks the rest
(geometry, the plan against the pool, the scratch's size) before it makes any pointer from
them; a failed check is a ValueError or TypeError with the library's message. A new op is
one declaration in `_SIGNATURES` and one method here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from chunk_llama.ops.build.c_types import F64, I32, I64, STR, P, int64_array

ABI_VERSION = 8  # CHUNK_LLAMA_CPU_ABI_VERSION in c_api.h
_ATTENTION = [P, I64, I64, I64, I32, P, P, I64, I64, I64, I64, I64, I64, I32, P, P, I64, P, I64, P, I64, F64, I64]
_SIGNATURES = {  # name: (argument types, result type), as c_api.h declares them
    "abi_version": ([], I32),
    "last_error": ([], STR),
    "variants": ([], STR),
    "host_runs": ([STR], I32),
    "decode_layout": ([], STR),
    "prefill_layout": ([], STR),
    "decode_scratch_floats": ([I64] * 5 + [P, I64, P, I64, I64], I64),
    "prefill_scratch_floats": ([I64] * 4, I64),
    "tpp_decode": ([*_ATTENTION, I64, STR, I32], I32),
    "tpp_prefill": ([*_ATTENTION, STR, I32], I32),
    "small_linear": ([P, I64, I64, P, I64, P, P, STR, I32], I32),
    "quant_linear": ([P, I64, I64, P, I64, I32, I64, P, P, STR, I32], I32),
    "dequantize": ([P, I64, I32, I64, I64, P, STR, I32], I32),
    "quant_row_bytes": ([I32, I64], I64),
    "quant_matmul": ([P], I32),  # a QuantMatmulArgs
    "int8_variant": ([STR], STR),
    # the layer, hidden in/out, rows, cos, sin, the writes (token, chunk, offset, count), row order,
    # then the pool and the decode call's tail as tpp_decode takes them
    "decoder_layer_decode": ([P, P, P, I64, P, P, P, P, P, I64, P, P, P, I64, I64, I64, I64, I64, I64, I32,
                              P, I64, P, I64, P, I64, F64, I64, I64, STR, I32], I32),
    # the same without the row order, then the pool and the prefill call's tail
    "decoder_layer_prefill": ([P, P, P, I64, P, P, P, P, P, I64, P, P, I64, I64, I64, I64, I64, I64, I32,
                               P, I64, P, I64, P, I64, F64, I64, STR, I32], I32),
    # the layers, their K and V pools (arrays of pointers), how many; hidden in/out, rows, each layer's
    # cos and sin (arrays of pointers), the writes, row order, then the pools' geometry (their extents:
    # arrays) and the decode call's tail with each layer's window (an array) for the call's one
    "decoder_stack_decode": ([P, P, P, I64, P, P, I64, P, P, P, P, P, I64, P, I64, I64, I64, I64, P, P, I32,
                              P, I64, P, I64, P, I64, F64, P, I64, STR, I32], I32),
}


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
ACTIVATIONS = {"float32": 0, "int8": 1}


class QuantMatmulArgs(ctypes.Structure):
    """chunk_llama_cpu_quant_matmul_args: y = x W^T (+ bias) on GGML blocks, activations as named."""
    _fields_ = [("x", P), ("rows", I64), ("in_features", I64), ("weight", P), ("weight_bytes", I64), ("type", I64),
                ("out_features", I64), ("bias", P), ("y", P), ("activations", I64), ("isa", STR),
                ("num_threads", I64)]


class DecoderStack:
    """Layers for `AttentionCall.decoder_stack`: their structs, K/V pools (kept alive: the
    arrays hold their addresses), checked to share one geometry, and attention windows (0:
    none)."""

    def __init__(self, layers: Sequence[DecoderLayer], k_caches: Sequence[torch.Tensor],
                 v_caches: Sequence[torch.Tensor], windows: Sequence[int]):
        if not (len(layers) == len(k_caches) == len(v_caches) == len(windows) >= 1):
            raise ValueError(f"a decoder stack needs one K and one V pool and a window per layer, got {len(layers)} "
                             f"layers, {len(k_caches)} and {len(v_caches)} pools, {len(windows)} windows")
        for k_cache, v_cache in zip(k_caches, v_caches):
            _check_pool(k_cache, v_cache)
        geometries = {(*k.shape, k.dtype) for k in (*k_caches, *v_caches)}
        if len(geometries) != 1:
            raise ValueError(f"a decoder stack's pools must share one shape and dtype, got {geometries}")
        self._kept = (tuple(layers), tuple(k_caches), tuple(v_caches))
        self.layers = (ctypes.POINTER(DecoderLayer) * len(layers))(*(ctypes.pointer(layer) for layer in layers))
        self.k_pointers = (ctypes.c_void_p * len(k_caches))(*(k.data_ptr() for k in k_caches))
        self.v_pointers = (ctypes.c_void_p * len(v_caches))(*(v.data_ptr() for v in v_caches))
        extents = int64_array([_extent(k) for k in k_caches]), int64_array([_extent(v) for v in v_caches])
        # (the C call's pool arguments after the pointers: capacity, KV heads, chunk size, head dim,
        # the extents, the dtype code)
        self.geometry = (*k_caches[0].shape, *extents, _DTYPE_CODES[k_caches[0].dtype])
        self.windows = int64_array(windows)


_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # CHUNK_LLAMA_FLOAT32, CHUNK_LLAMA_BFLOAT16
_ERRORS = {1: ValueError, 2: TypeError}


def _extent(cache: torch.Tensor) -> int:
    """Elements of `cache`'s memory from its first element on (the pool's guard chunk included)."""
    return cache.untyped_storage().nbytes() // cache.element_size() - cache.storage_offset()


def _check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if not (k_cache.is_cpu and v_cache.is_cpu):
        raise TypeError(f"the CPU kernel takes CPU tensors, got k_cache on {k_cache.device}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [capacity, num_kv_heads, chunk_size, head_dim], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in _DTYPE_CODES:
        raise TypeError(f"k_cache and v_cache must share a dtype the CPU kernel supports (float32, bfloat16), got "
                        f"{k_cache.dtype} and {v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def _check_float32(*tensors: torch.Tensor) -> None:
    """The fused calls read hidden states and rotary tables as float32 (a 16-bit model's are
    widened by the caller): anything else would be read as other numbers."""
    if any(t.dtype is not torch.float32 for t in tensors):
        raise TypeError(f"a fused call takes float32 hidden states, cos and sin, got "
                        f"{sorted({str(t.dtype) for t in tensors})}")


def _check_plan(plan: torch.Tensor, what: str) -> None:
    if not (plan.is_cpu and plan.dtype == torch.int64):
        raise TypeError(f"the {what} plan must be an int64 CPU tensor, got {plan.dtype} on {plan.device}")
    if not plan.is_contiguous():
        raise ValueError(f"the {what} plan must be contiguous")


def _check_scratch(scratch: torch.Tensor) -> None:
    if not (scratch.is_cpu and scratch.dtype == torch.float32 and scratch.is_contiguous()):
        raise ValueError(f"scratch must be a contiguous float32 CPU tensor, got {scratch.dtype} on {scratch.device}")


class AttentionCall:
    """One plan's calls of an attention op, per layer: what the plan fixes (its arrays,
    layout, scratch and scalars) is checked and converted once, and each layer's K/V pool
    the first time it comes, so a call checks q, allocates the output and passes the
    pointers (the per-call cost of ctypes grows with what Python converts; see BENCHMARKS).
    Valid while the plan's tensors and the pools keep their memory (one step)."""

    def __init__(self, library: "CpuLibrary", function, q_shape: str, plan: torch.Tensor, layout,
                 scratch: torch.Tensor, tail: tuple):
        _check_plan(plan, q_shape.split()[0])
        _check_scratch(scratch)
        layout = layout if isinstance(layout, ctypes.Array) else int64_array(layout)
        self._library, self._function, self._q_shape = library, function, q_shape
        self._tensors = (plan, layout, scratch)  # kept alive: the call holds their addresses
        self._after_out = (plan.data_ptr(), plan.numel(), layout, len(layout), scratch.data_ptr(), scratch.numel(),
                           *tail)
        self._pools: dict[int, tuple] = {}

    def _pool_args(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
        entry = self._pools.get(id(k_cache))
        if entry is None or entry[0] is not k_cache or entry[1] is not v_cache:
            _check_pool(k_cache, v_cache)
            entry = self._pools[id(k_cache)] = (
                k_cache, v_cache, (k_cache.data_ptr(), v_cache.data_ptr(), *k_cache.shape, _extent(k_cache),
                                   _extent(v_cache), _DTYPE_CODES[k_cache.dtype]))
        return entry[2]

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [num rows, num_heads, head_dim] (contiguous; float32 or bfloat16, whichever the
        pool's dtype: float32 over a bfloat16 pool is kv_dtype's case) -> the same shape and dtype"""
        pool = self._pool_args(k_cache, v_cache)
        if not (q.is_cpu and q.dim() == 3 and q.dtype in _DTYPE_CODES and q.is_contiguous()):
            self._reject(q)
        out = torch.empty_like(q)
        code = self._function(q.data_ptr(), *q.shape, _DTYPE_CODES[q.dtype], *pool, out.data_ptr(), *self._after_out)
        return out if code == 0 else self._library.raise_error(code)

    def decoder_layer(self, layer: DecoderLayer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      writes: tuple, row_order: torch.Tensor | None, k_cache: torch.Tensor,
                      v_cache: torch.Tensor) -> torch.Tensor:
        """A call of the whole layer whose attention this call plans, a decode step's or a
        prefill's (`hf/fused/layers.py` has checked dtypes, devices and contiguity): hidden
        [rows, hidden_size], cos and sin [rows, head_dim], float32; writes: (token, chunk,
        offset) int64 tensors of the step's K/V slots; row_order [rows] int64 (decode: the
        plan's row i is batch row row_order[i]) or None -> [rows, hidden_size]"""
        pool = self._pool_args(k_cache, v_cache)
        _check_float32(hidden, cos, sin)
        out = torch.empty_like(hidden)
        token, chunk, offset = writes
        head = (ctypes.byref(layer), hidden.data_ptr(), out.data_ptr(), hidden.shape[0], cos.data_ptr(),
                sin.data_ptr(), token.data_ptr(), chunk.data_ptr(), offset.data_ptr(), token.numel())
        if self._function is self._library.tpp_prefill_function:
            if row_order is not None:
                raise ValueError("a prefill's rows have no row order")
            code = self._library.decoder_layer_prefill(*head, *pool, *self._after_out)
        else:
            code = self._library.decoder_layer_decode(*head, None if row_order is None else row_order.data_ptr(),
                                                      *pool, *self._after_out)
        return out if code == 0 else self._library.raise_error(code)

    def decoder_stack(self, stack: "DecoderStack", hidden: torch.Tensor, cos: Sequence[torch.Tensor],
                      sin: Sequence[torch.Tensor], writes: tuple, row_order: torch.Tensor | None) -> torch.Tensor:
        """`decoder_layer` of every layer of `stack` in a row, in one call (the same arguments
        but cos and sin, one of each per layer; the pools and windows are the stack's, the
        call's own window unused) -> [rows, hidden_size]"""
        if not len(cos) == len(sin) == len(stack.k_pointers):
            raise ValueError(f"a decoder stack of {len(stack.k_pointers)} layers takes a cos and a sin per layer, got "
                             f"{len(cos)} and {len(sin)}")
        _check_float32(hidden, *cos, *sin)
        out = torch.empty_like(hidden)
        token, chunk, offset = writes
        pointers = ctypes.c_void_p * len(cos)
        head, (scale, _window, *rest) = self._after_out[:-5], self._after_out[-5:]  # (the decode call's tail)
        code = self._library.decoder_stack_decode(
            stack.layers, stack.k_pointers, stack.v_pointers, len(stack.k_pointers), hidden.data_ptr(),
            out.data_ptr(), hidden.shape[0], pointers(*(c.data_ptr() for c in cos)),
            pointers(*(s.data_ptr() for s in sin)), token.data_ptr(), chunk.data_ptr(), offset.data_ptr(),
            token.numel(), None if row_order is None else row_order.data_ptr(), *stack.geometry, *head, scale,
            stack.windows, *rest)
        return out if code == 0 else self._library.raise_error(code)

    def _reject(self, q: torch.Tensor):
        if not q.is_cpu:
            raise TypeError(f"the CPU kernel takes CPU tensors, got q on {q.device}")
        if q.dim() != 3:
            raise ValueError(f"{self._q_shape}, got {list(q.shape)}")
        if q.dtype not in _DTYPE_CODES:
            raise TypeError(f"q must be float32 or bfloat16 for the CPU kernel, got {q.dtype}")
        raise ValueError("q must be contiguous")


class CpuLibrary:
    """The CPU kernels of one loaded library (`path`; `origin`: "prebuilt" from the wheel or
    "built" on first use). ValueError if the library's C interface is another version."""

    def __init__(self, path: Path, origin: str):
        self.path, self.origin = Path(path), origin
        lib = ctypes.CDLL(str(path))
        for name, (argtypes, restype) in _SIGNATURES.items():
            function = getattr(lib, f"chunk_llama_cpu_{name}")
            function.argtypes, function.restype = argtypes, restype
        if lib.chunk_llama_cpu_abi_version() != ABI_VERSION:
            raise ValueError(f"{path.name} has C interface version {lib.chunk_llama_cpu_abi_version()}, this "
                             f"chunk-llama needs {ABI_VERSION}")
        self._lib = lib
        self.decoder_layer_decode = lib.chunk_llama_cpu_decoder_layer_decode
        self.decoder_layer_prefill = lib.chunk_llama_cpu_decoder_layer_prefill
        self.tpp_prefill_function = lib.chunk_llama_cpu_tpp_prefill
        self.decoder_stack_decode = lib.chunk_llama_cpu_decoder_stack_decode

    def raise_error(self, code: int):
        """The library's last error as ValueError (code 1), TypeError (2) or RuntimeError."""
        raise _ERRORS.get(code, RuntimeError)(self._lib.chunk_llama_cpu_last_error().decode())

    def decode_call(self, plan: torch.Tensor, layout, scratch: torch.Tensor, scale: float, window: int,
                    max_blocks_per_item: int, isa: str) -> AttentionCall:
        """Decode attention for one plan (`DecodePlan.index`, `.layout`), called per layer as
        (q [num_seqs, num_heads, head_dim] in plan order, k_cache, v_cache [capacity,
        num_kv_heads, chunk_size, head_dim]) -> [num_seqs, num_heads, head_dim].
        max_blocks_per_item: shared blocks of keys per first-phase work item (0: chosen)."""
        return AttentionCall(self, self._lib.chunk_llama_cpu_tpp_decode,
                             "decode q must be [num_seqs, num_heads, head_dim]", plan, layout, scratch,
                             (float(scale), window, max_blocks_per_item, isa.encode(), torch.get_num_threads()))

    def prefill_call(self, plan: torch.Tensor, layout, scratch: torch.Tensor, scale: float, window: int,
                     isa: str) -> AttentionCall:
        """Packed prefill attention for one plan (`PrefillPlan.cpu()`'s index and layout), called
        per layer as (q [num_q_tokens, num_heads, head_dim], k_cache, v_cache) -> the same
        shape as q (rows of no sequence unset)"""
        return AttentionCall(self, self._lib.chunk_llama_cpu_tpp_prefill,
                             "prefill q must be [num_q_tokens, num_heads, head_dim]", plan, layout, scratch,
                             (float(scale), window, isa.encode(), torch.get_num_threads()))

    def tpp_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: torch.Tensor,
                   layout, scratch: torch.Tensor, scale: float, window: int, max_blocks_per_item: int,
                   isa: str) -> torch.Tensor:
        """One decode call (`decode_call` once, then per layer, is the cheap way)."""
        return self.decode_call(plan, layout, scratch, scale, window, max_blocks_per_item, isa)(q, k_cache, v_cache)

    def tpp_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: torch.Tensor,
                    layout, scratch: torch.Tensor, scale: float, window: int, isa: str) -> torch.Tensor:
        """One prefill call (`prefill_call` once, then per layer, is the cheap way)."""
        return self.prefill_call(plan, layout, scratch, scale, window, isa)(q, k_cache, v_cache)

    def small_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, isa: str) -> torch.Tensor:
        """y = x W^T (+ bias): x [rows, in], weight [out, in] (an nn.Linear's, in place),
        float32 CPU tensors -> [rows, out]"""
        if not (x.is_cpu and weight.is_cpu and x.dtype == torch.float32 and weight.dtype == torch.float32):
            raise TypeError(f"small_linear takes float32 CPU tensors, got x {x.dtype} on {x.device}, weight "
                            f"{weight.dtype} on {weight.device}")
        if not (x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and x.is_contiguous()
                and weight.is_contiguous()):
            raise ValueError(f"small_linear needs contiguous x [rows, in] and weight [out, in], got "
                             f"{list(x.shape)} and {list(weight.shape)}")
        if bias is not None and not (bias.is_cpu and bias.dtype == torch.float32 and bias.dim() == 1
                                     and bias.shape[0] == weight.shape[0] and bias.is_contiguous()):
            raise ValueError(f"small_linear's bias must be a contiguous float32 CPU vector of {weight.shape[0]}")
        y = x.new_empty((x.shape[0], weight.shape[0]))
        code = self._lib.chunk_llama_cpu_small_linear(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(),
                                                      weight.shape[0], None if bias is None else bias.data_ptr(),
                                                      y.data_ptr(), isa.encode(), torch.get_num_threads())
        return y if code == 0 else self.raise_error(code)

    def small_linear_call(self, isa: str):
        """`small_linear` for `ops/cpu/linear.py`'s hot path, which has already checked that x,
        weight and bias are float32, on the CPU and contiguous: per call only the shapes that
        guard memory are checked (a decode step makes about 7 calls per layer, so each
        microsecond of checks and conversions is a few hundred per step)."""
        function, variant, threads, raise_error = (self._lib.chunk_llama_cpu_small_linear, isa.encode(),
                                                   torch.get_num_threads, self.raise_error)

        def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            # x [rows, in], weight [out, in], bias [out] -> [rows, out]
            rows, features = x.shape
            out_features, weight_features = weight.shape
            if weight_features != features or (bias is not None and bias.shape != (out_features,)):
                raise ValueError(f"small_linear: x {list(x.shape)}, weight {list(weight.shape)} and bias "
                                 f"{None if bias is None else list(bias.shape)} do not fit")
            y = x.new_empty((rows, out_features))
            code = function(x.data_ptr(), rows, features, weight.data_ptr(), out_features,
                            None if bias is None else bias.data_ptr(), y.data_ptr(), variant, threads())
            return y if code == 0 else raise_error(code)

        return call

    def quant_row_bytes(self, ggml_type: int, in_features: int) -> int:
        """Bytes of one row of `in_features` weights in a GGML block format (ValueError for a
        type the kernels do not decode or a row that is not whole blocks)."""
        row_bytes = self._lib.chunk_llama_cpu_quant_row_bytes(ggml_type, in_features)
        return row_bytes if row_bytes >= 0 else self.raise_error(1)

    def quant_linear_call(self, ggml_type: int, in_features: int, isa: str):
        """y = x W^T (+ bias) on a weight kept in GGML blocks, for `ops/cpu/quant_linear.py`,
        which has checked dtypes, devices and contiguity: (x [rows, in_features] float32,
        weight [out_features, row_bytes] uint8, bias [out_features] float32 or None) ->
        [rows, out_features]. The library checks the weight's size against the shapes."""
        function, variant, threads, raise_error = (self._lib.chunk_llama_cpu_quant_linear, isa.encode(),
                                                   torch.get_num_threads, self.raise_error)

        def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            rows, features = x.shape
            out_features = weight.shape[0]
            if features != in_features or (bias is not None and bias.shape != (out_features,)):
                raise ValueError(f"quant_linear: x {list(x.shape)} and bias {None if bias is None else list(bias.shape)}"
                                 f" do not fit a weight of {out_features} rows of {in_features}")
            y = x.new_empty((rows, out_features))
            code = function(x.data_ptr(), rows, features, weight.data_ptr(), weight.numel(), ggml_type, out_features,
                            None if bias is None else bias.data_ptr(), y.data_ptr(), variant, threads())
            return y if code == 0 else raise_error(code)

        return call

    def quant_matmul_call(self, ggml_type: int, in_features: int, isa: str, activations: str):
        """`quant_linear_call`'s op with a choice of activations ("float32", or "int8": x quantized
        per group of 32, the kernel of `int8_variant(isa)`), the same contract."""
        function, threads, raise_error = self._lib.chunk_llama_cpu_quant_matmul, torch.get_num_threads, self.raise_error
        code_of, variant = ACTIVATIONS[activations], isa.encode()

        def call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            rows, features = x.shape
            out_features = weight.shape[0]
            if features != in_features or (bias is not None and bias.shape != (out_features,)):
                raise ValueError(f"quant_matmul: x {list(x.shape)} and bias {None if bias is None else list(bias.shape)}"
                                 f" do not fit a weight of {out_features} rows of {in_features}")
            y = x.new_empty((rows, out_features))
            args = QuantMatmulArgs(x.data_ptr(), rows, features, weight.data_ptr(), weight.numel(), ggml_type,
                                   out_features, None if bias is None else bias.data_ptr(), y.data_ptr(), code_of,
                                   variant, threads())  # (one per call: a layer may run in several threads)
            code = function(ctypes.byref(args))
            return y if code == 0 else raise_error(code)

        return call

    def int8_variant(self, isa: str) -> str:
        """The variant whose int8 kernel runs for variant `isa` here (itself, or the next one down
        that this CPU runs the integer code of: AVX-512 without VNNI runs avx2's)."""
        name = self._lib.chunk_llama_cpu_int8_variant(isa.encode())
        return name.decode() if name is not None else self.raise_error(1)

    def dequantize(self, weight: torch.Tensor, ggml_type: int, in_features: int, isa: str) -> torch.Tensor:
        """weight [num_rows, row_bytes] uint8 (contiguous, on the CPU) in a GGML block format ->
        float32 [num_rows, in_features]."""
        if not (weight.is_cpu and weight.dtype == torch.uint8 and weight.dim() == 2 and weight.is_contiguous()):
            raise TypeError(f"dequantize takes a contiguous uint8 CPU matrix of blocks, got {weight.dtype} "
                            f"{list(weight.shape)} on {weight.device}")
        out = torch.empty((weight.shape[0], in_features))
        code = self._lib.chunk_llama_cpu_dequantize(weight.data_ptr(), weight.numel(), ggml_type, weight.shape[0],
                                                    in_features, out.data_ptr(), isa.encode(), torch.get_num_threads())
        return out if code == 0 else self.raise_error(code)

    def decode_scratch_floats(self, plan: torch.Tensor, layout, num_seqs: int, num_heads: int, head_dim: int,
                              num_kv_heads: int, chunk_size: int, num_threads: int) -> int:
        """Floats of scratch a decode call on this plan (`DecodePlan.index`, layout as an int64
        array) needs, whatever its window."""
        if plan.dtype != torch.int64 or not plan.is_cpu or not plan.is_contiguous():
            raise TypeError(f"the plan must be a contiguous int64 CPU tensor, got {plan.dtype} on {plan.device}")
        floats = self._lib.chunk_llama_cpu_decode_scratch_floats(
            num_seqs, num_heads, head_dim, num_kv_heads, chunk_size, plan.data_ptr(), plan.numel(),
            layout, len(layout), num_threads)
        return floats if floats >= 0 else self.raise_error(1)

    def prefill_scratch_floats(self, num_partial_rows: int, num_heads: int, head_dim: int, num_threads: int) -> int:
        """Floats of scratch a prefill call needs."""
        return self._lib.chunk_llama_cpu_prefill_scratch_floats(num_partial_rows, num_heads, head_dim, num_threads)

    def decode_layout(self) -> list[str]:
        """The decode plan's array names in layout order (the Python side checks its own)."""
        return self._lib.chunk_llama_cpu_decode_layout().decode().split(",")

    def prefill_layout(self) -> list[str]:
        return self._lib.chunk_llama_cpu_prefill_layout().decode().split(",")

    def variants(self) -> list[str]:
        """The variants in this build, best first."""
        return self._lib.chunk_llama_cpu_variants().decode().split(",")

    def host_runs(self, isa: str) -> bool:
        """Whether this CPU runs the variant (False for one not in this build)."""
        return bool(self._lib.chunk_llama_cpu_host_runs(isa.encode()))
