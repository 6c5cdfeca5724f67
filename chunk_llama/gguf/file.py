"""A GGUF file's tensors, memory-mapped, without its metadata: `file_tensors`.

gguf-py's `GGUFReader` parses every metadata value into numpy arrays and keeps them: a
vocabulary of 262,144 tokens (Gemma 3's) holds 650 MB for as long as the reader lives.
Loading weights needs the tensor table and the architecture only, so this walks the
metadata without keeping it and gives each tensor as gguf-py's reader would (`FileTensor`:
the same name, type and data layout, so gguf-py's `dequantize` takes it as it is).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import struct
from typing import NamedTuple

import numpy as np


class FileTensor(NamedTuple):
    """One tensor of a GGUF file as gguf-py's reader gives it: `tensor_type` a
    gguf.GGMLQuantizationType, `data` memory-mapped, values (float32, float16, ints) in
    torch's dimension order or, for block formats, uint8 [..., row_bytes]."""

    name: str
    tensor_type: object
    data: np.ndarray


def file_tensors(gguf_path: str) -> tuple[str, list[FileTensor], frozenset[str]]:
    """(architecture, tensors, the metadata's keys) of a GGUF file (v2 or v3,
    little-endian), its data memory-mapped, not read; of the metadata's values only the
    architecture and alignment are kept. ValueError for what is not such a file (a
    truncated or corrupt one included)."""
    try:
        return _file_tensors(gguf_path)
    except (struct.error, IndexError, KeyError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({type(error).__name__}: {error})") from error


def _file_tensors(gguf_path: str) -> tuple[str, list[FileTensor], frozenset[str]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape

    blob = np.memmap(gguf_path, mode="r", dtype=np.uint8)
    if bytes(blob[:4]) != b"GGUF" or struct.unpack_from("<I", blob, 4)[0] not in (2, 3):
        raise ValueError(f"{gguf_path} is not a little-endian GGUF v2/v3 file")
    tensor_count, value_count = struct.unpack_from("<QQ", blob, 8)
    position, wanted, keys = 24, {"general.architecture": None, "general.alignment": 32}, set()
    for _ in range(value_count):
        key, position = _string(blob, position)
        value, position = _value(blob, position + 4, struct.unpack_from("<I", blob, position)[0])
        keys.add(key)
        if key in wanted:
            wanted[key] = value
    table = []
    for _ in range(tensor_count):
        name, position = _string(blob, position)
        (dims,) = struct.unpack_from("<I", blob, position)
        shape = tuple(reversed(struct.unpack_from(f"<{dims}Q", blob, position + 4)))  # torch's order
        tensor_type, offset = struct.unpack_from("<IQ", blob, position + 4 + 8 * dims)
        position += 4 + 8 * dims + 12
        try:
            table.append((name, shape, GGMLQuantizationType(tensor_type), offset))
        except ValueError:
            raise ValueError(f"{gguf_path}: tensor {name} has GGML type {tensor_type}, unknown to gguf-py") from None
    alignment = wanted["general.alignment"]
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"{gguf_path}: general.alignment is {alignment!r}")
    data_start = (position + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, tensor_type, offset in table:
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        start = data_start + offset
        size = math.prod(shape) // block * block_bytes
        raw = blob[start:start + size]
        if len(raw) != size:
            raise ValueError(f"{gguf_path} ends inside tensor {name}: the file is cut short")
        values = _VALUE_TYPES.get(tensor_type.name)
        tensors.append(FileTensor(name, tensor_type, raw.view(values).reshape(shape) if values is not None else
                                  raw.reshape(quant_shape_to_byte_shape(shape, tensor_type))))
    if not isinstance(wanted["general.architecture"], str):
        raise ValueError(f"{gguf_path} names no general.architecture")
    return wanted["general.architecture"], tensors, frozenset(keys)


# GGML types gguf-py's reader gives as values (the others, bfloat16 included, as bytes)
_VALUE_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}
# GGUF metadata value types of a fixed width: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _string(blob: np.ndarray, position: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, position)
    return bytes(blob[position + 8:position + 8 + length]).decode("utf-8", "replace"), position + 8 + length


def _value(blob: np.ndarray, position: int, value_type: int):
    """(a metadata value, the position after it); an array's elements are skipped (None)."""
    if value_type in _FIXED:
        return struct.unpack_from(_FIXED[value_type], blob, position)[0], position + struct.calcsize(_FIXED[value_type])
    if value_type == 8:
        return _string(blob, position)
    if value_type != 9:
        raise ValueError(f"unknown GGUF metadata value type {value_type}")
    element_type, count = struct.unpack_from("<IQ", blob, position)
    position += 12
    if element_type in _FIXED:
        return None, position + count * struct.calcsize(_FIXED[element_type])
    for _ in range(count):  # strings (a vocabulary) or arrays: walked, not kept
        _, position = _value(blob, position, element_type)
    return None, position


def release_pages(data: np.ndarray) -> None:
    """Drop the file pages `data` (a slice of the memory-mapped file) holds from this process's
    resident set (they are read again if touched): a loader that copies each tensor out of the
    file then peaks at the copies, not at the copies and the file."""
    page = mmap.PAGESIZE
    start = -(-data.ctypes.data // page) * page  # whole pages inside the slice only
    _madvise(start, (data.ctypes.data + data.nbytes) // page * page, mmap.MADV_DONTNEED)


def populate_pages(data: np.ndarray) -> None:
    """Map every page of `data` (a slice of the memory-mapped file) in one call before it is
    copied: page by page, the faults of a 4.6 GB file took 10 s of an 8B model's load
    (MADV_POPULATE_READ, Linux 5.14; elsewhere the copy faults them in as before)."""
    page = mmap.PAGESIZE
    _madvise(data.ctypes.data // page * page, data.ctypes.data + data.nbytes, _MADV_POPULATE_READ)


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # (Python 3.13 names it; Linux's value)


def _madvise(start: int, end: int, advice: int) -> None:
    libc = _libc()
    if libc is not None and end > start:  # advice only: a kernel that refuses it changes no result
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True) if hasattr(mmap, "MADV_DONTNEED") else None
    except OSError:
        return None
