"""The model's linear layers during chunk-llama's forwards, on x86 CPUs (float32, bfloat16
and float16 models).

torch runs a float32 `F.linear` on the CPU through MKL, whose fast paths are for Intel
CPUs, and MKL and oneDNN both choose their kernels (and so the order in which they round)
by the number of rows: a request's numbers would then depend on what else is in its
batch and on how its prompt was split into prefill pieces. The engine's forwards run the
layers through the CPU kernel's `small_linear` (`csrc/cpu/linear.h`) instead, for every
row count: each output is one dot product along in_features in a fixed order, whatever
rows come with it (batch invariance), on the weights in place (no packed copy, so no
second copy of the model). On the project's AMD EPYC (Zen 5, AVX-512) it runs at about
330 GFLOP/s at 16 rows (oneDNN 180-250) and 420-440 at 2,048 rows of 576 inputs (oneDNN
420-460; 0.8x oneDNN's at 1,536 inputs).
`CHUNK_LLAMA_LINEAR`:
- `auto` (the default): `small_linear` for every row count;
- `onednn`: `small_linear` up to SMALL_ROWS rows, oneDNN (torch's bundled `mkldnn`,
  `torch.ops.mkldnn._linear_pointwise` on the plain layout) beyond: prefills of wide
  layers up to 1.25x faster, but a row's result then depends on the rows beside it;
- `torch`: `F.linear` everywhere.
A bfloat16 or float16 model's layers (weights whole groups of 32 wide) run the quantized
kernel (`csrc/cpu/quant_linear.h`) on the weight as it is, read as BF16 / F16 blocks and
widened in registers, x widened to float32, the sum rounded once to the model's dtype, as
`F.linear` rounds it: torch's 16-bit product at a few rows ran at 0.4x the memory's speed
(oneDNN's bfloat16 GEMV, 2.8 ms for the default model's LM head against 1.1 ms of bytes).
Beyond SMALL_ROWS rows, where oneDNN computes that dtype natively (`native_half_gemm`:
AVX512-BF16 or AMX, or AVX-512 emulating it, as torch reports; held to by
`ONEDNN_MAX_CPU_ISA`), `F.linear` runs them: twice the float32 kernel's arithmetic rate.
Everything else keeps `F.linear`: other devices and architectures, and any forward
without a `ChunkCache` (a patched model then still computes exactly what stock does).
All paths round in float32, in their own orders. The oneDNN path is checked against
`F.linear` once per process before first use; if it is missing or disagrees, `F.linear`
runs and the reason is logged once (as is a missing CPU kernel).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from chunk_llama.logs import log_once
from chunk_llama.ops.build.jit import force_reference, setting
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.attention import build

logger = logging.getLogger(__name__)
ENV = "CHUNK_LLAMA_LINEAR"
CHOICES = ("auto", "onednn", "torch")
# With CHUNK_LLAMA_LINEAR=onednn: the rows up to which `small_linear` runs (it beats oneDNN
# there: measured at 1 .. 128 rows, in 576 out 1536 and the LM head, AVX-512 and AVX2).
SMALL_ROWS = 128
# GGML's type ids of 16-bit weights (`ops/cpu/quant_linear.py`'s BF16, F16), by the model's dtype
HALF_BLOCKS = {torch.bfloat16: 30, torch.float16: 1}


def _choice() -> str | None:
    """CHUNK_LLAMA_LINEAR where chunk-llama's paths may run (an x86-64 CPU), else None."""
    choice = setting(ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    return choice if choice != "torch" and isa.host_arch() == "x86_64" else None


@functools.cache
def onednn_unavailable_reason() -> str | None:
    """Why many-row float32 linear layers keep `F.linear` here, or None when oneDNN runs them."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear (torch.ops.mkldnn._linear_pointwise)"
    try:  # the same numbers as F.linear, to float32 rounding
        generator = torch.Generator().manual_seed(0)
        x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((37, 96), (130, 96), (130,)))
        error = (_onednn(x, weight, bias) - F.linear(x, weight, bias)).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - any failure of a private op means: do not use it
        return f"oneDNN linear failed its check: {exc}"
    if not error <= 1e-4:
        return f"oneDNN linear differs from F.linear by {error:.3g}"
    return None


def _onednn(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x2d, weight, bias, "none", [], "")


@functools.cache
def _small_linear_of(variant: str):
    module = build()  # None for good: a build that failed is not retried in this process
    return None if module is None else module.small_linear_call(variant)


def _paths(dtype: torch.dtype, device: torch.device | str):
    """(small_linear op or None, whether oneDNN runs many rows) for a model of this dtype and
    device, or None where `F.linear` runs everything."""
    choice = None if torch.device(device).type != "cpu" or dtype != torch.float32 else _choice()
    if choice is None:
        return None
    small = None if force_reference() else _small_linear_of(isa.selected_variant())
    onednn = choice == "onednn" and onednn_unavailable_reason() is None
    return (small, onednn) if small is not None or onednn else None


def _run(small, onednn: bool, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The kernels read raw pointers: x, weight and bias float32 CPU tensors, weight and bias
    # contiguous (small_linear_call checks only the shapes); anything else is F.linear's.
    if not (x.dtype is torch.float32 and x.is_cpu and weight.dtype is torch.float32 and weight.is_cpu
            and weight.is_contiguous() and (bias is None or (bias.dtype is torch.float32 and bias.is_cpu
                                                             and bias.is_contiguous()))):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if small is not None and not (onednn and flat.shape[0] > SMALL_ROWS):
        out = small(flat.contiguous(), weight, bias)
    elif onednn:
        out = _onednn(flat.contiguous(), weight, bias)
    else:
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


@functools.cache
def _half_kernel(dtype: torch.dtype, in_features: int, variant: str):
    return build().quant_matmul_call(HALF_BLOCKS[dtype], in_features, variant, "float32")


def _run_half(native: bool, variant: str, x: torch.Tensor, weight: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """A 16-bit model's layer: x [..., in_features] and weight [out_features, in_features]
    of the model's dtype -> [..., out_features] of it."""
    if not (x.dtype is weight.dtype and weight.dtype in HALF_BLOCKS and x.is_cpu and weight.is_cpu
            and weight.is_contiguous() and weight.dim() == 2 and weight.shape[1] % 32 == 0
            and (bias is None or bias.is_cpu)):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])  # [rows, in_features]
    if native and flat.shape[0] > SMALL_ROWS:
        return F.linear(x, weight, bias)
    kernel = _half_kernel(x.dtype, weight.shape[1], variant)
    out = kernel(flat.float(), weight.view(torch.uint8), None if bias is None else bias.float())
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def _half_paths(dtype: torch.dtype, device: torch.device | str):
    """(native_half_gemm, variant) for a 16-bit model here, or None where `F.linear` runs it."""
    if dtype not in HALF_BLOCKS or torch.device(device).type != "cpu" or _choice() is None or force_reference() \
            or build() is None:
        return None
    return isa.native_half_gemm(dtype), isa.selected_variant()


