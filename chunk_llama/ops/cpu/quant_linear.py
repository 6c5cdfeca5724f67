"""Linear layers whose weights stay in GGML's blocks (a GGUF file's Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q4_K, Q5_K, Q6_K, F16 and BF16 tensors, and a 16-bit checkpoint's weights), on the CPU
in float32.

A decode step multiplies a few rows by every weight of the model, so it is bound by the
bytes of the weights (4.5 to 8.5 bits a weight in these blocks against 32 in float32) and
by the arithmetic of turning them into numbers. The CPU kernel (`csrc/cpu/quant_linear.h`)
decodes each group of 32 weights in registers just before multiplying it, as `small_linear`
tiles do (beyond a few rows, through a buffer in L1, a block of rows at a time), so the
blocks are read once, from memory, in their compact form; a group's minimum (Q4_1, Q5_1,
Q4_K, Q5_K) goes in once, times the group's sum of x, as llama.cpp factors it. Every row
count runs the same arithmetic per output, so a row's result does not depend on the rows
beside it (batch invariance); with `CHUNK_LLAMA_LINEAR=onednn` many rows (a prefill)
instead decode the whole weight to float32 once per call and run oneDNN's GEMM
(`ops/cpu/linear.py`). Both compute with the weights of the float32-dequantized model (what
transformers loads a GGUF file as, gguf-py's decode, bit for bit), rounded in another
order: within the float32 error of `F.linear` on them.

`GGUFLinear` and `GGUFEmbedding` (`gguf/modules.py`) hold such weights in a model (`gguf/weights.py`
puts them there); they run these ops in every forward, with or without a `ChunkCache`.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from chunk_llama.logs import log_once
from chunk_llama.ops.build import jit
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.activations import INT8_TYPES, INTEGER_MODES, int8_variant
from chunk_llama.ops.cpu.attention import build, build_failed
from chunk_llama.ops.cpu.linear import SMALL_ROWS, _onednn, many_rows_onednn
from chunk_llama.ops.cpu.tiles import TILED, untile

logger = logging.getLogger(__name__)
# GGML type ids the kernels decode (csrc/cpu/quant_params.h), by gguf-py's names.
GGML_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
              "BF16": 30}
GGML_NAMES = {number: name for name, number in GGML_TYPES.items()}
INT8_TYPE_IDS = frozenset(GGML_TYPES[name] for name in INT8_TYPES)


def unavailable_reason() -> str | None:
    """Why weights cannot stay quantized in this process (no CPU kernel), or None."""
    if build() is None:
        return f"the CPU kernels are not available ({build_failed() or 'not built'})"
    return None


def dequantize(blocks: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """blocks [num_rows, row_bytes] uint8 -> float32 [num_rows, in_features]: the CPU
    kernel's decode, or gguf-py's (the same values) where the kernels are off
    (`CHUNK_LLAMA_FORCE_REFERENCE` set after the blocks were kept)."""
    library = build()
    if library is None:
        return reference_dequantize(blocks, ggml_type, in_features)
    return library.dequantize(blocks, ggml_type, in_features, isa.selected_variant())


def reference_dequantize(blocks: torch.Tensor, ggml_type: int, in_features: int) -> torch.Tensor:
    """gguf-py's numpy decode of `blocks` (what transformers loads a GGUF file with), as
    `dequantize` returns it."""
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    log_once(logger, "chunk-llama: quantized linear layers: %s", f"the CPU kernels are off ({build_failed() or 'CHUNK_LLAMA_FORCE_REFERENCE is set'}): the blocks are "
              "decoded by gguf-py and multiplied with F.linear")
    decoded = gguf_dequantize(blocks.cpu().numpy(), GGMLQuantizationType(ggml_type))  # [num_rows, in_features]
    return torch.from_numpy(np.array(decoded, dtype=np.float32)).reshape(blocks.shape[0], in_features)


class QuantLinear:
    """`F.linear` of a weight in GGML blocks: (x [..., in_features], blocks [out_features,
    row_bytes] uint8, bias [out_features] or None) -> [..., out_features]. Built once per
    layer (the variant and the format are read here). `activations`: "float32", "int8" or
    "int16" (x quantized per group of 32, `activations.py`; a format without integer codes
    keeps float32). `tiled`: the blocks are tiled (`tiles.py`; integer activations only)."""

    def __init__(self, ggml_type: int, in_features: int, activations: str = "float32", tiled: bool = False):
        self.ggml_type, self.in_features, self._variant = ggml_type, in_features, isa.selected_variant()
        self.integer = activations in INTEGER_MODES and ggml_type in INT8_TYPE_IDS
        if tiled and not self.integer:
            raise ValueError(f"tiled blocks multiply integer activations only, not {activations} (GGML type {ggml_type})")
        self.tiled = tiled
        if self.integer:
            self._kernel = build().quant_matmul_call(ggml_type | TILED if tiled else ggml_type, in_features,
                                                     int8_variant(self._variant), activations)
        else:
            self._kernel = build().quant_matmul_call(ggml_type, in_features, self._variant, "float32")

    def __call__(self, x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # the kernel reads raw float32 memory: anything else multiplies the decoded weight (as
        # everything does with the kernels forced off; `dequantize` says so)
        forced_off = jit.force_reference()
        if forced_off or not (x.dtype is torch.float32 and x.is_cpu and (bias is None or (
                bias.dtype is torch.float32 and bias.is_cpu and bias.is_contiguous()))):
            if not forced_off:
                log_once(logger, "chunk-llama: quantized linear layers: %s", f"a {x.dtype} input on {x.device} (bias {None if bias is None else bias.dtype}) "
                          "multiplies the dequantized weight with F.linear")
            if self.tiled:
                blocks = untile(blocks, GGML_NAMES[self.ggml_type])
            weight = dequantize(blocks, self.ggml_type, self.in_features)
            return F.linear(x, weight.to(x.device, x.dtype), None if bias is None else bias.to(x.device, x.dtype))
        flat = x.reshape(-1, self.in_features).contiguous()  # [rows, in_features]
        if self.integer or flat.shape[0] <= SMALL_ROWS or not many_rows_onednn():
            out = self._kernel(flat, blocks, bias)
        else:  # CHUNK_LLAMA_LINEAR=onednn: decode once, multiply with oneDNN
            out = _onednn(flat, build().dequantize(blocks, self.ggml_type, self.in_features, self._variant), bias)
        return out.view(*x.shape[:-1], blocks.shape[0])


