"""A .gguf file's metadata read once per load, fast: `read_once`.

transformers (5.23, 5.24) reads a GGUF file's metadata five times while it builds the
config and the tokenizer. Twice (`AutoConfig`, `AutoTokenizer`: the config of every
architecture but the few its newer reader covers) `load_gguf_checkpoint(path,
return_tensors=False)` parses the file with gguf-py's `GGUFReader`, which makes numpy views
of every element of every array one at a time: for Gemma 3's 262,144 tokens 13-16 s a call,
where llama.cpp starts in 6-7 s. Three times its newer `read_gguf_metadata` (the
architecture check of both, and the tokenizer's vocabulary) walks the vocabulary in Python.

Within `read_once` both are served from one `header.read_header` of the file (0.15 s for
Gemma 3), through transformers' own code: `load_gguf_checkpoint` runs as it is, on a reader
with the interface of `GGUFReader` that transformers reads (`fields`: each key's `parts`,
`data` and `types`; `tensors`' names), so its mapping of keys to config, tokenizer and
tokenizer_config entries is its own in either release. Outside the block, in other threads,
and for files these readers would not read alike (big-endian, arrays of arrays), everything
is transformers' as it is.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import numpy as np

from chunk_llama.gguf.header import ARRAY, FIXED, STRING, Header, read_header

_SWAP = threading.Lock()  # one load at a time swaps transformers' readers
_current = threading.local()  # .headers: {path: Header} on the thread inside read_once


@contextlib.contextmanager
def read_once():
    """Within this block, on this thread, transformers' `load_gguf_checkpoint(path,
    return_tensors=False)` and `read_gguf_metadata` read each file's header once (module
    doc); any other call goes to them as they are."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as legacy
    from transformers.integrations import gguf as integration
    from transformers.integrations.gguf import reader as new_reader

    read_checkpoint, read_metadata, stock_reader = legacy.load_gguf_checkpoint, new_reader.read_gguf_metadata, \
        gguf.GGUFReader

    def load_gguf_checkpoint(path, return_tensors=False, *args, **kwargs):
        header = _header(path) if not (return_tensors or args or kwargs) else None
        if header is None or not _whole_lists_pass():
            return read_checkpoint(path, return_tensors, *args, **kwargs)
        _current.reader = _FieldsReader(header)  # what gguf.GGUFReader(path) gives on this thread now
        try:
            return read_checkpoint(path)
        finally:
            _current.reader = None

    def read_gguf_metadata(gguf_path, string_arrays=()):
        header = _header(gguf_path)
        if header is None:
            return read_metadata(gguf_path, string_arrays)
        return _new_reader_metadata(header, string_arrays), tuple(entry.name for entry in header.tensors)

    class GGUFReader(stock_reader):  # (a subclass: isinstance checks against gguf.GGUFReader still hold)
        def __new__(cls, *args, **kwargs):
            reader = getattr(_current, "reader", None)
            return reader if reader is not None else super().__new__(cls)

    # (transformers imports these from their modules at each call, so the swap reaches it)
    swaps = [(legacy, "load_gguf_checkpoint", load_gguf_checkpoint), (new_reader, "read_gguf_metadata",
             read_gguf_metadata), (integration, "read_gguf_metadata", read_gguf_metadata), (gguf, "GGUFReader",
             GGUFReader)]
    with _SWAP:
        kept = [(module, name, getattr(module, name)) for module, name, _ in swaps]
        _current.headers = {}
        try:
            for module, name, value in swaps:
                setattr(module, name, value)
            yield
        finally:
            for module, name, value in kept:
                setattr(module, name, value)
            _current.headers = None


def _header(path) -> Header | None:
    """The file's header, read once within the block on this thread; None elsewhere, and
    where transformers' readers do not read such a file alike (big-endian: gguf-py swaps it,
    transformers' newer reader does not; arrays of arrays: neither reads them)."""
    headers = getattr(_current, "headers", None)
    if headers is None:
        return None
    key = os.path.realpath(path)
    if key not in headers:
        headers[key] = read_header(path)
    header = headers[key]
    if header.byte_order != "<" or any(len(types) > 2 for types in header.types.values()):
        return None
    return header


def _new_reader_metadata(header: Header, string_arrays) -> dict:
    """What transformers' `read_gguf_metadata` makes of the header: values as they are, a
    string array its length unless in `string_arrays` (each value a new list)."""
    metadata = {}
    for key, value in header.values.items():
        if header.types[key] == (ARRAY, STRING) and key not in string_arrays:
            metadata[key] = len(value)
        else:
            metadata[key] = list(value) if isinstance(value, list) else value
    if "general.architecture" not in metadata:  # (its message)
        raise ValueError(f"{header.path} has no `general.architecture` in its metadata.")
    return metadata


class _Field:
    """A key as gguf-py's `ReaderField` gives it to transformers: `parts` (the key's own
    parts, then the value's), `data` (the indices of the value's parts), `types`."""

    __slots__ = ("data", "name", "parts", "types")

    def __init__(self, name: str, parts: list, data: list, types: list):
        self.name, self.parts, self.data, self.types = name, parts, data, types


class _FieldsReader:
    """The part of gguf-py's `GGUFReader` that transformers' `load_gguf_checkpoint` reads
    without tensors: `fields` (GGUF.version, GGUF.tensor_count, GGUF.kv_count, then the
    metadata in the file's order) and `tensors` (each with its `name`)."""

    def __init__(self, header: Header):
        key_type = np.array([0], dtype=np.uint32)  # (no part transformers reads)
        self.fields = {name: _Field(name, [value], [0], [type_]) for name, value, type_ in (
            ("GGUF.version", np.array([header.version], np.uint32), 4),
            ("GGUF.tensor_count", np.array([len(header.tensors)], np.uint64), 10),
            ("GGUF.kv_count", np.array([len(header.values)], np.uint64), 10))}
        for key, value in header.values.items():
            encoded = np.frombuffer(key.encode(), dtype=np.uint8)
            parts, data, types = _value_parts(value, header.types[key])
            self.fields[key] = _Field(key, [np.array([encoded.size], np.uint64), encoded, key_type, *parts],
                                      [index + 3 for index in data], types)
        self.tensors = header.tensors


def _value_parts(value, types: tuple[int, ...]) -> tuple[list, list[int], list[int]]:
    """(parts, data, types) of one value as `GGUFReader` lays them out, for transformers'
    `_gguf_parse_value(parts[i], types)` over `data`; except that an array of two or more
    elements is one part, the whole list, under types [ARRAY, ARRAY], which that function
    returns as it is (`_whole_lists_pass`): the same list it would build element by element
    (1.2 s for Gemma 3's three arrays), at once."""
    if types[0] != ARRAY:
        return _element_parts(value, types[0]), [0] if types[0] != STRING else [1], [types[0]]
    if not value:  # (gguf-py then knows no element type)
        return [np.array([types[1]], np.uint32), np.array([0], np.uint64)], [], [ARRAY]
    head = [np.array([types[1]], np.uint32), np.array([len(value)], np.uint64)]
    if len(value) >= 2:
        return [*head, list(value)], [2], [ARRAY, ARRAY]
    element = _element_parts(value[0], types[1])  # one element: transformers takes it out of its list
    return [*head, *element], [len(head) + len(element) - 1], [ARRAY, types[1]]


def _element_parts(value, value_type: int) -> list:
    """A scalar's parts as `GGUFReader` gives them: a one-element array of its type; a
    string's length and its UTF-8 bytes."""
    if value_type == STRING:
        encoded = np.frombuffer(value.encode(), dtype=np.uint8)
        return [np.array([encoded.size], np.uint64), encoded]
    return [np.array([value], dtype=np.dtype(FIXED[value_type]))]


@functools.cache
def _whole_lists_pass() -> bool:
    """Whether transformers' `_gguf_parse_value` returns a part under types [ARRAY, ARRAY] as
    it is (5.23 and 5.24 do: no element type it converts); if not, `read_once` leaves
    `load_gguf_checkpoint` to gguf-py's reader rather than give it anything else."""
    from transformers.integrations.ggml import _gguf_parse_value

    probe = ["a", "b"]
    try:
        return _gguf_parse_value(probe, [ARRAY, ARRAY]) is probe
    except Exception:  # noqa: BLE001 (any failure means: not here)
        return False
