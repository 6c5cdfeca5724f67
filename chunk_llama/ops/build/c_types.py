"""The C types the native libraries' ctypes bindings pass (`cpu/binding.py`, `cuda/binding.py`)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

P, I64, I32, F64, STR = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_char_p


def int64_array(values: Sequence[int]) -> ctypes.Array:
    """A plan's layout (or any int64 list) as the C interfaces read it, made once per plan."""
    return (I64 * len(values))(*values)
