"""Build native kernels on first use with `torch.utils.cpp_extension.load` and ninja.

Builds are cached under `$CHUNK_LLAMA_CACHE_DIR` (default `~/.cache/chunk_llama`)
in a directory keyed by the torch version, the target and a hash of the sources
and flags, so a changed source or torch rebuilds and an unchanged one loads at
once. A file lock keeps parallel processes from building the same module at once.
`CHUNK_LLAMA_FORCE_REFERENCE=1` skips native kernels entirely; a failed build
warns once and the caller falls back to the PyTorch reference.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_modules: dict[str, object] = {}
_failed: set[str] = set()


def force_reference() -> bool:
    return os.environ.get("CHUNK_LLAMA_FORCE_REFERENCE", "") not in ("", "0")


def cache_dir() -> Path:
    return Path(os.environ.get("CHUNK_LLAMA_CACHE_DIR", Path.home() / ".cache" / "chunk_llama"))


def _digest(sources: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    native = {p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".cu", ".cpp")}
    for path in sorted(set(sources) | native):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:16]


def load_extension(
    name: str,
    sources: list[Path],
    *,
    cflags: list[str],
    cuda_cflags: list[str] | None = None,
    ldflags: list[str] | None = None,
):
    """The built module, or None (forced reference, or the build failed: warned once)."""
    if force_reference() or name in _failed:
        return None
    if name in _modules:
        return _modules[name]
    from torch.utils import cpp_extension

    digest = _digest(sources, cflags + (cuda_cflags or []) + (ldflags or []))
    build_dir = cache_dir() / f"{name}-torch{torch.__version__}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        # beside the build folder: torch's own baton is `<build_dir>/lock`
        with open(build_dir.parent / f"{build_dir.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait, then load
            module = cpp_extension.load(
                name=f"{name}_{digest}",
                sources=[str(s) for s in sources],
                extra_include_paths=[str(CSRC / "include")],
                extra_cflags=cflags,
                extra_cuda_cflags=cuda_cflags,
                extra_ldflags=ldflags,
                build_directory=str(build_dir),
                verbose=os.environ.get("CHUNK_LLAMA_VERBOSE_BUILD", "") not in ("", "0"),
            )
    except Exception as error:  # noqa: BLE001 - any build failure means: use the reference
        _failed.add(name)
        warnings.warn(f"chunk-llama: building {name} failed, using the PyTorch reference ({error})", stacklevel=2)
        return None
    _modules[name] = module
    return module
