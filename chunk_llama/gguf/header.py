"""A GGUF file's header (metadata and tensor table) parsed straight from the mapped file: `read_header`.

gguf-py's `GGUFReader`, which transformers reads a file's metadata with, makes numpy views of
every element of every array, one at a time: for Gemma 3's vocabulary of 262,144 tokens
(strings, scores, token types) that is about 20 s, where llama.cpp starts in 7 s. Here each
value is read with `struct` from the file's `mmap` (a slice of it is `bytes`, no view object),
a string array in one pass, a numeric array as one `numpy.frombuffer`: well under a second.

GGUF v2 and v3, either byte order (as gguf-py reads them). Whatever does not parse (a file cut
short, a length pointing past the end, a value type GGUF does not have, a key twice, a string
that is not UTF-8, a tensor of unknown type or past the end) is a ValueError naming the
problem and where it is.
"""

from __future__ import annotations

import math
import mmap
import struct
from typing import NamedTuple

import numpy as np

STRING, ARRAY = 8, 9  # the two GGUF value types of no fixed width
# the fixed-width ones: u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64 (struct / numpy codes)
FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
DEFAULT_ALIGNMENT = 32  # GGUF's, where general.alignment is absent


class TensorEntry(NamedTuple):
    """One row of the tensor table: `shape` in torch's order (GGUF lists dimensions the other way
    round), `tensor_type` a gguf.GGMLQuantizationType, `start` the data's offset in the file."""

    name: str
    shape: tuple[int, ...]
    tensor_type: object
    start: int
    n_bytes: int


class Header(NamedTuple):
    """A GGUF file's header. `values[key]`: a number, bool or str, or a list of them for an
    array (of lists for an array of arrays); `types[key]`: the value's GGUF type and, for an
    array, its element type (and theirs, nested), as the file gives them; both in the file's
    order. `byte_order` is "<" or ">"."""

    path: str
    version: int
    byte_order: str
    values: dict[str, object]
    types: dict[str, tuple[int, ...]]
    tensors: tuple[TensorEntry, ...]
    data_start: int

    @property
    def architecture(self) -> str:
        """general.architecture; ValueError where the file names none."""
        architecture = self.values.get("general.architecture")
        if isinstance(architecture, str):
            return architecture
        raise ValueError(f"{self.path} names no general.architecture")


def read_header(path: str, keep_strings: bool = True) -> Header:
    """The header of the GGUF file at `path` (module doc). With `keep_strings=False` a string
    array's elements are stepped over, not decoded (its value is then its length): what a
    reader of the tensors only needs."""
    with open(path, "rb") as file:
        try:
            blob = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path} is not a GGUF file: it is empty") from None
    with blob:
        try:
            return _Parser(path, blob, keep_strings).header()
        except (struct.error, OverflowError):  # a read past the end (a corrupt length: past any offset there is)
            raise ValueError(f"{path} ends inside its GGUF header: the file is cut short, or a length in "
                             "the header runs past its end") from None


