"""Integer tensors of a step: packed into one tensor, kept at fixed addresses.

A plan is many small integer arrays; the kernels take them as one tensor and a layout
(each array's offset in it), so that one copy moves a plan to its device and one
argument carries it. `StaticBuffers` keeps each named tensor at the same address from
step to step while it is large enough (what CUDA graphs replay), growing it rarely
and geometrically.
"""

from __future__ import annotations

import torch


def host_to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device`: one copy, asynchronous from pinned memory on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def to_device(rows: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Several host lists to device tensors with one copy (views of one tensor)."""
    return list(torch.split(host_to_device([x for r in rows for x in r], dtype, device), [len(r) for r in rows]))


class StaticBuffers:
    """Named grow-only tensors on one device; `fill` returns a view of the first values."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}
        self.num_reallocations = 0  # how often a buffer moved (grew): a figure for graph capture

    def fill(self, name: str, values: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        """[len(values)] view of buffer `name`, holding `values` (copied on the device's stream)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < len(values) or buffer.dtype != dtype:
            size = max(len(values), 2 * buffer.numel() if buffer is not None else 64)
            buffer = self._buffers[name] = torch.empty(size, dtype=dtype, device=self.device)
            self.num_reallocations += 1
        view = buffer[: len(values)]
        if values:
            view.copy_(host_to_device(values, dtype, self.device), non_blocking=True)
        return view


    def scratch(self, num_floats: int) -> torch.Tensor:
        """A float32 buffer of at least `num_floats` for the kernels' partials and per-thread
        workspaces (its pages stay mapped from step to step)."""
        buffer = self._buffers.get("scratch")
        if buffer is None or buffer.numel() < num_floats:
            size = max(num_floats, 2 * buffer.numel() if buffer is not None else 0)
            buffer = self._buffers["scratch"] = torch.empty(size, dtype=torch.float32, device=self.device)
            self.num_reallocations += 1
        return buffer


def pack(arrays: dict[str, list[int]], dtype: torch.dtype, device: torch.device,
         buffers: StaticBuffers | None = None, name: str = "") -> tuple[torch.Tensor, dict[str, int]]:
    """The arrays one after another in one tensor (buffer `name` of `buffers`, if given),
    and each array's offset in it."""
    offsets, flat = {}, []
    for key, values in arrays.items():
        offsets[key] = len(flat)
        flat.extend(values)
    tensor = buffers.fill(name, flat, dtype) if buffers is not None else host_to_device(flat, dtype, device)
    return tensor, offsets
