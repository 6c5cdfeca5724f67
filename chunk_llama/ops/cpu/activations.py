"""What a GGUF model's blocks multiply their inputs with: `--gguf-activations auto|float32|int8`
(`CHUNK_LLAMA_GGUF_ACTIVATIONS`, which sets it for every entry point, the Python API included).

- `float32`: x as it is (`csrc/cpu/quant_linear.h`): the float32-dequantized model's numbers to
  float32 rounding, what stock transformers computes on the same file. Every comparison with
  stock runs in it.
- `int8`: x quantized per group of 32 values to int8 with one scale (amax / 127), as llama.cpp
  quantizes it for its integer dot products; each weight group's integer codes multiply it
  exactly in int32 (`csrc/cpu/quant_act.h`: AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw), and each
  group's scale multiplies its sum once. The error is the activations' rounding, at most half
  a step (amax / 254) per value: bounded per output by the weights' magnitudes (the tests), and
  on the default model and Gemma 3 270M below stock bfloat16's (docs/kernels.md). The same
  operations in the same order for every row count: batch invariance holds within the mode.
  The formats without integer codes (F16, BF16) keep float32.
- `auto` (the default): int8 where its kernel was measured faster than float32 and its error
  within the bound (`AUTO_INT8`), float32 elsewhere, logged once. Today that is nowhere: the
  kernel is faster (prefill of a 1B Q4_K_M model's matrices at 300 rows, Intel Xeon with
  AVX-512 VNNI, 2 threads: 3.3x float32 on the avx512 kernel, 2.5x on avx2's), but on the default
  model its top-1 agreement with float32 is 97.4% (the bound: 99.5%) and its worst logit error
  1.76 against stock bfloat16's 1.70 (`scripts/gguf_activation_errors.py`), so `int8` is asked
  for by name.
"""

from __future__ import annotations

import functools
import logging
import os

from chunk_llama.logs import log_once
from chunk_llama.ops.cpu import isa

logger = logging.getLogger(__name__)
ENV = "CHUNK_LLAMA_GGUF_ACTIVATIONS"
CHOICES = ("auto", "float32", "int8")
# the GGML formats with integer codes (csrc/cpu/quant_act_params.h's quant_int8_supports)
INT8_TYPES = frozenset(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
# where `auto` picks int8, by the variant whose integer kernel runs: the variants whose kernel
# was measured faster than float32 at every row count and whose error on the default model kept
# the bound (module doc: none yet)
AUTO_INT8: frozenset[str] = frozenset()


def requested(value: str | None = None) -> str:
    """`value`, else `CHUNK_LLAMA_GGUF_ACTIVATIONS`, else "auto"; ValueError for anything else."""
    choice = (value or os.environ.get(ENV, "") or "auto").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"gguf_activations must be one of {', '.join(CHOICES)}, got {choice!r}"
                         + ("" if value else f" (from {ENV})"))
    return choice


def resolve(value: str | None = None) -> str:
    """"float32" or "int8": what `value` (see `requested`) means on this CPU."""
    choice = requested(value)
    if choice != "auto":
        return choice
    variant = int8_variant()
    if variant is None:
        return "float32"
    if variant not in AUTO_INT8:
        log_once(logger, "chunk-llama: GGUF activations: %s",
                 f"auto keeps float32: int8 on the {variant} kernel is not measured both faster and within the "
                 f"error bound here (ops/cpu/activations.py); --gguf-activations int8 asks for it")
        return "float32"
    return "int8"


def int8_variant(variant: str | None = None) -> str | None:
    """The variant whose int8 kernel runs for `variant` (default: the selected one) on this CPU,
    logged once where it is a slower one; None without the CPU kernels."""
    return _int8_variant(variant or isa.selected_variant())


@functools.cache
def _int8_variant(variant: str) -> str | None:
    from chunk_llama.ops.cpu.attention import build

    library = build()
    if library is None:
        return None
    runs = library.int8_variant(variant)
    if runs != variant:
        log_once(logger, "chunk-llama: GGUF activations: %s",
                 f"int8 runs the {runs} variant's kernel: this CPU lacks the {variant} variant's integer instructions "
                 f"(AVX512-BW/VL/VNNI)")
    return runs