class _Parser:
    """One pass over the header: `position` moves forward through `blob` as each item is read."""

    def __init__(self, path: str, blob: mmap.mmap, keep_strings: bool):
        self.path, self.blob, self.keep_strings, self.position = path, blob, keep_strings, 0

    def header(self) -> Header:
        blob, path = self.blob, self.path
        if blob[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it starts {bytes(blob[:4])!r}, not b'GGUF')")
        (version,) = struct.unpack_from("<I", blob, 4)
        order = "<"
        if version & 0xFFFF == 0:  # a big-endian file (gguf-py's test: the version's low half is zero)
            order, (version,) = ">", struct.unpack_from(">I", blob, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
        self.order = order
        self.length = struct.Struct(order + "Q").unpack_from
        tensor_count, value_count = struct.unpack_from(order + "QQ", blob, 8)
        self.position = 24
        values, types = {}, {}
        for index in range(value_count):
            key = self._string(f"the name of metadata value {index}")
            if key in values:
                raise ValueError(f"{path}: metadata key {key} is given twice")
            (value_type,) = self._fixed("I")
            values[key], types[key] = self._value(value_type, key)
        alignment = values.get("general.alignment", DEFAULT_ALIGNMENT)
        if types.get("general.alignment", (4,)) != (4,) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment is {alignment!r}, not a uint32 power of two")
        table = [self._tensor_row(index) for index in range(tensor_count)]
        data_start = -(-self.position // alignment) * alignment
        tensors = tuple(self._entry(row, data_start) for row in table)
        names = {entry.name for entry in tensors}
        if len(names) != len(tensors):
            raise ValueError(f"{path}: a tensor name is given twice")
        return Header(path, version, order, values, types, tensors, data_start)

    def _fixed(self, code: str, count: int = 1) -> tuple:
        values = struct.unpack_from(f"{self.order}{count}{code}", self.blob, self.position)
        self.position += struct.calcsize(f"<{count}{code}")
        return values

    def _bytes(self, what: str) -> bytes:
        (size,) = self.length(self.blob, self.position)
        start, end = self.position + 8, self.position + 8 + size
        if end > len(self.blob):
            raise ValueError(f"{self.path}: {what} ({size} bytes at offset {start}) runs past the end of the file")
        self.position = end
        return self.blob[start:end]

    def _string(self, what: str) -> str:
        raw = self._bytes(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{self.path}: {what} is not UTF-8 ({error})") from None

    def _value(self, value_type: int, key: str):
        """(the value of `key`, its types) read at the position."""
        if value_type in FIXED:
            return self._fixed(FIXED[value_type])[0], (value_type,)
        if value_type == STRING:
            return self._string(f"the value of {key}"), (STRING,)
        if value_type != ARRAY:
            raise ValueError(f"{self.path}: metadata value {key} has type {value_type}, which GGUF does not have")
        element_type, count = self._fixed("IQ")
        if element_type in FIXED:  # one read for all of them
            code = FIXED[element_type]
            size = count * np.dtype(code).itemsize
            if self.position + size > len(self.blob):
                raise ValueError(f"{self.path}: the {count} values of {key} run past the end of the file")
            data = self.blob[self.position:self.position + size]
            self.position += size
            return np.frombuffer(data, dtype=self.order + code).tolist(), (ARRAY, element_type)
        if element_type == STRING:
            return self._strings(count, key), (ARRAY, STRING)
        if element_type != ARRAY:
            raise ValueError(f"{self.path}: metadata array {key} has elements of type {element_type}, "
                             "which GGUF does not have")
        items = [self._value(ARRAY, f"{key}[{index}]") for index in range(count)]  # an array of arrays
        inner = items[0][1] if items else (ARRAY,)
        return [value for value, _ in items], (ARRAY, *inner)

    def _strings(self, count: int, key: str):
        """An array of `count` strings (or its length: `keep_strings` False), in one loop that
        reads each length and slices the bytes after it."""
        blob, length, position, end = self.blob, self.length, self.position, len(self.blob)
        if count > (end - position) // 8:  # (each takes 8 bytes at least: a corrupt count fails here, not in a list)
            raise ValueError(f"{self.path}: the {count} strings of {key} run past the end of the file")
        if not self.keep_strings:
            for _ in range(count):
                position += 8 + length(blob, position)[0]
            if position > end:
                raise ValueError(f"{self.path}: the {count} strings of {key} run past the end of the file")
            self.position = position
            return count
        raw = [b""] * count
        for index in range(count):
            size = length(blob, position)[0]
            raw[index] = blob[position + 8:position + 8 + size]
            position += 8 + size
        if position > end:  # (a slice past the end is cut short, not an error: one check after the loop)
            raise ValueError(f"{self.path}: the {count} strings of {key} run past the end of the file")
        self.position = position
        try:
            return [item.decode("utf-8") for item in raw]
        except UnicodeDecodeError:
            index = next(i for i, item in enumerate(raw) if not _is_utf8(item))
            raise ValueError(f"{self.path}: {key}[{index}] is not UTF-8 ({raw[index]!r})") from None

    def _tensor_row(self, index: int) -> tuple:
        name = self._string(f"the name of tensor {index}")
        (dims,) = self._fixed("I")
        if dims > 16:  # (ggml has 4; a corrupt count would read on into the next rows)
            raise ValueError(f"{self.path}: tensor {name} has {dims} dimensions")
        shape = tuple(reversed(self._fixed("Q", dims)))
        tensor_type, offset = self._fixed("IQ")
        return name, shape, tensor_type, offset

    def _entry(self, row: tuple, data_start: int) -> TensorEntry:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        name, shape, raw_type, offset = row
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"{self.path}: tensor {name} has GGML type {raw_type}, unknown to gguf-py") from None
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        elements = math.prod(shape)
        if elements % block:
            raise ValueError(f"{self.path}: tensor {name} of shape {shape} is not whole {tensor_type.name} blocks")
        n_bytes, start = elements // block * block_bytes, data_start + offset
        if start + n_bytes > len(self.blob):
            raise ValueError(f"{self.path} ends inside tensor {name}: the file is cut short")
        return TensorEntry(name, shape, tensor_type, start, n_bytes)


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
