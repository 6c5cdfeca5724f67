"""The integer-activation linear layers on GGML blocks (`csrc/cpu/quant_act.h`: int8 and int16)
in NumPy / PyTorch: the oracle their tests compare with, and the error bound they keep.

x is quantized as the kernel quantizes it (float32 operations, so the codes are the kernel's):
per row and group of 32, d = amax / LEVELS[mode] (int8: 127; int16: 127 * 255), codes =
round-half-even(x * (1 / d)). (int16's kernel splits each code q exactly into 255 hi + lo and
multiplies both halves: the same integer sums as q's.) The kernel then
computes, exactly up to its float32 rounding, for each output
    y = sum_i w_i x^_i + sum_g o_g (sum_{i in g} x_i - sum_{i in g} x^_i)
with x^ = d * codes and w the float32-dequantized weights (gguf-py's): the formats with a
minimum (Q4_1, Q5_1, Q4_K, Q5_K) take their groups' offsets, o_g the weight of code z (the
middle code), times the exact sums of x, the others all of w times x^. Against the exact
product with x, the error is at most sum_g d_g / 2 * sum_{i in g} |w_i - o_g| (the bound `int8_linear` returns).
"""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32
# the largest code of each mode
LEVELS = {"int8": 127, "int16": 127 * 255}
# The formats with a minimum: (byte range of the packed codes, of the fifth bits or None) in a
# block, and the codes' zero point (csrc/cpu/quant_act.h's kZero). Blocks whose codes are all z
# decode to each group's offset o_g.
_OFFSET_FORMATS = {"Q4_1": ((4, 20), None), "Q5_1": ((8, 24), (4, 8)), "Q4_K": ((16, 144), None),
                   "Q5_K": ((48, 176), (16, 48))}


def quantize_rows(x: torch.Tensor, mode: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in_features] float32 -> (codes [rows, in_features] float32 integers in
    [-LEVELS[mode], LEVELS[mode]], scales d [rows, in_features / 32] float32)."""
    groups = x.float().reshape(x.shape[0], -1, GROUP)
    d = groups.abs().amax(dim=-1) / LEVELS[mode]
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    codes = torch.round(groups * inverse[..., None])  # (half to even, as the kernel's conversion)
    return codes.reshape(x.shape), d


def _dequantized(blocks: np.ndarray, ggml_type: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf import dequantize as gguf_dequantize

    return torch.from_numpy(np.array(gguf_dequantize(blocks, GGMLQuantizationType[ggml_type]), dtype=np.float32))


def group_offsets(blocks: np.ndarray, ggml_type: str, in_features: int) -> torch.Tensor | None:
    """o_g [out_features, in_features / 32] float32: each group's weight of its middle code, for
    the formats with a minimum; None for the others."""
    if ggml_type not in _OFFSET_FORMATS:
        return None
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    (code_from, code_to), fifth = _OFFSET_FORMATS[ggml_type]
    block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]][1]
    middle = blocks.reshape(blocks.shape[0], -1, block_bytes).copy()
    # Q4: every nibble 8; Q5: every nibble 0 and every fifth bit 1 (16)
    middle[..., code_from:code_to] = 0x88 if fifth is None else 0x00
    if fifth is not None:
        middle[..., fifth[0]:fifth[1]] = 0xFF
    weights = _dequantized(middle.reshape(blocks.shape), ggml_type)  # [out_features, in_features]
    return weights.reshape(blocks.shape[0], -1, GROUP)[..., 0]


def int8_linear(x: torch.Tensor, blocks: np.ndarray, ggml_type: str, bias: torch.Tensor | None = None,
                mode: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """(y, bound) in float64: the kernel's result in `mode` ("int8" or "int16") for x [rows,
    in_features] (float32) on `blocks` [out_features, row_bytes] (uint8) of `ggml_type`
    (gguf-py's name), and the bound of its error against the exact product."""
    in_features = x.shape[1]
    weight = _dequantized(blocks, ggml_type).double()  # [out_features, in_features]
    codes, d = quantize_rows(x, mode)
    x_hat = (codes.double().reshape(x.shape[0], -1, GROUP) * d.double()[..., None]).reshape(x.shape)
    y = x_hat @ weight.T
    offsets = group_offsets(blocks, ggml_type, in_features)
    centred = weight.reshape(weight.shape[0], -1, GROUP)  # [out, groups, 32]
    if offsets is not None:  # the offsets multiply the exact sums
        residual = (x.double() - x_hat).reshape(x.shape[0], -1, GROUP).sum(-1)  # [rows, groups]
        y = y + residual @ offsets.double().T
        centred = centred - offsets.double()[..., None]
    bound = (d.double() / 2) @ centred.abs().sum(-1).T  # [rows, out]
    if bias is not None:
        y = y + bias.double()
    return y, bound
