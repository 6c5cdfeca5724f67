"""Adapters' LoRA factors as the CPU library's fused decoder layers take them.

A fused layer (`csrc/cpu/layer.cpp`) adds the LoRA deltas of a step's rows under adapters
itself (`csrc/cpu/lora.cpp`): after each projection, each segment of rows under one adapter
gains scale * (x A^T) B^T through the same linear kernel as the base product. It reads, per
segment, the adapter's table for a run of layers: its factors (`structs.LoraFactor`, raw
pointers to the adapter's tensors) and an index of where each (layer, target) starts.

`LoraTable` is that table for one adapter and one run of layers' module keys; `table_for`
makes it once and keeps it as long as the adapter lives (weakly), since a decode step would
otherwise rebuild several hundred structs. `LoraStepRows` is a step's segments over those
tables: a few structs, made once per step. Factors the C code cannot read in place (not
float32, not contiguous, not on the CPU) make no table: the reason, for the caller to step
aside with.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence

import torch

from chunk_llama.ops.build.c_types import I64
from chunk_llama.ops.cpu.structs import LoraFactor, LoraRowsArgs, LoraSegment

NUM_TARGETS = 7  # a layer's targets in c_api.h's order: q, k, v, o, gate, up, down
_MAX_TABLES = 4  # tables kept per adapter (one per run of layers it ran on, normally one)
# one target of one layer: (the module key adapters' factors are keyed by, or None where no
# adapter applies; the projection's first row and end row in its module's weight, the
# module's rows): a range of a fused qkv / gate_up projection's rows, or all of them
Target = tuple[str | None, int, int, int]


def unfit_reason(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why the C code cannot read the factors a [rank, in], b [out, rank] in place, or None."""
    for name, t in (("lora_A", a), ("lora_B", b)):
        if not (t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() and t.dim() == 2):
            return (f"an adapter's {name} is a {str(t.dtype).removeprefix('torch.')} tensor on {t.device} "
                    f"({'' if t.is_contiguous() else 'not '}contiguous): the fused layers read float32 CPU factors "
                    "in place")
    return None


class LoraTable:
    """One adapter's factors for a run of layers (`targets`: per layer, its NUM_TARGETS
    `Target`s), as chunk_llama_cpu_lora_segment points at them. ValueError where factors
    cannot be read in place (`unfit_reason`) or a fused projection's B has other rows than
    its module; other sizes are the C call's to refuse, naming the target."""

    def __init__(self, adapter, targets: Sequence[Sequence[Target]]):
        factors, index, kept = [], [0], []
        for layer in targets:
            for key, start, stop, rows in layer:
                for f in () if key is None else adapter.factors(key):
                    reason = unfit_reason(f.a, f.b)
                    if reason is not None:
                        raise ValueError(reason)
                    rank = int(f.a.shape[0])
                    if f.b.shape[1] != rank:
                        raise ValueError(f"{key}: lora_A {tuple(f.a.shape)} and lora_B {tuple(f.b.shape)} are not the "
                                         "factors of one rank")
                    whole = (start, stop) == (0, rows)
                    if not whole and f.b.shape[0] != rows:
                        raise ValueError(f"{key}: lora_B has {f.b.shape[0]} rows, the fused projection {rows}")
                    # (a fused projection's part: rows [start, stop) of B, `rank` floats each)
                    factors.append(LoraFactor(f.a.data_ptr(), f.b.data_ptr() + 4 * start * rank, rank,
                                              int(f.a.shape[1]), int(f.b.shape[0]) if whole else stop - start,
                                              float(f.scaling)))
                    kept += (f.a, f.b)
                index.append(len(factors))
        self.num_layers = len(targets)
        self.num_factors = len(factors)
        self._factors = (LoraFactor * max(1, len(factors)))(*factors)
        self._index = (I64 * len(index))(*index)
        self._kept = kept  # (the structs hold their addresses)
        self.factors_address = ctypes.addressof(self._factors)
        self.index_address = ctypes.addressof(self._index)


_tables: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def table_for(adapter, targets: tuple) -> LoraTable | str:
    """`adapter`'s table for `targets` (a tuple of per-layer tuples of `Target`s), made once
    per adapter and targets, or why its factors cannot be read in place."""
    try:
        tables = _tables.setdefault(adapter, {})
    except TypeError:  # (an object without weak references: made each time)
        tables = {}
    table = tables.get(targets)
    if table is None:
        try:
            table = LoraTable(adapter, targets)
        except ValueError as error:
            table = str(error)
        if len(tables) >= _MAX_TABLES:
            tables.pop(next(iter(tables)))
        tables[targets] = table
    return table


class LoraStepRows:
    """A step's rows by adapter over `tables` (segments (row_start, row_end, LoraTable), in
    row order), as chunk_llama_cpu_lora_rows: `address` for the fused calls."""

    def __init__(self, segments: Sequence[tuple[int, int, LoraTable]]):
        self._tables = [table for _, _, table in segments]  # (kept alive with the structs)
        self._segments = (LoraSegment * max(1, len(segments)))(*(
            LoraSegment(start, end, table.factors_address, table.index_address, table.num_layers)
            for start, end, table in segments))
        self._args = LoraRowsArgs(ctypes.addressof(self._segments), len(segments))
        self.address = ctypes.addressof(self._args)
        self.num_segments = len(segments)


def step_rows(segments: Sequence[tuple[int, int, object]], targets: tuple) -> LoraStepRows | str:
    """The step's `LoraRows.segments` (start, end, adapter) for a run of layers' `targets`,
    or why an adapter's factors cannot be read in place. Adapters with no factor on these
    layers are left out."""
    rows = []
    for start, end, adapter in segments:
        table = table_for(adapter, targets)
        if isinstance(table, str):
            return table
        if table.num_factors:
            rows.append((start, end, table))
    return LoraStepRows(rows)
