"""A GGUF file's tensors, memory-mapped, without its metadata: `file_tensors`.

gguf-py's `GGUFReader` parses every metadata value into numpy arrays and keeps them: a
vocabulary of 262,144 tokens (Gemma 3's) holds 650 MB for as long as the reader lives.
Loading weights needs the tensor table and the architecture only, so this reads the header
with `header.read_header` stepping over the vocabulary's strings (tens of milliseconds) and
gives each tensor as gguf-py's reader would (`FileTensor`: the same name, type and data
layout, so gguf-py's `dequantize` takes it as it is).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from typing import NamedTuple

import numpy as np

from chunk_llama.gguf.header import read_header


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
    architecture and alignment are used. ValueError for what is not such a file (a
    truncated or corrupt one included)."""
    from gguf import quant_shape_to_byte_shape

    try:
        header = read_header(gguf_path, keep_strings=False)
        architecture = header.architecture
    except ValueError as error:
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({error})") from error
    if header.byte_order != "<":
        raise ValueError(f"{gguf_path} is a big-endian GGUF file: its tensors are not read here")
    blob = np.memmap(gguf_path, mode="r", dtype=np.uint8)
    tensors = []
    for entry in header.tensors:
        raw = blob[entry.start:entry.start + entry.n_bytes]
        values = _VALUE_TYPES.get(entry.tensor_type.name)
        tensors.append(FileTensor(entry.name, entry.tensor_type, raw.view(values).reshape(entry.shape)
                                  if values is not None else
                                  raw.reshape(quant_shape_to_byte_shape(entry.shape, entry.tensor_type))))
    return architecture, tensors, frozenset(header.values)


# GGML types gguf-py's reader gives as values (the others, bfloat16 included, as bytes)
_VALUE_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


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
