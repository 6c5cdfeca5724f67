"""Build a native kernel library from the package's sources on first use (for development
and for hosts the wheel carries no prebuilt library for; `native.py` decides).

What a build compiles is declared once per library (`spec.py`: a `KernelBuild`) and
compiled by `build.compile_library`, as the wheel's build does. Builds are cached under
`$CHUNK_LLAMA_CACHE_DIR` (default `~/.cache/chunk_llama`) in a folder keyed by the
library's name (which names the target and, for the CPU, the variants it holds) and a
hash of the sources and flags, so a changed source rebuilds and an unchanged one loads at
once; the libraries are torch-free, so a torch upgrade does not rebuild. A file lock
(`filelock`) keeps parallel processes from building the same library at once: one builds,
the others wait and then load its result. Before a build, one line on stderr says what is
being built and about how long it takes (the duration of the last build of that library
on this machine, else the declaration's estimate).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from filelock import FileLock

from chunk_llama.ops.build.spec import KernelBuild, compile_library, find_compiler, source_digest


def setting(name: str, default: str = "") -> str:
    """Environment variable `name` (the kernels' settings are read when a step chooses its
    backend, once per forward, not at every layer)."""
    return os.environ.get(name, default)


def force_reference() -> bool:
    return setting("CHUNK_LLAMA_FORCE_REFERENCE") not in ("", "0")


def cache_dir() -> Path:
    return Path(os.environ.get("CHUNK_LLAMA_CACHE_DIR", Path.home() / ".cache" / "chunk_llama"))


def build_dir(spec: KernelBuild) -> Path:
    """Where the first-use build of `spec` lives (objects and library)."""
    return cache_dir() / f"{spec.name}-{source_digest(spec)}"


def _timings_path() -> Path:
    return cache_dir() / "build_seconds.json"


def _estimate_seconds(name: str, default: float) -> float:
    try:
        return float(json.loads(_timings_path().read_text())[name])
    except (OSError, ValueError, KeyError, TypeError):
        return default


def _record_seconds(name: str, seconds: float) -> None:
    try:
        timings = json.loads(_timings_path().read_text())
    except (OSError, ValueError):
        timings = {}
    timings[name] = round(seconds, 1)
    try:
        _timings_path().write_text(json.dumps(timings))
    except OSError:
        pass  # an estimate for next time, nothing more


def build_library(spec: KernelBuild) -> Path:
    """The library `spec` declares, built from the package's sources unless this cache
    already holds it; its path. `build.BuildError` (or OSError) when it cannot be built."""
    folder = build_dir(spec)
    library = folder / spec.filename
    if library.exists():
        return library
    find_compiler(spec)  # BuildError before the "building" line where there is no compiler
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.parent / f"{folder.name}.lock")):
        if library.exists():  # another process built it while this one waited
            return library
        print(f"chunk-llama: building {spec.description or spec.name} (first use only, about "
              f"{_estimate_seconds(spec.name, spec.estimate_seconds):.0f} s)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        compile_library(spec, folder)
        _record_seconds(spec.name, time.perf_counter() - start)
    return library
