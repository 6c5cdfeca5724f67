"""A .gguf file's metadata read once per load: `read_once`.

transformers reads a GGUF file's metadata with gguf-py's `GGUFReader` (every vocabulary
string through a numpy view) for the config, then again for the tokenizer: for Gemma 3's
262,144 tokens about 20 s each, where llama.cpp starts in 7 s. Within `read_once` the
second read is the first one's result (a copy: the callers may change it).
"""

from __future__ import annotations

import contextlib
import copy
import threading

_SWAP = threading.Lock()  # one load at a time swaps transformers' reader


@contextlib.contextmanager
def read_once():
    """Within this block, `transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint` reads
    each file's metadata (return_tensors=False) once; any other call goes to it as it is."""
    from transformers import modeling_gguf_pytorch_utils as module

    read = module.load_gguf_checkpoint
    kept: dict[str, dict] = {}

    def read_metadata_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return read(path, return_tensors, *args, **kwargs)
        if path not in kept:
            kept[path] = read(path)
        return copy.deepcopy(kept[path])

    with _SWAP:  # (the callers import it from its module at each call, so the swap reaches them)
        module.load_gguf_checkpoint = read_metadata_once
        try:
            yield
        finally:
            module.load_gguf_checkpoint = read
