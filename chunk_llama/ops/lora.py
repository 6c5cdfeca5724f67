"""LoRA deltas for the rows of a shared batch, in groups of rows per adapter.

A step's rows (a decode step's sequences, a packed prefill's tokens) may each run under
another adapter, or under none (the base weights). The rows of one adapter are
consecutive: the prefix tree keeps each adapter's sequences in a forest of their own, so
the decode plan's depth-first order and the packed prefill (sorted by adapter, then by
tokens) list them together. A linear layer's output for a group of rows
`[start, end)` under an adapter with factors A [rank, in], B [out, rank] and scaling s
gains `s * (x[start:end] A^T) B^T`, as PEFT's LoRA layer adds it: two small products per
group (a segmented GEMM, punica's SGMV, S-LoRA's), the base product computed once for all
rows whatever it is (a float32 or 16-bit weight, GGML blocks in any activation mode).

`add_lora_deltas` is the torch implementation (every device; the reference of the CPU
library's fused path). Its products go through the step's linear function where one is
given (`ops/cpu/linear.py`: on x86 CPUs `small_linear`, whose every output is one dot
product in a fixed order whatever rows come with it), so a row's delta does not depend on
the rows beside it (batch invariance), as the base product's does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LoraFactors:
    """One adapter's LoRA on one linear layer: a [rank, in_features], b [out_features, rank]
    (PEFT's lora_A and lora_B weights) and scaling (lora_alpha / rank, or / sqrt(rank) with
    rank-stabilised LoRA)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraRows:
    """Which rows of a step's flattened inputs run under which adapter.

    segments: (start, end, adapter) for each run of consecutive rows under one adapter,
        in row order; rows in no segment run the base weights. `adapter` is anything with a
        `factors(module_key) -> tuple[LoraFactors, ...]` (`hf/lora/adapter.py`).
    num_rows: rows of the step (what the segments index).
    """

    segments: tuple[tuple[int, int, object], ...]
    num_rows: int

    @staticmethod
    def from_runs(runs: Sequence[tuple[int, int, object | None]], num_rows: int) -> "LoraRows":
        """From (start, end, adapter or None) runs in row order: runs of one adapter that
        touch are joined, the base's left out."""
        segments: list[tuple[int, int, object]] = []
        for start, end, adapter in runs:
            if adapter is None or start == end:
                continue
            if segments and segments[-1][2] is adapter and segments[-1][1] == start:
                segments[-1] = (segments[-1][0], end, adapter)
            else:
                segments.append((start, end, adapter))
        return LoraRows(tuple(segments), num_rows)


def add_lora_deltas(out: torch.Tensor, x: torch.Tensor, rows: LoraRows, module_key,
                    linear: Callable | None = None) -> torch.Tensor:
    """`out` with each segment's LoRA delta added for the layer `module_key`.

    x: [..., in_features] the layer's input, out: [..., out_features] its base output, with
    `rows.num_rows` rows in all (flattened); linear: `fn(x, weight, bias)` with `F.linear`'s
    contract (the step's), or None for `F.linear`. The delta is computed in the factors'
    dtype and added there (PEFT casts x to lora_A's dtype and adds in the wider type), the
    sum then rounded to `out`'s dtype. Returns the result (`out` itself, updated in place,
    where `out` is contiguous)."""
    flat_x = x.reshape(-1, x.shape[-1])  # [rows, in_features]
    flat_out = out.reshape(-1, out.shape[-1])  # [rows, out_features]
    if flat_x.shape[0] != rows.num_rows or flat_out.shape[0] != rows.num_rows:
        raise ValueError(f"the step has {rows.num_rows} rows but the layer was given {flat_x.shape[0]} inputs and "
                         f"{flat_out.shape[0]} outputs")
    product = linear or F.linear
    for start, end, adapter in rows.segments:
        target, total = flat_out[start:end], None  # (several factors: summed in their dtype, rounded once)
        for factors in adapter.factors(module_key):
            part = flat_x[start:end]
            if part.dtype is not factors.a.dtype:
                part = part.to(factors.a.dtype)
            # [n, rank] then [n, out_features]
            delta = product(product(part, factors.a, None), factors.b, None)
            if total is None and target.dtype is delta.dtype:
                total = target.add_(delta, alpha=factors.scaling)
            else:
                total = (target.to(delta.dtype) if total is None else total).add_(delta, alpha=factors.scaling)
        if total is not None and total is not target:
            target.copy_(total)
    return flat_out.view(out.shape)


def reference_lora_delta(x: torch.Tensor, factors: Sequence[LoraFactors]) -> torch.Tensor:
    """The delta of `factors` for every row of x [rows, in_features] in float64: the oracle
    the implementations are judged against. Returns [rows, out_features]."""
    x = x.double()
    total = None
    for f in factors:
        delta = (x @ f.a.double().T) @ f.b.double().T * f.scaling
        total = delta if total is None else total + delta
    return total
