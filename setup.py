"""Ship the native kernel sources (the repository's `csrc/`) inside the package.

The kernels are JIT-built from source on first use (`chunk_llama/ops/jit.py`), so an
installed chunk-llama needs the C++/CUDA sources at run time. They live in `csrc/` at
the repository root, outside the Python package; `build_py` copies that tree into the
built package as `chunk_llama/csrc/`, so `pip install .`, a wheel and a wheel built from
the sdist (MANIFEST.in grafts `csrc/` into it) carry them. An editable install copies
nothing: `ops/jit.py` then reads the repository's `csrc/` directly.

Everything else is configured in pyproject.toml.
"""

from __future__ import annotations

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
# Build artefacts a developer may leave in csrc/: never shipped (as MANIFEST.in).
SKIP_SUFFIXES = (".o", ".so", ".a", ".pyc", ".pyo")


def _native_files() -> list[str]:
    """Paths under csrc/ (relative to it) of every file the JIT build may read: all of
    them (sources, headers, the README's file map) but hidden files and build artefacts."""
    if not os.path.isdir(CSRC):
        raise RuntimeError(f"chunk-llama: the native kernel sources are missing ({CSRC} does not exist); "
                           "build from a checkout of the repository or from its sdist")
    files = []
    for folder, dirs, names in os.walk(CSRC):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in names:
            if not name.startswith(".") and not name.endswith(SKIP_SUFFIXES):
                files.append(os.path.relpath(os.path.join(folder, name), CSRC))
    if not any(f.endswith(".cpp") for f in files):
        raise RuntimeError(f"chunk-llama: {CSRC} holds no C++ sources")
    return sorted(files)


class BuildPyWithKernelSources(build_py):
    """build_py, plus csrc/** copied to <build_lib>/chunk_llama/csrc/ (not in editable mode)."""

    def _kernel_targets(self) -> list[tuple[str, str]]:
        if getattr(self, "editable_mode", False):
            return []
        target = os.path.join(self.build_lib, "chunk_llama", "csrc")
        return [(os.path.join(CSRC, f), os.path.join(target, f)) for f in _native_files()]

    def run(self) -> None:
        super().run()
        targets = self._kernel_targets()
        if targets:
            stale = os.path.join(self.build_lib, "chunk_llama", "csrc")
            if os.path.isdir(stale):
                shutil.rmtree(stale)  # a file removed from csrc/ must not survive in build/
        for source, target in targets:
            self.mkpath(os.path.dirname(target))
            self.copy_file(source, target, preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + [t for _, t in self._kernel_targets()]


setup(cmdclass={"build_py": BuildPyWithKernelSources})
