"""Find and load the native kernel libraries: the one the installed wheel carries, else one
built from the package's sources on first use (`jit.py`), else none (the caller runs the
PyTorch reference and logs why).

A platform wheel carries prebuilt libraries in `chunk_llama/_native/` with a manifest
(`manifest.json`: each library's file name, the hash of the sources and flags it was built
from, and for CUDA its architectures), written by `setup.py`. A packaged library is used
only when that hash is the one of the package's own sources (so an edited checkout never
runs a stale library), it loads, and its C interface is the version its binding expects;
otherwise, and where the wheel has none (another platform, an sdist or editable install),
the library is built. `CHUNK_LLAMA_FORCE_REFERENCE=1` skips native kernels entirely. A
library that can be neither loaded nor built is warned about once, and `failure(name)`
keeps the reason for the backend's log line.
"""

from __future__ import annotations

import functools
import json
import logging
import warnings
from pathlib import Path
from typing import Callable, TypeVar

from chunk_llama.ops.build import jit
from chunk_llama.ops.build.spec import BuildError, KernelBuild, source_digest

PREBUILT = Path(__file__).resolve().parents[2] / "_native"
MANIFEST = PREBUILT / "manifest.json"
logger = logging.getLogger("chunk_llama.ops")
Binding = TypeVar("Binding")
_loaded: dict[str, object] = {}
_failures: dict[str, str] = {}


@functools.cache
def manifest() -> dict:
    """The wheel's manifest, {file name: {"digest", "cuda_archs"}}; empty where there is none."""
    try:
        return json.loads(MANIFEST.read_text())["libraries"]
    except (OSError, ValueError, KeyError):
        return {}


def prebuilt(spec: KernelBuild) -> Path | None:
    """The packaged library of `spec`, if the package holds one built from its own sources."""
    entry = manifest().get(spec.filename)
    path = PREBUILT / spec.filename
    if entry is None or not path.is_file() or entry.get("digest") != source_digest(spec):
        return None
    return path


def prebuilt_cuda_archs() -> tuple[str, ...] | None:
    """The architectures of the packaged CUDA library, or None where the package has none."""
    for entry in manifest().values():
        if entry.get("cuda_archs"):
            return tuple(entry["cuda_archs"])
    return None


def failure(name: str) -> str | None:
    """Why library `name` is not available in this process, or None (loaded, or not tried)."""
    return _failures.get(name)


def load(spec: KernelBuild, bind: Callable[[Path, str], Binding], packaged: KernelBuild | None = None) -> Binding | None:
    """The binding of library `spec` (`bind(path, origin)`, origin "prebuilt" or "built"):
    the packaged library of `packaged` (default: `spec` itself; the wheel's CUDA library holds
    several architectures), else `spec` built on first use; None when native kernels are
    forced off or neither works (warned once, see `failure`)."""
    name = spec.name
    if jit.force_reference() or name in _failures:
        return None
    if name in _loaded:
        return _loaded[name]
    path = prebuilt(packaged or spec)
    problem = None
    if path is not None:
        try:
            binding = _loaded[name] = bind(path, "prebuilt")
            return binding
        except (OSError, ValueError) as error:
            problem = f"the packaged {path.name} does not run here ({error})"
            logger.warning("chunk-llama: %s; building %s from source", problem, spec.filename)
    try:
        binding = _loaded[name] = bind(jit.build_library(spec), "built")
        return binding
    except (BuildError, OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
        where = problem or f"this installation carries no prebuilt {(packaged or spec).filename}"
        _failures[name] = f"{where}, and building it from source failed: {reason}"
        warnings.warn(f"chunk-llama: {spec.description or name} are not available, using the PyTorch reference: "
                      f"{_failures[name]}", stacklevel=2)
        return None
