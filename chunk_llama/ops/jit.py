"""Build native kernels on first use with `torch.utils.cpp_extension.load` and ninja.

What a build compiles is declared once per kernel library (`build.py`: a `KernelBuild`);
this module turns such a declaration into a loaded library.

Builds are cached under `$CHUNK_LLAMA_CACHE_DIR` (default `~/.cache/chunk_llama`)
in a directory keyed by the module name (which names the target and, for the CPU,
the variants it holds), the torch version and a hash of the sources and flags, so a
changed source or torch rebuilds and an unchanged one loads at once. A file lock
(`filelock`) keeps parallel processes from building the same module at once: one
builds, the others wait and then load its result. Before a build, one line on stderr
says what is being built and about how long it takes (the duration of the last build
of that module on this machine, else the caller's estimate).
`CHUNK_LLAMA_FORCE_REFERENCE=1` skips native kernels entirely; a failed build warns
once, `build_failure(name)` keeps the reason, and the caller falls back to the
PyTorch reference.

The sources: an installed package (`pip install .`, a wheel) carries them as package
data in `chunk_llama/csrc/` (setup.py copies the repository's `csrc/` there when it
builds); a checkout or an editable install reads the repository's `csrc/`. Sources
missing at build time (a package built without them) fail like a build, with that
reason, and the caller falls back to the reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from filelock import FileLock

if TYPE_CHECKING:
    from chunk_llama.ops.build import KernelBuild

PACKAGE_CSRC = Path(__file__).resolve().parents[1] / "csrc"  # installed: package data
REPO_CSRC = Path(__file__).resolve().parents[2] / "csrc"  # checkout, editable install
CSRC = PACKAGE_CSRC if PACKAGE_CSRC.is_dir() else REPO_CSRC
_modules: dict[str, object] = {}
_failures: dict[str, str] = {}


def setting(name: str, default: str = "") -> str:
    """Environment variable `name` (the kernels' settings are read when a step chooses its
    backend, once per forward, not at every layer)."""
    return os.environ.get(name, default)


def force_reference() -> bool:
    return setting("CHUNK_LLAMA_FORCE_REFERENCE") not in ("", "0")


def cache_dir() -> Path:
    return Path(os.environ.get("CHUNK_LLAMA_CACHE_DIR", Path.home() / ".cache" / "chunk_llama"))


def build_failure(name: str) -> str | None:
    """Why building `name` failed in this process, or None (not failed, or not tried)."""
    return _failures.get(name)


def _digest(sources: list[Path], flags: list[str]) -> str:
    h = hashlib.sha256()
    native = {p for p in CSRC.rglob("*") if p.suffix in (".h", ".cuh", ".cu", ".cpp")}
    for path in sorted(set(sources) | native):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    h.update(" ".join(flags).encode())
    return h.hexdigest()[:16]


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


def load_extension(spec: KernelBuild):
    """The library `spec` declares, built on first use: its torch ops namespace
    (`torch.ops.<spec.namespace>`), or None (forced reference, or the build failed: warned
    once, see `build_failure`)."""
    name = spec.name
    if force_reference() or name in _failures:
        return None
    if name in _modules:
        return _modules[name]
    sources = [CSRC / source for source in spec.sources]
    missing = [str(s) for s in sources if not s.is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        _failures[name] = (f"the native kernel sources are missing ({missing[0]}{more} not found; looked for "
                           f"{PACKAGE_CSRC} and {REPO_CSRC}): this chunk-llama was installed without csrc/, "
                           "reinstall it from the repository, its sdist or a wheel built by its setup.py")
        warnings.warn(f"chunk-llama: cannot build {name}, using the PyTorch reference: {_failures[name]}",
                      stacklevel=2)
        return None
    from torch.utils import cpp_extension

    flags = [*spec.cflags, *spec.cuda_cflags, *spec.ldflags]
    digest = _digest(sources, flags)
    build_dir = cache_dir() / f"{name}-torch{torch.__version__}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    module_name = f"{name}_{digest}"
    try:
        # beside the build folder: torch's own baton is `<build_dir>/lock`
        with FileLock(str(build_dir.parent / f"{build_dir.name}.lock")):
            # Holding our lock, no other process builds here: a baton torch left behind is
            # from a build that was killed (torch's baton is a plain file, never released
            # by a dead process), and would make this load wait for it forever.
            (build_dir / "lock").unlink(missing_ok=True)
            built = (build_dir / f"{module_name}.so").exists()
            if not built:
                print(f"chunk-llama: building {spec.description or name} (first use only, about "
                      f"{_estimate_seconds(name, spec.estimate_seconds):.0f} s)", file=sys.stderr, flush=True)
            start = time.perf_counter()
            cpp_extension.load(
                name=module_name,
                sources=[str(s) for s in sources],
                extra_include_paths=[str(CSRC / "include")],
                extra_cflags=list(spec.cflags),
                extra_cuda_cflags=list(spec.cuda_cflags) or None,
                extra_ldflags=list(spec.ldflags) or None,
                build_directory=str(build_dir),
                verbose=os.environ.get("CHUNK_LLAMA_VERBOSE_BUILD", "") not in ("", "0"),
                is_python_module=False,  # the library registers torch ops (TORCH_LIBRARY)
            )
            if not built:
                _record_seconds(name, time.perf_counter() - start)
    except Exception as error:  # noqa: BLE001 - any build failure means: use the reference
        last_line = str(error).strip().splitlines()[-1] if str(error).strip() else repr(error)
        _failures[name] = f"building {name} failed: {last_line}"
        warnings.warn(f"chunk-llama: building {name} failed, using the PyTorch reference ({error})",
                      stacklevel=2)
        return None
    module = _modules[name] = getattr(torch.ops, spec.namespace)
    return module
