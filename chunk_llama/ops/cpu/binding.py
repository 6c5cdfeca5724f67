"""The CPU kernel library's C interface (`csrc/cpu/c_api.h`) bound with ctypes: loading it,
its errors, the linear ops and the attention's plan handle.

The attention and the fused decoder layers go through a step's made plan (`planned.py`):
the plan crosses into C once per step and a layer's call passes that, its pool's struct and
its own tensors (`structs.py` holds the structs). The linear ops take their tensors per
call (a weight's pointer and sizes: the few scalars a call needs). Each method checks what
only the tensors say (device, dtype, dimensions, contiguity); the library checks the rest
before it makes any pointer from them, and a failed check is a ValueError or TypeError with
the library's message. A new op is one declaration in `_SIGNATURES` and one method here.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from chunk_llama.ops.build.c_types import I32, I64, STR, P
from chunk_llama.ops.cpu.planned import PlanHandle
from chunk_llama.ops.cpu.structs import ACTIVATIONS, U64, QuantMatmulArgs

ABI_VERSION = 14  # CHUNK_LLAMA_CPU_ABI_VERSION in c_api.h
_SIGNATURES = {  # name: (argument types, result type), as c_api.h declares them
    "abi_version": ([], I32),
    "last_error": ([], STR),
    "variants": ([], STR),
    "host_runs": ([STR], I32),
    "prefetch": ([ctypes.POINTER(U64), I64], None),
    "decode_layout": ([], STR),
    "prefill_layout": ([], STR),
    "plan_new": ([], P),
    "plan_free": ([P], None),
    "plan_make": ([P, P, ctypes.POINTER(U64), ctypes.POINTER(I64)], I32),  # handle, PlanParams*
    "attend": ([P, P, P, I32, P], I32),  # Planned*, Kv*, q, q's dtype, out
    # Planned*, DecoderLayer*, Kv*, hidden in, out, cos, sin, LoraRowsArgs* (or NULL), layer index in its tables
    "decoder_layer_run": ([P, P, P, P, P, P, P, P, I64], I32),
    # Planned*, DecoderStackArgs*, hidden in, out, cos[], sin[], LoraRowsArgs* (or NULL)
    "decoder_stack_run": ([P, P, P, P, P, P, P], I32),
    "small_linear": ([P, I64, I64, P, I64, P, P, STR, I32], I32),
    "dequantize": ([P, I64, I32, I64, I64, P, STR, I32], I32),
    "quant_row_bytes": ([I32, I64], I64),
    "tile_rows": ([P, P, I64, I32, I64, I32, I32], I32),
    "take_rows": ([P, I64, I32, I64, P, I64, P], I32),
    "quant_matmul": ([P], I32),  # a QuantMatmulArgs
    "int8_variant": ([STR], STR),
}
_ERRORS = {1: ValueError, 2: TypeError}


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
        # what a step's calls run (`planned.py` binds them once per step)
        self.attend = lib.chunk_llama_cpu_attend
        self.decoder_layer_run = lib.chunk_llama_cpu_decoder_layer_run
        self.decoder_stack_run = lib.chunk_llama_cpu_decoder_stack_run
        self.plan_new, self.plan_free = lib.chunk_llama_cpu_plan_new, lib.chunk_llama_cpu_plan_free

    def raise_error(self, code: int):
        """The library's last error as ValueError (code 1), TypeError (2) or RuntimeError."""
        raise _ERRORS.get(code, RuntimeError)(self._lib.chunk_llama_cpu_last_error().decode())

    def new_plan(self) -> PlanHandle:
        """A plan handle of this library (made once per backend, planned again each step)."""
        return PlanHandle(self)

    def plan_make(self, handle: int, params: ctypes.Structure) -> tuple[int, int]:
        """Plan `params` (a `structs.PlanParams`) into the handle at `handle`: (the new
        generation, the floats of scratch a call needs), or the library's ValueError."""
        generation, floats = U64(), I64()
        code = self._lib.chunk_llama_cpu_plan_make(handle, ctypes.byref(params), ctypes.byref(generation),
                                                   ctypes.byref(floats))
        return (generation.value, floats.value) if code == 0 else self.raise_error(code)

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

    def quant_matmul_call(self, ggml_type: int, in_features: int, isa: str, activations: str):
        """y = x W^T (+ bias) on a weight kept in GGML blocks, for `ops/cpu/quant_linear.py`,
        which has checked dtypes, devices and contiguity: (x [rows, in_features] float32,
        weight [out_features, row_bytes] uint8, bias [out_features] float32 or None) ->
        [rows, out_features], x multiplied as `activations` says ("float32", or "int8" / "int16":
        quantized per group of 32, the kernel of `int8_variant(isa)`). The library checks the
        weight's size against the shapes."""
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

    def prefetch_call(self, addresses) -> Callable[[], None]:
        """A function that asks the caches for the line at each of `addresses` (ints, kept in it)
        each time it is called: software prefetches, which never fault, so an address whose
        object is gone reads nothing it should not. TypeError for anything but ints."""
        try:
            array = (U64 * len(addresses))(*addresses)
        except TypeError:
            raise TypeError("prefetch_call takes ints (memory addresses)") from None
        function, count = self._lib.chunk_llama_cpu_prefetch, len(array)

        def prefetch() -> None:
            function(array, count)

        return prefetch

    def int8_variant(self, isa: str) -> str:
        """The variant whose integer (int8 and int16) kernel runs for variant `isa` here (itself, or the next one down
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

    def tile_rows(self, blocks: torch.Tensor, ggml_type: int, untile: bool = False) -> torch.Tensor:
        """blocks [num_rows, row_bytes] uint8 (contiguous, on the CPU; whole tiles of 16 rows) of an
        integer format -> the same bytes tiled for the integer kernel (ops/cpu/tiles.py), or, with
        `untile`, back in rows: a new tensor."""
        if not (blocks.is_cpu and blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.is_contiguous()):
            raise TypeError(f"tile_rows takes a contiguous uint8 CPU matrix of blocks, got {blocks.dtype} "
                            f"{list(blocks.shape)} on {blocks.device}")
        out = torch.empty_like(blocks)
        code = self._lib.chunk_llama_cpu_tile_rows(blocks.data_ptr(), out.data_ptr(), blocks.numel(), ggml_type,
                                                   blocks.shape[0], int(untile), torch.get_num_threads())
        return out if code == 0 else self.raise_error(code)

    def take_rows(self, tiled: torch.Tensor, ggml_type: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] int64 of `tiled` [num_rows, row_bytes] uint8 (contiguous, on the CPU; an
        integer format tiled by `tile_rows`) in the file's layout: [n, row_bytes] uint8."""
        if not (tiled.is_cpu and tiled.dtype == torch.uint8 and tiled.dim() == 2 and tiled.is_contiguous()):
            raise TypeError(f"take_rows takes a contiguous uint8 CPU matrix of tiles, got {tiled.dtype} "
                            f"{list(tiled.shape)} on {tiled.device}")
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty((ids.numel(), tiled.shape[1]), dtype=torch.uint8)
        code = self._lib.chunk_llama_cpu_take_rows(tiled.data_ptr(), tiled.numel(), ggml_type, tiled.shape[0],
                                                   ids.data_ptr(), ids.numel(), out.data_ptr())
        return out if code == 0 else self.raise_error(code)

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
