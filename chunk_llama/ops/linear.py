"""The model's linear layers during chunk-llama's forwards: oneDNN for float32 on x86 CPUs.

torch runs a float32 `F.linear` on the CPU through MKL, whose fast paths are for
Intel CPUs: on the project's AMD EPYC (Zen 5) it reaches about 210 GFLOP/s at 1,024
rows and 120 at 16, where oneDNN (torch's bundled `mkldnn`, the library torch already
uses for bfloat16 matmuls) reaches about 430 and 200 on the same weights, read in place
(its plain-layout path: no packed copy, so no second copy of the model). The layers
are 80% of a forward's time, so the engine's forwards run them through oneDNN
(`torch.ops.mkldnn._linear_pointwise`) on x86 CPUs; everything else keeps `F.linear`:
other dtypes and devices, and any forward without a `ChunkCache` (a patched model then
still computes exactly what stock does).

`CHUNK_LLAMA_LINEAR=torch` keeps `F.linear` everywhere. The oneDNN path is checked
against `F.linear` once per process before first use; if it is missing or disagrees,
`F.linear` runs and the reason is logged once.
"""

from __future__ import annotations

import functools
import logging
import os
import platform

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)
ENV = "CHUNK_LLAMA_LINEAR"


@functools.cache
def onednn_unavailable_reason() -> str | None:
    """Why float32 linear layers keep `F.linear` here, or None when oneDNN runs them."""
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "onednn", "torch"):
        raise ValueError(f"{ENV} must be auto, onednn or torch, got {choice!r}")
    if choice == "torch":
        return f"{ENV}=torch"
    if platform.machine().lower() not in ("x86_64", "amd64") and choice == "auto":
        return f"oneDNN linear layers are only used on x86-64 CPUs (this is {platform.machine()})"
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


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., in_features]; weight: [out_features, in_features] -> [..., out_features]."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


def use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.is_contiguous() and onednn_unavailable_reason() is None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through oneDNN where `use_onednn` says so."""
    if use_onednn(x, weight):
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def backend(dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """'onednn' or 'torch': what the engine's forwards run the linear layers of a model of
    this dtype and device with (logs once why oneDNN does not where it could, unless the
    user chose so)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return "torch"
    reason = onednn_unavailable_reason()
    if reason is None:
        return "onednn"
    if os.environ.get(ENV) != "torch":
        _log_once(reason)
    return "torch"


@functools.cache
def _log_once(reason: str) -> None:
    logger.warning("chunk-llama: float32 linear layers run F.linear (MKL), not oneDNN: %s", reason)
