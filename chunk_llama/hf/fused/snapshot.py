"""What a fused call was described from, and a cheap test of whether it still holds.

A fused decoder layer (`layers.py`) hands the C library raw pointers to its weights;
it must be described again when a module or tensor it reads is replaced, a tensor's memory
moves (`param.data = ...`), or a hook comes or goes (the hook's effect would be skipped).
`Snapshot.stale()` checks all of that with a few C-level passes over flat tuples (`map`,
no Python loop), and `Snapshot.joined` makes one snapshot of many, so a stack of 30 layers
is checked in one pass per kind, not 30 calls: at batch 1 the check runs between kernels
that have evicted these objects from the caches, and about 20 us a layer was a twentieth
of the default model's decode step. What is left is mostly those misses, one after another;
`Snapshot.addresses` names the objects a check reads, for a prefetch of all of them at once
after a step's last weights (`stack.py`'s `Stack.warm`).
"""

from __future__ import annotations

import itertools
import operator

import torch
from torch import nn

_BIAS = itertools.repeat("bias")
_VERSION = operator.attrgetter("_version")
# torch's hook dicts that run around every module's forward
GLOBAL_HOOKS = (nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks)


class Snapshot:
    """The dicts modules and tensors were found in and what each held, the tensors' memory
    (address and size), the versions of tensors whose values were copied, and the hook dicts
    that were (not) empty, as of construction.

    dicts: every `_modules`, `_parameters` and `_buffers` dict read; attribute_dicts: the
    `__dict__` of modules that may keep a bias as a plain attribute; tensors: every tensor
    read; hook_dicts: hook dicts that run around what was read (the global ones are added);
    copied: tensors read as a copy (a bfloat16 norm weight in float32), whose values must not
    change in place either (torch counts in-place writes in `_version`)."""

    def __init__(self, dicts: tuple, attribute_dicts: tuple, tensors: tuple, hook_dicts: tuple, copied: tuple = ()):
        self._dicts, self._attribute_dicts, self._tensors, self._copied = dicts, attribute_dicts, tensors, copied
        self._hooks = tuple({id(d): d for d in (*hook_dicts, *GLOBAL_HOOKS)}.values())
        self._lengths = tuple(map(len, dicts))
        self._values = tuple(itertools.chain.from_iterable(map(dict.values, dicts)))
        self._biases = tuple(map(dict.get, attribute_dicts, _BIAS))
        self._memory = _memory(tensors)
        self._hooked = any(self._hooks)
        self._versions = tuple(map(_VERSION, copied))

    @classmethod
    def joined(cls, snapshots) -> Snapshot:
        """One snapshot of what `snapshots` were taken of, as it is now (take it right after
        checking that none of them is stale)."""
        parts = list(snapshots)
        return cls(*(tuple(itertools.chain.from_iterable(getattr(s, name) for s in parts))
                     for name in ("_dicts", "_attribute_dicts", "_tensors", "_hooks", "_copied")))

    def addresses(self) -> list[int]:
        """Where the objects `stale` reads are (CPython's `id` is an object's address): every
        dict, each value it compares (their reference counts are written), each tensor, the
        first two cache lines of its TensorImpl and its storage (`data_ptr`, `numel`,
        `_version` read them), each once (a tensor is also a dict's value; the global hook dicts
        are in every layer's). Addresses only: a prefetch of one whose object is gone is
        harmless."""
        tensors = (*self._tensors, *self._copied)
        return list(dict.fromkeys((
            *map(id, (*self._dicts, *self._attribute_dicts, *self._hooks, *self._values, *tensors)),
            *itertools.chain.from_iterable((t._cdata, t._cdata + 64, t.untyped_storage()._cdata) for t in tensors))))

    def stale(self) -> bool:
        return (tuple(map(len, self._dicts)) != self._lengths
                or not all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, self._dicts)), self._values))
                or not all(map(operator.is_, map(dict.get, self._attribute_dicts, _BIAS), self._biases))
                or _memory(self._tensors) != self._memory
                or any(self._hooks) != self._hooked
                or tuple(map(_VERSION, self._copied)) != self._versions)


def _memory(tensors: tuple) -> tuple:
    return tuple(map(torch.Tensor.data_ptr, tensors)), tuple(map(torch.Tensor.numel, tensors))