def resolve(dtype: torch.dtype, device: torch.device | str):
    """What a model of this dtype and device runs its linear layers with in chunk-llama's
    forwards: `fn(x, weight, bias)` (`F.linear`'s contract: x [..., in_features], weight
    [out_features, in_features]) through `small_linear` (or oneDNN, see the module), the
    quantized kernel (16-bit models), or None for `F.linear`. Chosen once per step (the
    settings are read here)."""
    half = _half_paths(dtype, device)
    if half is not None:
        return functools.partial(_run_half, *half)
    paths = _paths(dtype, device)
    return None if paths is None else functools.partial(_run, *paths)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` through `small_linear` or oneDNN where this module says so (one call)."""
    fn = resolve(x.dtype, x.device)
    return F.linear(x, weight, bias) if fn is None else fn(x, weight, bias)


def many_rows_onednn() -> bool:
    """Whether rows beyond SMALL_ROWS go to oneDNN (CHUNK_LLAMA_LINEAR=onednn, and it runs here);
    the quantized layers (`quant_linear.py`) follow the same choice."""
    return _choice() == "onednn" and onednn_unavailable_reason() is None


def backend(dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """What the engine's forwards run the linear layers of a model of this dtype and device
    with: "small_linear:<variant>" (every row count), "small_linear:<variant> + onednn" (few
    rows + many rows), "onednn", or "torch" (F.linear). Logs once why a path is missing where
    it could run. A 16-bit model's: "half_blocks:<variant>" (+ " + onednn" beyond SMALL_ROWS)."""
    half = _half_paths(dtype, device)
    if half is not None:
        return f"half_blocks:{half[1]}" + (" + onednn" if half[0] else "")
    choice = None if torch.device(device).type != "cpu" or dtype != torch.float32 else _choice()
    if choice is None:
        return "torch"
    paths = []
    if not force_reference() and _small_linear_of(isa.selected_variant()) is not None:
        paths.append(f"small_linear:{isa.selected_variant()}")
    else:
        log_once(logger, "chunk-llama: float32 linear layers: %s", "the CPU kernel does not run here: " + ("few rows run F.linear (MKL)" if choice == "onednn"
                                                           else "F.linear (MKL) runs them"))
    if choice == "onednn":
        reason = onednn_unavailable_reason()
        if reason is None:
            paths.append("onednn")
        else:
            log_once(logger, "chunk-llama: float32 linear layers: %s", f"many rows run {'small_linear' if paths else 'F.linear (MKL)'}, not oneDNN: {reason}")
    return " + ".join(paths) or "torch"


