"""The model's linear layers during chunk-llama's forwards, on x86 CPUs in float32.

torch runs a float32 `F.linear` on the CPU through MKL, whose fast paths are for
Intel CPUs: on the project's AMD EPYC (Zen 5) it reaches about 210 GFLOP/s at 1,024
rows and 120 at 16. The layers are 80% of a forward's time, so the engine's forwards
run them on two faster paths, both on the weights in place (no packed copy, so no
second copy of the model):
- few rows (a decode step: one per sequence, up to SMALL_ROWS): the CPU kernel's
  `small_linear` (`csrc/cpu/linear.h`), in the variant the attention kernels use,
  about 350 GFLOP/s at 16 rows with AVX-512 and 210 with AVX2;
- more rows (prefill): oneDNN (torch's bundled `mkldnn`, the library torch already uses
  for bfloat16 matmuls; `torch.ops.mkldnn._linear_pointwise` on the plain layout),
  about 430 GFLOP/s at 1,024 rows.
Everything else keeps `F.linear`: other dtypes, devices and architectures, and any
forward without a `ChunkCache` (a patched model then still computes exactly what stock
does). All paths round in float32, in their own orders.

`CHUNK_LLAMA_LINEAR=torch` keeps `F.linear` everywhere. The oneDNN path is checked
against `F.linear` once per process before first use; if it is missing or disagrees,
`F.linear` runs and the reason is logged once (as is a missing CPU kernel).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from chunk_llama.ops import isa
from chunk_llama.ops.cpu import build
from chunk_llama.ops.jit import force_reference, setting

logger = logging.getLogger(__name__)
ENV = "CHUNK_LLAMA_LINEAR"
# Rows up to which `small_linear` beats oneDNN (measured at 1 .. 128 rows, in 576 out
# 1536 and the LM head, with AVX-512 and with AVX2 on both sides).
SMALL_ROWS = 128


def _chosen() -> bool:
    """Whether chunk-llama's paths may run (not CHUNK_LLAMA_LINEAR=torch, an x86-64 CPU)."""
    choice = setting(ENV, "auto")
    if choice not in ("auto", "torch"):
        raise ValueError(f"{ENV} must be auto or torch, got {choice!r}")
    return choice == "auto" and isa.host_arch() == "x86_64"


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
    """(small_linear op or None, whether oneDNN runs) for a model of this dtype and device,
    or None where `F.linear` runs everything."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or not _chosen():
        return None
    small = None if force_reference() else _small_linear_of(isa.selected_variant())
    onednn = onednn_unavailable_reason() is None
    return (small, onednn) if small is not None or onednn else None


def _run(small, onednn: bool, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The kernels read raw pointers: x, weight and bias float32 CPU tensors, weight and bias
    # contiguous (small_linear_call checks only the shapes); anything else is F.linear's.
    if not (x.dtype is torch.float32 and x.is_cpu and weight.dtype is torch.float32 and weight.is_cpu
            and weight.is_contiguous() and (bias is None or (bias.dtype is torch.float32 and bias.is_cpu
                                                             and bias.is_contiguous()))):
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    if small is not None and flat.shape[0] <= SMALL_ROWS:
        out = small(flat.contiguous(), weight, bias)
    elif onednn:
        out = _onednn(flat.contiguous(), weight, bias)
    else:
        return F.linear(x, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def resolve(dtype: torch.dtype, device: torch.device | str):
    """What a model of this dtype and device runs its linear layers with in chunk-llama's
    forwards: `fn(x, weight, bias)` (`F.linear`'s contract: x [..., in_features], weight
    [out_features, in_features]) through `small_linear` or oneDNN, or None for `F.linear`.
    Chosen once per step (the settings are read here)."""
    paths = _paths(dtype, device)
    return None if paths is None else functools.partial(_run, *paths)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` through `small_linear` or oneDNN where this module says so (one call)."""
    fn = resolve(x.dtype, x.device)
    return F.linear(x, weight, bias) if fn is None else fn(x, weight, bias)


def backend(dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """What the engine's forwards run the linear layers of a model of this dtype and
    device with: "small_linear:<variant> + onednn" (few rows + many rows), one of them,
    or "torch" (F.linear). Logs once why a path is missing where it could run."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or not _chosen():
        return "torch"
    paths = []
    if not force_reference() and _small_linear_of(isa.selected_variant()) is not None:
        paths.append(f"small_linear:{isa.selected_variant()}")
    else:
        _log_once("few rows run F.linear (MKL): the CPU kernel does not run here")
    reason = onednn_unavailable_reason()
    if reason is None:
        paths.append("onednn")
    else:
        _log_once(f"many rows run F.linear (MKL), not oneDNN: {reason}")
    return " + ".join(paths) or "torch"


@functools.cache
def _log_once(message: str) -> None:
    logger.warning("chunk-llama: float32 linear layers: %s", message)
