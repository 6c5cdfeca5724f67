"""What a GGUF model's blocks multiply their inputs with: `--gguf-activations
auto|float32|int8|int16` (`CHUNK_LLAMA_GGUF_ACTIVATIONS`, which sets it for every entry point, the
Python API included).

- `float32`: x as it is (`csrc/cpu/quant_linear.h`): the float32-dequantized model's numbers to
  float32 rounding, what stock transformers computes on the same file. Every comparison with
  stock runs in it.
- `int8`: x quantized per group of 32 values to int8 with one scale (amax / 127), as llama.cpp
  quantizes it for its integer dot products; each weight group's integer codes multiply it
  exactly in int32 (`csrc/cpu/quant_act.h`: AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw), and each
  group's scale multiplies its sum once. The error is the activations' rounding, at most half
  a step (amax / 254) per value: bounded per output by the weights' magnitudes (the tests). On
  the default model it misses the bound below (top-1 agreement with float32 97.40%, worst logit
  error 1.76 against stock bfloat16's 1.70; Gemma 3 270M 97.69%, 4.15 against 3.92).
- `int16`: the same with 255 times finer steps (amax / 32385): each code q split exactly into
  two int8 halves, q = 255 hi + lo, both multiplied by the same decoded weight codes with the
  same instructions (two integer products per weight instead of one; the decoding, the costly
  part at few rows, is shared). Half a step is amax / 64770: on the default model top-1
  agreement with float32 100.00% and worst logit error 0.015 (stock bfloat16 1.70), on Gemma 3
  270M 100.00% and 0.018 (stock bfloat16 3.92) (`scripts/gguf_activation_errors.py`, 2,153 and
  2,031 positions).
  Both integer modes run the same operations in the same order for every row count: batch
  invariance holds within a mode. The formats without integer codes (F16, BF16) keep float32.
- `auto` (the default): the mode `AUTO` names for the variant that runs, where that variant's
  integer kernel is the selected variant itself; float32 elsewhere; logged once. A mode is named
  only where it keeps the bound on both models (top-1 agreement with float32 at least 99.5%,
  worst logit error no larger than stock bfloat16's) and was measured faster than float32 in
  prefill and in batched decode, with one request's decode at least as fast within the
  run-to-run noise (docs/BENCHMARKS.md, "int8 and int16 activations for GGUF blocks": a 1B
  Q4_K_M model and the default model, Intel Xeon with AVX-512 VNNI, 2 threads):
  - avx2 (`CHUNK_LLAMA_CPU_ISA=avx2`, or a CPU without AVX-512): int16. Its matrices run at
    2.3x float32's speed at 300 rows and 1.47x at one row; one request prefills at 1.7x and
    decodes at 1.44x float32's speed.
  - avx512: int16. One request prefills at 3.3x float32's speed; its matrices run at 1.6x at
    8 rows and 2.0x at 16 (a decode step of that many sequences), and 16 clients on a 2,000-token
    shared prompt are served at 1.39x float32's throughput; one row decodes at 1.23x float32's
    tokens/s on the 1B model (its blocks tiled, `tiles.py`, and a decode step's weight rows read
    a column vector at a time) and 1.19x on the default model.
  This made int16 the default for GGUF blocks with integer codes: logits within about 0.02 of
  the dequantized model's instead of 1e-4; `float32` keeps the old numbers bit for bit.
"""

from __future__ import annotations

import functools
import logging
import os

from chunk_llama.logs import log_once
from chunk_llama.ops.cpu import isa

logger = logging.getLogger(__name__)
ENV = "CHUNK_LLAMA_GGUF_ACTIVATIONS"
CHOICES = ("auto", "float32", "int8", "int16")
# the modes that quantize x (the integer kernel, csrc/cpu/quant_act.h)
INTEGER_MODES = ("int8", "int16")
# the GGML formats with integer codes (csrc/cpu/quant_act_params.h's quant_int8_supports)
INT8_TYPES = frozenset(("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"))
# what `auto` picks on each variant whose integer kernel it runs: a mode measured faster than
# float32 in prefill and batched decode, as fast at one row within the noise, and within the
# error bound on the default model and Gemma 3 270M (module doc); float32 on the variants not named
AUTO: dict[str, str] = {"avx2": "int16", "avx512": "int16"}


def requested(value: str | None = None) -> str:
    """`value`, else `CHUNK_LLAMA_GGUF_ACTIVATIONS`, else "auto"; ValueError for anything else."""
    choice = (value or os.environ.get(ENV, "") or "auto").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"gguf_activations must be one of {', '.join(CHOICES)}, got {choice!r}"
                         + ("" if value else f" (from {ENV})"))
    return choice


def resolve(value: str | None = None) -> str:
    """"float32", "int8" or "int16": what `value` (see `requested`) means on this CPU."""
    choice = requested(value)
    if choice != "auto":
        return choice
    variant = int8_variant()
    if variant is None:
        return "float32"
    # (an AVX-512 CPU without VNNI runs avx2's integer kernel: measured against avx2's float32
    # kernel only, so float32 there)
    mode = AUTO.get(variant, "float32") if variant == isa.selected_variant() else "float32"
    log_once(logger, "chunk-llama: GGUF activations: %s",
             f"auto picks {mode} on the {variant} kernel (ops/cpu/activations.py)" if mode != "float32" else
             f"auto keeps float32: no integer mode on the {variant} kernel is measured both faster and within "
             f"the error bound here (ops/cpu/activations.py); --gguf-activations int8 or int16 asks for one")
    return mode


def int8_variant(variant: str | None = None) -> str | None:
    """The variant whose integer (int8 and int16) kernel runs for `variant` (default: the selected one) on this CPU,
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
                 f"int8 and int16 run the {runs} variant's kernel: this CPU lacks the {variant} variant's integer instructions "
                 f"(AVX512-BW/VL/VNNI)")
    return runs
